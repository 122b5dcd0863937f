"""Block-wise float8 HuggingFace checkpoints (models/hf/fp8.py), the format of DeepSeek-V3's and Qwen3's fp8
releases, made here from tiny random models by a quantizer written in the test.

The quantizer also computes the reference values block by block (float64, one block at a time), a different
computation from moekit's, which expands the scale grid. The tests check four things:
- moekit's import equals that reference exactly, ragged edge blocks included;
- it matches transformers' own fp8 import, which dequantizes on a CPU;
- a sharded load at ep / tp / fsdp over gloo equals the one-process load, and reads only its slices;
- a checkpoint whose scales do not match its weights, or whose quantization moekit cannot read, is refused
  with the key, the shapes and the fix.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from moekit.models.hf import config_from_hf, fp8, fp8_reference, load_hf, save_hf
from moekit.models.hf.families import UnsupportedCheckpoint
from moekit.models.transformer import build_model
from tests.dist_utils import run_ranks

transformers = pytest.importorskip("transformers")
from tests.test_hf import FAMILY_CASES, hf_family_model, hf_logits, rel_err, tokens  # noqa: E402
from tests.test_hf_sharded import tokens as small_tokens  # noqa: E402  (the vocabulary of its tiny models)

QUANT = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}


def quantizable(key: str, t: torch.Tensor) -> bool:
    """What DeepSeek-V3's release stores in fp8: the linear layers; not embeddings, norms, routers (``*.gate``),
    Qwen2-MoE's shared-expert gate, lm_head, or the MTP layer's projection and head copy."""
    return (t.dim() >= 2 and key.endswith(".weight") and "embed" not in key and "norm" not in key
            and "lm_head" not in key and not key.endswith((".gate.weight", "shared_expert_gate.weight"))
            and "eh_proj" not in key and "shared_head.head" not in key)


def quantize_folder(src: Path, dst: Path, block: tuple[int, int] | None, *, fp8_dtype=torch.float8_e4m3fn,
                    scale_dtype=torch.float32, quant: dict | None = None,
                    rest_dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """``src`` rewritten in ``dst`` with every quantizable weight in float8 and per-block scales (amax / max
    of the format, at least fp8.SCALE_FLOOR; partial blocks at the edges), the other tensors cast to
    ``rest_dtype`` when given; block None writes no weight_block_size (the 128 x 128 default). Returns
    {key: its reference value}: every block dequantized on its own in float64."""
    dst.mkdir()
    b0, b1 = block or fp8.DEFAULT_BLOCK
    top = torch.finfo(fp8_dtype).max
    tensors, reference = {}, {}
    for key, w in load_file(src / "model.safetensors").items():
        if not quantizable(key, w):
            tensors[key] = reference[key] = w.to(rest_dtype) if rest_dtype and w.is_floating_point() else w
            continue
        *lead, rows, cols = w.shape
        q = torch.empty(w.shape, dtype=fp8_dtype)
        scale = torch.empty(*lead, math.ceil(rows / b0), math.ceil(cols / b1), dtype=scale_dtype)
        ref = torch.empty(w.shape, dtype=torch.float64)
        for i in range(scale.shape[-2]):
            for j in range(scale.shape[-1]):
                at = (..., slice(i * b0, (i + 1) * b0), slice(j * b1, (j + 1) * b1))
                s = (w[at].float().abs().amax(dim=(-2, -1)) / top).clamp(min=fp8.SCALE_FLOOR).to(scale_dtype)
                scale[..., i, j] = s
                q[at] = (w[at].float() / s.float()[..., None, None]).clamp(-top, top).to(fp8_dtype)
                ref[at] = q[at].double() * s.double()[..., None, None]
        tensors[key], tensors[key + "_scale_inv"], reference[key] = q, scale, ref
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = quant or {**QUANT, **({"weight_block_size": list(block)} if block else {})}
    (dst / "config.json").write_text(json.dumps(cfg))
    return reference


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory) -> tuple[Path, object]:
    """A tiny DeepSeek-V3 (MLA with q_lora, a dense first layer, sigmoid group routing) saved by transformers."""
    folder = tmp_path_factory.mktemp("deepseek") / "float"
    model_type, overrides = FAMILY_CASES["deepseek_v3-qlora-yarn"]
    return folder, hf_family_model(folder, model_type, overrides)


def check_equals_reference(model, reference: dict[str, torch.Tensor], folder: Path) -> None:
    """Every parameter of ``model`` (loaded from ``folder``) equals the reference dequantization, read back
    through moekit's own key mapping (a moekit export of the model has the checkpoint's keys)."""
    from moekit.models.hf import export_rules
    from moekit.models.hf.weights import export_tensors

    _, rules, _ = export_rules(model, None, None, "per_expert")
    ours = export_tensors(model, rules, None)
    assert set(ours) == set(reference), set(ours) ^ set(reference)
    quantized = 0
    for key, want in reference.items():
        exact = torch.equal(ours[key], want.to(ours[key].dtype))
        assert exact, f"{folder.name}: {key} differs from the block-by-block dequantization"
        quantized += want.dtype == torch.float64
    assert quantized > 10


@pytest.mark.parametrize("block,fp8_dtype,scale_dtype", [
    ((8, 16), torch.float8_e4m3fn, torch.float32),  # 12-row kv_a, 40-wide dense FFN: partial edge blocks
    ((3, 5), torch.float8_e5m2, torch.bfloat16),  # no dimension a multiple of the block
    (None, torch.float8_e4m3fn, torch.float8_e8m0fnu),  # the 128 x 128 default: one partial block per weight
])
def test_import_equals_the_blockwise_reference(deepseek, tmp_path, block, fp8_dtype, scale_dtype):
    src, _ = deepseek
    if scale_dtype == torch.float8_e8m0fnu:  # DeepSeek-V3.1's ue8m0 scales: powers of two
        quant = {**QUANT, "scale_fmt": "ue8m0"}
    else:
        quant = None
    reference = quantize_folder(src, tmp_path / "fp8", block, fp8_dtype=fp8_dtype, scale_dtype=scale_dtype,
                                quant=quant)
    model = load_hf(tmp_path / "fp8")
    check_equals_reference(model, reference, tmp_path / "fp8")
    # the quantization is real: the model moved away from the float one, by about fp8's precision
    with torch.no_grad():
        moved = rel_err(model.layers[1].attn.wo.weight, load_hf(src).layers[1].attn.wo.weight)
    assert 1e-3 < moved < (0.3 if fp8_dtype == torch.float8_e5m2 else 0.1), moved


@pytest.mark.parametrize("case", ["deepseek_v3-fullq", "qwen3_moe"])
def test_import_matches_transformers_fp8_loading(tmp_path, case):
    """transformers loads an fp8 checkpoint on a CPU by dequantizing it (FineGrainedFP8, which needs accelerate);
    moekit's logits must equal its. Blocks divide every shape here: transformers derives the block from the scale
    grid (rows // grid rows), which differs from DeepSeek's ceil-divided grid when a block is partial."""
    pytest.importorskip("accelerate")
    import inspect

    if "dequantize" not in inspect.signature(transformers.FineGrainedFP8Config).parameters:
        pytest.skip(f"transformers {transformers.__version__} cannot dequantize fp8 checkpoints on a CPU")
    model_type, overrides = FAMILY_CASES[case]
    hf_family_model(tmp_path / "float", model_type, overrides)
    quantize_folder(tmp_path / "float", tmp_path / "fp8", (4, 8))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "fp8").eval()
    ours = load_hf(tmp_path / "fp8")
    with torch.no_grad():
        assert rel_err(ours(tokens()), hf_logits(theirs, tokens())) < 1e-5
        assert rel_err(ours(tokens()), load_hf(tmp_path / "float")(tokens())) > 1e-3  # it is quantized


