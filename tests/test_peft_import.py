"""PEFT LoRA adapters into moekit (moekit.models.hf.peft_import, ``moekit-convert import-lora``): moekit's own exports
back factor for factor; adapters with separate gate / up factors, per-module alphas and head / embedding adapters
against the base checkpoint plus the adapter computed in the test; adapters PEFT itself made (on transformers 5's fused
experts) against PEFT's logits; the command, a fine-tune from its output, and the refusals."""
from __future__ import annotations

import copy
import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from moekit.models.config import preset
from moekit.models.hf import load_hf, save_hf
from moekit.models.hf.peft import PEFT_CONFIG, PEFT_WEIGHTS, save_peft
from moekit.models.hf.peft_import import load_peft
from moekit.models.lora import is_adapter, merge_lora
from moekit.models.transformer import build_model
from moekit.train.convert import main as convert
from moekit.train.loop import main as train_main
from tests.helpers import gen, one_stderr_line
from tests.test_lora import DEEPSEEK
from tests.test_peft_export import hf_folder_tensors, lora_model_with_adapters


def logits(model, vocab: int, key) -> torch.Tensor:
    ids = torch.randint(0, vocab, (2, 12), generator=gen("ids", key))
    with torch.no_grad():
        return model.eval()(ids)


def base_of(model, folder: Path, family: str | None = None) -> Path:
    """The HF checkpoint of a LoRA model's base weights (its adapters left out)."""
    plain = copy.deepcopy(model)
    with torch.no_grad():
        for n, p in plain.named_parameters():
            if ".lora_b" in n:
                p.zero_()
    save_hf(merge_lora(plain), folder, family=family)
    return folder


@pytest.mark.parametrize("name, targets, layout, rslora", [
    ("mixtral-tiny", "all", "per_expert", False), ("mixtral-tiny", "layers.1.*,layers.3.ffn.experts.w_out", "fused", True),
    ("deepseek-tiny", "all", "per_expert", False), ("qwen3.5-tiny", "all", "fused", False),
    ("gpt-oss-tiny", "all", "fused", True), ("llama4-tiny", "all", "fused", False),
    ("gpt-oss-tiny", "*.attn.*", "per_expert", False)])
def test_an_export_imports_back_factor_for_factor(tmp_path, name, targets, layout, rslora):
    """export-lora's folder onto its base: the same adapters (gate and up share their A: rank r, not 2r), the same
    settings, the same logits, whichever layout and family."""
    model = lora_model_with_adapters(name, targets, rslora)
    save_peft(model, tmp_path / "adapter", layout=layout)
    imported = load_hf(base_of(model, tmp_path / "base"))
    report = load_peft(imported, tmp_path / "adapter")
    cfg = imported.config
    assert (cfg.lora_rank, cfg.lora_alpha, cfg.lora_rslora) == (4, 12.0, rslora)
    assert report.widened == [] and report.narrower == [] and report.merged == []
    want = {n: p for n, p in model.named_parameters() if is_adapter(n)}
    got = {n: p for n, p in imported.named_parameters() if is_adapter(n)}
    assert got.keys() == want.keys()
    for n, p in want.items():
        assert torch.equal(got[n], p), n
    torch.testing.assert_close(logits(imported, cfg.vocab_size, name), logits(model, cfg.vocab_size, name),
                               rtol=1e-5, atol=1e-6)