def test_scale_blocks_of_a_slice():
    """scale_index names exactly the scale blocks a slice meets; dequantize of the slice with them equals the
    slice of the whole tensor's dequantization, for random slices (empty ones too) of a 3-d tensor."""
    gen = torch.Generator().manual_seed(0)
    block, shape = (4, 3), (3, 13, 11)
    w = torch.randn(shape, generator=gen).to(torch.float8_e4m3fn)
    scale = torch.rand(fp8.grid(shape, block), generator=gen) + 0.5
    whole = fp8.dequantize(w, scale, block)
    assert torch.equal(whole, w.float() * scale.repeat_interleave(4, 1)[:, :13].repeat_interleave(3, 2)[:, :, :11])
    for _ in range(200):
        index = []
        for n in shape:
            a = int(torch.randint(0, n + 1, (1,), generator=gen))
            b = int(torch.randint(a, n + 1, (1,), generator=gen))
            index.append(slice(a, b))
        index = tuple(index)
        blocks = fp8.scale_index(index, shape, block)
        rows, cols = index[1], index[2]
        if rows.stop > rows.start and cols.stop > cols.start:  # minimal: first and last block meet the slice
            assert blocks[1] == slice(rows.start // 4, (rows.stop - 1) // 4 + 1), (index, blocks)
            assert blocks[2] == slice(cols.start // 3, (cols.stop - 1) // 3 + 1), (index, blocks)
        got = fp8.dequantize(w[index], scale[blocks], block, (rows.start, cols.start))
        assert torch.equal(got, whole[index]), index


# ---------------------------------------------------------------------------------------------------
# Sharded loads: each rank reads its slices and the scale blocks over them
# ---------------------------------------------------------------------------------------------------


def _sharded(rank, world, cases):
    from tests.test_hf_sharded import counted_load, full, parallel_model

    from moekit.comm.topology import Layout, Topology
    from moekit.models.hf import sharded

    for degrees, ckpt in cases:
        ckpt = Path(ckpt)
        topo = Topology(Layout(**degrees), rank, world).build()
        ref = load_hf(ckpt)
        model = parallel_model(ckpt, topo)
        counting, reported = counted_load(model, ckpt)
        want = ref.state_dict()
        for name, t in model.state_dict().items():
            assert torch.equal(full(t), want[name]), f"{degrees} rank {rank}: {name}"
        assert counting.whole == [] and counting.read == reported
        scales = {k for k in reported if k.endswith(fp8.SCALE_SUFFIX)}
        assert scales and all(k[: -len(fp8.SCALE_SUFFIX)] in reported for k in scales)
        model.eval()
        with torch.no_grad():
            torch.testing.assert_close(model(small_tokens()), ref(small_tokens()), rtol=1e-5, atol=1e-5)
        # and back out in fp8, each rank quantizing the tensors it assembles
        out = ckpt.parent / f"export-{'-'.join(f'{k}{v}' for k, v in degrees.items())}"
        sharded.save_hf_sharded(model, out, max_shard_size=6000, fp8=True, fp8_block=(3, 5))


def test_sharded_load_and_export_at_ep_tp_fsdp(tmp_path):
    """Blocks of 3 x 5 cut across every shard boundary (experts' H rows under fsdp, MLA heads under tp). The
    sharded fp8 export equals save_hf's of the one-process model, key by key and byte by byte."""
    from tests.test_hf_sharded import check_export, make_checkpoint

    make_checkpoint(tmp_path / "float", "deepseek_v3")
    quantize_folder(tmp_path / "float", tmp_path / "fp8", (3, 5))
    layouts = [dict(ep=2, fsdp=2), dict(tp=2)]
    run_ranks(_sharded, 2, [(d, str(tmp_path / "fp8")) for d in layouts])
    for name in ("export-ep2-fsdp2", "export-tp2"):
        check_export(tmp_path / name, load_hf(tmp_path / "fp8"), tmp_path, fp8=True, fp8_block=(3, 5))


# ---------------------------------------------------------------------------------------------------
# Writing fp8: save_hf(fp8=True), moekit-convert --fp8, moekit-train --train.export_hf_fp8
# ---------------------------------------------------------------------------------------------------


def tiny_model(family: str, seed: int = 3):
    from tests.test_hf_sharded import tiny

    return build_model(tiny(family), seed=seed).eval()


def read_folder(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for p in sorted(folder.glob("*.safetensors")):
        out.update(load_file(p))
    return out


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen2_moe", "mixtral"])
def test_fp8_export_is_the_release_format(tmp_path, family):
    """save_hf(fp8=True) writes, byte for byte, what the test's block-by-block quantizer makes of the float export
    (bf16 for the rest), with the release's quantization_config; reading it back gives fp8_reference's model."""
    model = tiny_model(family)
    save_hf(model, tmp_path / "float")
    quantize_folder(tmp_path / "float", tmp_path / "want", (3, 5), rest_dtype=torch.bfloat16)
    save_hf(model, tmp_path / "fp8", fp8=True, fp8_block=(3, 5), max_shard_size=20_000)
    ours, want = read_folder(tmp_path / "fp8"), read_folder(tmp_path / "want")
    assert ours.keys() == want.keys()
    for k in want:
        assert ours[k].dtype == want[k].dtype and torch.equal(ours[k], want[k]), k
    assert sum(t.dtype == torch.float8_e4m3fn for t in ours.values()) > 10
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    assert config["quantization_config"] == {**QUANT, "weight_block_size": [3, 5]} and config["dtype"] == "bfloat16"
    back, ref = load_hf(tmp_path / "fp8").state_dict(), fp8_reference(model, fp8_block=(3, 5)).state_dict()
    assert back.keys() == ref.keys() and all(torch.equal(back[k], ref[k]) for k in ref)
    with torch.no_grad():  # fp8 moved the model by about its precision, not more
        assert 1e-3 < rel_err(load_hf(tmp_path / "fp8")(small_tokens()), model(small_tokens())) < 0.2


@pytest.mark.parametrize("family", ["deepseek_v3", "mixtral"])
def test_fp8_export_loads_in_transformers(tmp_path, family):
    """transformers reads moekit's fp8 export with moekit's logits (blocks of 4 divide every shape: above)."""
    pytest.importorskip("accelerate")
    model = tiny_model(family)
    save_hf(model, tmp_path / "fp8", fp8=True, fp8_block=(4, 4))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "fp8", dtype=torch.float32).eval()
    with torch.no_grad():
        assert rel_err(load_hf(tmp_path / "fp8")(small_tokens()), hf_logits(theirs, small_tokens())) < 1e-5


def test_fp8_export_refusals(tmp_path, capsys):
    from moekit.train.convert import main
    from moekit.train.modelfiles import save_moekit

    model = tiny_model("mixtral")
    with pytest.raises(ValueError, match=r"fp8=True writes per-expert tensors.*layout='fused' is not supported"):
        save_hf(model, tmp_path / "x", fp8=True, layout="fused")
    with pytest.raises(ValueError, match=r"fp8_block=\(0, 128\) is invalid"):
        save_hf(model, tmp_path / "x", fp8=True, fp8_block=(0, 128))
    assert not (tmp_path / "x").exists()
    src = save_moekit(model, tmp_path / "model.safetensors")
    capsys.readouterr()
    assert main(["moekit-to-hf", str(src), str(tmp_path / "out"), "--fp8", "--layout", "fused"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "--fp8 writes per-expert tensors" in lines[0] and not (tmp_path / "out").exists()


def test_programs_write_fp8(tmp_path, capsys):
    """moekit-convert moekit-to-hf --fp8 --verify; moekit-train --export-hf DIR --train.export_hf_fp8 true."""
    from moekit.train.convert import main as convert
    from moekit.train.loop import main as train
    from moekit.train.modelfiles import save_moekit

    model = tiny_model("deepseek_v3")
    src = save_moekit(model, tmp_path / "model.safetensors")
    assert convert(["moekit-to-hf", str(src), str(tmp_path / "hf"), "--fp8", "--verify"]) == 0
    out = capsys.readouterr().out
    assert "fp8 linear weights" in out and "verified:" in out and "fp8 rounding changed the logits by" in out
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["quantization_config"]["weight_block_size"] == [
        128, 128]
    tiny = ["--model.hidden_size", "32", "--model.num_layers", "2", "--model.num_heads", "2", "--model.num_kv_heads",
            "1", "--model.ffn_hidden_size", "64", "--model.moe_ffn_hidden_size", "32", "--model.max_seq_len", "32",
            "--train.seq_len", "32", "--batch-size", "4", "--eval.sequences", "8", "--eval.every", "0",
            "--log.tensorboard", "false", "--steps", "1", "--run-dir", str(tmp_path / "run")]
    assert train([*tiny, "--train.export_hf_fp8", "true"]) == 2
    assert "--train.export_hf_fp8 true writes the --export-hf folder in fp8; give --export-hf DIR" in (
        capsys.readouterr().err)
    assert train([*tiny, "--export-hf", str(tmp_path / "exported"), "--train.export_hf_fp8", "true"]) == 0
    assert "fp8 linear weights" in capsys.readouterr().out
    exported = read_folder(tmp_path / "exported")
    assert any(k.endswith(fp8.SCALE_SUFFIX) for k in exported)
    assert load_hf(tmp_path / "exported").config.num_experts == 8


# ---------------------------------------------------------------------------------------------------
# Refusals
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("quant,patterns", [
    ({"quant_method": "gptq", "bits": 4}, [r"quant_method='gptq'", r"dequantize this one to bf16 first"]),
    ({**QUANT, "activation_scheme": "static"}, [r"activation_scheme='static'"]),
    ({**QUANT, "weight_block_size": [128]}, [r"weight_block_size=\[128\]", r"two positive integers"]),
    ({**QUANT, "fmt": "int8", "scale_fmt": "mx"}, [r"fmt='int8'", r"scale_fmt='mx'"]),
    ("fp8", [r"quantization_config='fp8' is not an object"]),
])
def test_unreadable_quantization_configs_are_named(deepseek, tmp_path, quant, patterns):
    src, _ = deepseek
    folder = tmp_path / "q"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**json.loads((src / "config.json").read_text()),
                                                    "quantization_config": quant}))
    with pytest.raises(UnsupportedCheckpoint) as err:
        config_from_hf(folder)
    for pattern in patterns:
        assert any(re.search(pattern, line) for line in str(err.value).splitlines()), (pattern, err)


def edit(folder: Path, fn=None, config=None) -> Path:
    if fn is not None:
        tensors = load_file(folder / "model.safetensors")
        fn(tensors)
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    if config is not None:
        cfg = json.loads((folder / "config.json").read_text())
        config(cfg)
        (folder / "config.json").write_text(json.dumps(cfg))
    return folder


WO = "model.layers.1.self_attn.o_proj.weight"
EXPERT = "model.layers.2.mlp.experts.3.down_proj.weight"


@pytest.mark.parametrize("breakage,words", [
    (dict(fn=lambda t: t.pop(WO + "_scale_inv")), ["1 float8 tensor(s) without a _scale_inv", WO]),
    (dict(fn=lambda t: t.update({EXPERT + "_scale_inv": t[EXPERT + "_scale_inv"][:2]})),
     [f"{EXPERT}_scale_inv has shape [2, 1], but {EXPERT} [32, 16] in blocks of [8, 16]", "needs [4, 1]"]),
    (dict(fn=lambda t: t.update({EXPERT: t[EXPERT].float()})), [f"{EXPERT} is F32, not float8"]),
    (dict(fn=lambda t: t.update({WO + "_scale_inv": t[WO + "_scale_inv"].to(torch.int32)})),
     [f"{WO}_scale_inv is I32; scales are one of"]),
    (dict(config=lambda c: c.pop("quantization_config")), ["holds float8 tensors", "no quantization_config"]),
    (dict(fn=lambda t: t[EXPERT + "_scale_inv"].view(-1)[1:2].fill_(float("nan"))),
     [f"{EXPERT}_scale_inv holds 1 scale(s) that are not finite and positive (e.g. nan)", "re-download it"]),
    (dict(config=lambda c: c["quantization_config"].update(weight_block_size=[16, 16])),
     ["in blocks of [16, 16] (config.json weight_block_size) needs"]),
])
def test_scales_that_do_not_match_their_weights_are_named(deepseek, tmp_path, breakage, words, capsys):
    from moekit.train.convert import main

    src, _ = deepseek
    quantize_folder(src, tmp_path / "fp8", (8, 16))
    edit(tmp_path / "fp8", **breakage)
    with pytest.raises(ValueError) as err:
        load_hf(tmp_path / "fp8")
    for w in words:
        assert w in str(err.value), (w, str(err.value))
    # and a program reports it in one line, before writing anything
    capsys.readouterr()
    assert main(["hf-to-moekit", str(tmp_path / "fp8"), str(tmp_path / "out.pt")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and words[-1] in lines[0], lines
    assert not (tmp_path / "out.pt").exists()


def test_programs_read_fp8_checkpoints(deepseek, tmp_path):
    """moekit-convert hf-to-moekit dequantizes (a moekit file in float32 equal to load_hf's), and dtype='auto'
    takes config.json's dtype, not the mix of float8 / float32 / bf16 tensors in the files."""
    from moekit.train.convert import main
    from moekit.train.modelfiles import load_moekit

    src, _ = deepseek
    quantize_folder(src, tmp_path / "fp8", (8, 16))
    edit(tmp_path / "fp8", config=lambda c: c.update(dtype="bfloat16", torch_dtype="bfloat16"))
    assert main(["hf-to-moekit", str(tmp_path / "fp8"), str(tmp_path / "model.safetensors")]) == 0
    ours, ref = load_moekit(tmp_path / "model.safetensors").state_dict(), load_hf(tmp_path / "fp8").state_dict()
    assert {t.dtype for t in ref.values()} == {torch.float32}
    assert ours.keys() == ref.keys() and all(torch.equal(ours[k], ref[k]) for k in ref)
    assert next(iter(load_hf(tmp_path / "fp8", dtype="auto").parameters())).dtype == torch.bfloat16
    # --dtype auto (bf16 here) --verify compares the file with the model in the dtype it was written in
    assert main(["hf-to-moekit", str(tmp_path / "fp8"), str(tmp_path / "bf16.safetensors"), "--dtype", "auto",
                 "--verify"]) == 0