def test_separate_gate_and_up_factors_alpha_patterns_and_a_head_adapter(tmp_path):
    """A per-expert folder as PEFT on transformers 4 trains it: each expert's w1 and w3 with A factors of their own
    (moekit's fused w_in adapter then takes both: rank 2r, attention's zero-padded), one layer's attention at its own
    alpha (alpha_pattern), an adapter on lm_head (no moekit adapter there: folded into the weight). The import's
    logits against the base checkpoint plus every update, added to the HF tensors here."""
    model = lora_model_with_adapters("mixtral-tiny", "*.attn.wq.weight,*.experts.*")
    save_peft(model, tmp_path / "adapter")
    base = base_of(model, tmp_path / "base")
    folder = tmp_path / "adapter"
    tensors = load_file(str(folder / PEFT_WEIGHTS))
    g = gen("separate-factors")
    r, alpha, hidden = 4, 12.0, model.config.hidden_size
    for k in tensors:
        if ".w1.lora_A." in k or ".w3.lora_A." in k:
            tensors[k] = torch.randn(tensors[k].shape, generator=g) / 8
    vocab = model.config.vocab_size
    tensors["base_model.model.lm_head.lora_A.weight"] = torch.randn(r, hidden, generator=g) / 8
    tensors["base_model.model.lm_head.lora_B.weight"] = torch.randn(vocab, r, generator=g) / 8
    save_file(tensors, str(folder / PEFT_WEIGHTS))
    config = json.loads((folder / PEFT_CONFIG).read_text())
    layer = random.randrange(model.config.num_layers)
    config["alpha_pattern"] = {f"layers.{layer}.self_attn.q_proj": 40}
    config["target_modules"] = "|".join(["q_proj", "w1", "w2", "w3", "lm_head"])
    (folder / PEFT_CONFIG).write_text(json.dumps(config))

    imported = load_hf(base)
    report = load_peft(imported, folder)
    assert imported.config.lora_rank == 2 * r and imported.config.lora_alpha == 2 * alpha
    assert sorted({t.split(".", 2)[2] for t in report.widened}) == ["ffn.experts.w_in"]
    assert report.merged == ["lm_head.weight"]
    attn = imported.layers[0].attn.wq
    assert not attn.lora_a[r:].any() and not attn.lora_b[:, r:].any()  # the unused ranks: zero on both sides

    hf = hf_folder_tensors(base)  # the reference: each HF weight plus scale * B @ A, by hand
    for k, a in tensors.items():
        if k.endswith(".lora_A.weight"):
            module = k[len("base_model.model."): -len(".lora_A.weight")]
            b = tensors[k.replace("lora_A", "lora_B")]
            scale = (40 if module == f"model.layers.{layer}.self_attn.q_proj" else alpha) / r
            hf[f"{module}.weight"] = hf[f"{module}.weight"] + scale * b @ a
    merged = tmp_path / "merged"
    merged.mkdir()
    (merged / "config.json").write_text((base / "config.json").read_text())
    save_file(hf, str(merged / "model.safetensors"))
    want = load_hf(merged)
    torch.testing.assert_close(logits(imported, vocab, "sep"), logits(want, vocab, "sep"), rtol=1e-5, atol=1e-5)


PEFT_MADE = {  # name: (preset, family, LoraConfig arguments)
    # target_modules on experts: PEFT converts them to transformers 5's fused gate_up_proj at rank 2r (rank_pattern)
    "mixtral-modules": ("mixtral-tiny", "mixtral", dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "w1",
                                                                                             "w2", "w3"])),
    # target_parameters, rsLoRA, lm_head trained whole
    "mixtral-parameters": ("mixtral-tiny", "mixtral", dict(
        r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "o_proj"], modules_to_save=["lm_head"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])),
    # shared experts and a dense first layer beside the routed experts
    "deepseek": ("deepseek-tiny", None, dict(r=4, lora_alpha=16, target_modules=["q_proj", "k_proj", "gate_proj",
                                                                                   "up_proj", "down_proj"])),
    # experts stored [E, in, out] (is_transposed), interleaved gate / up
    "gpt-oss": ("gpt-oss-tiny", "gpt_oss", dict(r=2, lora_alpha=8, target_modules=["q_proj"],
                                                target_parameters=["mlp.experts.gate_up_proj",
                                                                   "mlp.experts.down_proj"])),
    # head and embedding adapters (folded into the weights), a per-module alpha, dropout (which moekit lacks)
    "mixtral-head": ("mixtral-tiny", "mixtral", dict(r=4, lora_alpha=8, lora_dropout=0.1, alpha_pattern={"q_proj": 20},
                                                     target_modules=["q_proj", "lm_head", "embed_tokens"])),
}


def peft_made(tmp_path: Path, case: str) -> tuple[Path, Path]:
    """(an HF base checkpoint of PEFT_MADE[case]'s preset, random weights; PEFT's adapter folder for it, random
    factors, made and saved by PEFT on transformers' model of that base)."""
    import warnings

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    name, family, kwargs = PEFT_MADE[case]
    base = tmp_path / "base"
    save_hf(build_model(preset(name), seed=random.randrange(1 << 20)), base, family=family)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        made = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), LoraConfig(**kwargs))
        g = gen("peft-made", case)
        with torch.no_grad():
            for n, p in made.named_parameters():
                if "lora_" in n or "modules_to_save" in n:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.05)
        made.save_pretrained(tmp_path / "adapter")
    return base, tmp_path / "adapter"


@pytest.mark.parametrize("case", list(PEFT_MADE))
def test_adapters_peft_made_import_with_peft_logits(tmp_path, case):
    """Adapters made and saved by PEFT itself on the transformers model of a base checkpoint, factors random: the
    import computes PEFT's logits (check_import_with_peft: transformers + PeftModel on the same folders)."""
    pytest.importorskip("peft")
    from moekit.models.hf.peft_check import check_import_with_peft

    base, _ = peft_made(tmp_path, case)
    imported = load_hf(base)
    report = load_peft(imported, tmp_path / "adapter")
    check = check_import_with_peft(imported, base, tmp_path / "adapter")
    assert check.ok, check.message
    if case == "mixtral-head":
        assert sorted(report.merged) == ["embed.weight", "lm_head.weight"] and report.dropout == 0.1
    if case == "mixtral-parameters":
        assert report.whole == ["lm_head.weight"] and imported.config.lora_rslora
    if case == "mixtral-modules":  # gate_up_proj at 2r, the rest padded to it
        assert imported.config.lora_rank == 8 and report.narrower


def test_a_bfloat16_import_verifies_against_peft_in_float32(tmp_path, capsys):
    """--dtype bfloat16: the tensor check within bf16's rounding, the PEFT check on a float32 import (a bf16 model
    against PEFT's float32 load would differ by the base's rounding alone)."""
    pytest.importorskip("peft")
    base, adapter = peft_made(tmp_path, "mixtral-modules")
    out = tmp_path / "bf16.safetensors"
    capsys.readouterr()
    assert convert(["import-lora", str(base), str(adapter), "-o", str(out), "--dtype", "bfloat16", "--verify"]) == 0
    text = capsys.readouterr().out
    assert "verified: the imported model is the base checkpoint plus the adapter" in text, text
    assert "verified: PEFT" in text and "computes the same logits" in text, text
    from moekit.train.modelfiles import load_moekit

    assert load_moekit(out).config.lora_rank == 8


def test_import_lora_command_then_fine_tune_from_its_output(tmp_path, capsys):
    """export-lora of a LoRA run, import-lora onto the run's HF base: the LoRA run's logits; --verify's tensor check
    passes, and fails when the import is off; moekit-train --train.init_from OUT trains the adapters only."""
    from moekit.train.modelfiles import load_moekit

    plain, lora = tmp_path / "plain", tmp_path / "lora"
    flags = [*DEEPSEEK[:DEEPSEEK.index("--model.lora_rank")], "--train.warmup_steps", "0"]
    assert train_main([*flags, "--steps", "1", "--run-dir", str(plain)]) == 0
    assert train_main([*DEEPSEEK, "--steps", "2", "--train.init_from", str(plain), "--run-dir", str(lora)]) == 0
    assert convert(["moekit-to-hf", str(plain), str(tmp_path / "base")]) == 0
    assert convert(["export-lora", str(lora), str(tmp_path / "adapter")]) == 0
    capsys.readouterr()
    out = tmp_path / "imported.safetensors"
    assert convert(["import-lora", str(tmp_path / "base"), str(tmp_path / "adapter"), "-o", str(out), "--verify"]) == 0
    text = capsys.readouterr().out
    assert "LoRA adapters on" in text and "rank 4, alpha 16" in text, text
    assert "verified: the imported model is the base checkpoint plus the adapter" in text, text
    imported, trained = load_moekit(out), load_moekit(lora / "checkpoints" / "step_000002")
    vocab = trained.config.vocab_size
    torch.testing.assert_close(logits(imported, vocab, "cli"), logits(trained, vocab, "cli"), rtol=1e-5, atol=1e-6)

    tuned = tmp_path / "tuned"
    assert train_main(["--train.init_from", str(out), "--steps", "2", "--train.seq_len", "32", "--batch-size", "4",
                       "--eval.every", "0", "--log.tensorboard", "false", "--train.lr", "0.01",
                       "--train.warmup_steps", "0", "--run-dir", str(tuned)]) == 0
    after = load_moekit(tuned / "checkpoints" / "step_000002")
    moved = {n for n, p in after.named_parameters() if not torch.equal(p, imported.get_parameter(n))}
    assert moved and all(is_adapter(n) for n in moved), moved

    import moekit.models.hf.peft_import as peft_import

    real = peft_import._blocks

    def off(*args, **kwargs):  # a wrong import: every B side 1% large
        return {e: [b._replace(b_val=b.b_val * 1.01) for b in bs] for e, bs in real(*args, **kwargs).items()}

    capsys.readouterr()
    try:
        peft_import._blocks = off
        assert convert(["import-lora", str(tmp_path / "base"), str(tmp_path / "adapter"), "-o",
                        str(tmp_path / "off.safetensors"), "--verify"]) == 2
    finally:
        peft_import._blocks = real
    one_stderr_line(capsys, "verification failed", "relative error")


def _adapter(tmp_path: Path) -> tuple[Path, Path]:
    model = lora_model_with_adapters("mixtral-tiny", "*.attn.*,*.experts.*")
    return base_of(model, tmp_path / "base"), save_peft(model, tmp_path / "adapter")


def _edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / PEFT_CONFIG).read_text())
    config.update(changes)
    (folder / PEFT_CONFIG).write_text(json.dumps(config))


def _edit_tensors(folder: Path, change) -> None:
    tensors = load_file(str(folder / PEFT_WEIGHTS))
    change(tensors)
    save_file(tensors, str(folder / PEFT_WEIGHTS))


def _narrow_q(t: dict) -> None:
    key = next(k for k in t if "q_proj.lora_B" in k)
    t[key] = t[key][:-1]


@pytest.mark.parametrize("break_it, words", [
    (lambda a: (a / PEFT_CONFIG).unlink(), ["no adapter_config.json"]),
    (lambda a: _edit_config(a, use_dora=True), ["DoRA", "merge_and_unload"]),
    (lambda a: _edit_config(a, peft_type="PREFIX_TUNING"), ["peft_type 'PREFIX_TUNING'", "only LoRA"]),
    (lambda a: _edit_config(a, bias="lora_only"), ["trains biases", "merge_and_unload"]),
    (lambda a: _edit_config(a, lora_alpha=0), ["lora_alpha=0", "positive"]),
    (lambda a: (a / PEFT_WEIGHTS).write_bytes(b"not safetensors"), ["adapter_model.safetensors is unreadable"]),
    (lambda a: _edit_tensors(a, _narrow_q), ["q_proj", "another model"]),
    (lambda a: _edit_tensors(a, lambda t: t.update({"base_model.model.model.nothing.lora_A.weight": torch.ones(2, 2),
                                                     "base_model.model.model.nothing.lora_B.weight": torch.ones(2, 2)})),
     ["model.nothing", "another model"]),
    (lambda a: _edit_tensors(a, lambda t: t.update({"base_model.model.model.layers.0.x.lora_magnitude_vector":
                                                     torch.ones(2)})), ["DoRA magnitude"]),
], ids=["no-config", "dora", "prefix-tuning", "bias", "alpha", "corrupt", "other-model", "unknown-module", "magnitude"])
def test_bad_adapters_are_one_line(tmp_path, capsys, break_it, words):
    base, adapter = _adapter(tmp_path)
    break_it(adapter)
    capsys.readouterr()
    assert convert(["import-lora", str(base), str(adapter), "-o", str(tmp_path / "out.safetensors")]) == 2
    one_stderr_line(capsys, str(adapter), *words)
    assert not (tmp_path / "out.safetensors").exists()


def test_an_unwritable_out_and_a_model_with_adapters_are_refused(tmp_path, capsys):
    base, adapter = _adapter(tmp_path)
    (tmp_path / "file").write_text("x")
    assert convert(["import-lora", str(base), str(adapter), "-o", str(tmp_path / "file" / "out.safetensors")]) == 2
    one_stderr_line(capsys, "is a file, not a folder")
    assert convert(["import-lora", str(base), str(adapter), "-o", str(tmp_path / "out.bin")]) == 2
    one_stderr_line(capsys, "name the output *.safetensors or *.pt")
    model = load_hf(base)
    load_peft(model, adapter)
    with pytest.raises(ValueError, match="already has LoRA adapters"):
        load_peft(model, adapter)
