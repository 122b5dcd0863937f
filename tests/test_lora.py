"""LoRA adapters (moekit.models.lora, moe/lora_experts.py): the math against merged weights computed another way,
training that moves the adapters alone, every layout against one process, and the ways out (HF export, merge-lora,
--train.init_from)."""
from __future__ import annotations

import dataclasses
import json
import os
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from moekit.models.config import preset
from moekit.models.lora import (LoRALinear, add_linear_lora, fold_lora, has_lora, is_adapter, merge_lora, merged_state,
                                scales)
from moekit.models.transformer import build_model
from moekit.moe.experts import GroupedExperts, loop_mlp
from moekit.train.loop import main as train_main
from moekit.train.modelfiles import load_moekit
from tests.helpers import gen, one_stderr_line
from tests.tiny import TINY_MODEL

# -- the arithmetic ----------------------------------------------------------------------------------------------


def ragged_counts(E: int, N: int, g: torch.Generator) -> torch.Tensor:
    """Counts over E experts summing to at most N: some experts empty, a tail of rows no expert owns."""
    counts = torch.zeros(E, dtype=torch.long)
    owned = int(torch.randint(N // 2, N + 1, (1,), generator=g))
    for _ in range(owned):
        counts[int(torch.randint(0, E, (1,), generator=g))] += 1
    counts[int(torch.randint(0, E, (1,), generator=g))] = 0  # at least one empty expert
    return counts


@pytest.mark.parametrize("path", ["loop", "torch"])
@pytest.mark.parametrize("activation, bias", [("swiglu", False), ("gelu", True), ("swiglu_oai", True)])
@pytest.mark.parametrize("sides", [("in", "out"), ("in",), ("out",)], ids=["both", "in", "out"])
def test_expert_adapters_compute_the_merged_weights(path, activation, bias, sides):
    """Factored adapters (either path) against the per-expert loop backend on w + s A B formed explicitly, in
    float64: outputs and the gradients of the rows, the adapters and the biases; the frozen weights get none."""
    g = gen("lora-experts", path, activation, bias, sides)
    E, H, Fh, r = 5, 16, 24, 4
    N = int(torch.randint(10, 40, (1,), generator=g))
    ex = GroupedExperts(E, H, Fh, activation=activation, backend=path, bias=bias, dtype=torch.float64)
    ex.add_lora(r, alpha=float(torch.randint(1, 32, (1,), generator=g)), sides=sides)
    with torch.no_grad():
        for p in ex.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.3)
    ex.w_in.requires_grad_(False)
    ex.w_out.requires_grad_(False)
    rows = torch.randn(N, H, generator=g, dtype=torch.float64, requires_grad=True)
    counts = ragged_counts(E, N, g)
    out = ex(rows, counts)
    grad = torch.randn(out.shape, generator=g, dtype=torch.float64)
    adapters = {n: getattr(ex, n) for n in ex.param_names() if n.startswith("lora_") or n.startswith("b_")}
    got = torch.autograd.grad(out, [rows, *adapters.values()], grad)

    def merged(side):
        w = getattr(ex, f"w_{side}")
        return w + ex.lora_scale * torch.bmm(ex.get_parameter(f"lora_a_{side}"), ex.get_parameter(f"lora_b_{side}")) \
            if side in sides else w

    ref = loop_mlp(rows, counts, merged("in"), merged("out"), activation, ex.b_in, ex.b_out)
    want = torch.autograd.grad(ref, [rows, *adapters.values()], grad)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    assert out[int(counts.sum()):].abs().max() == 0 if N > counts.sum() else True
    for name, a, b in zip(["rows", *adapters], got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=lambda m: f"{name}: {m}")
    assert ex.w_in.grad is None and ex.w_out.grad is None


@pytest.mark.parametrize("activation", ["swiglu", "swiglu_oai"])
def test_the_fused_loop_trains_base_weights_and_adapters_as_autograd_does(activation):
    """_LoopLoRA (gated activations, one dtype) against the autograd reference (_loop) when the expert weights train
    too (--train.trainable '*.experts.*' beside adapters): every gradient, in float64, on expert threads or not."""
    from moekit.moe import expert_threads, lora_experts
    from moekit.moe.experts import counts_to_offs

    g = gen("lora-fused", activation)
    E, H, Fh, r, N = 6, 16, 12, 3, 40
    named = {"w_in": (E, H, 2 * Fh), "w_out": (E, Fh, H), "b_in": (E, 2 * Fh), "b_out": (E, H),
             "lora_a_in": (E, H, r), "lora_b_in": (E, r, 2 * Fh), "lora_a_out": (E, Fh, r), "lora_b_out": (E, r, H)}
    named = {k: (torch.randn(v, generator=g, dtype=torch.float64) * 0.3).requires_grad_() for k, v in named.items()}
    rows = torch.randn(N, H, generator=g, dtype=torch.float64, requires_grad=True)
    counts = ragged_counts(E, N, g)
    grad = torch.randn(N, H, generator=g, dtype=torch.float64)
    leaves = [rows, *named.values()]
    ref = lora_experts._loop(rows, counts_to_offs(counts, N), named, activation, 1.5)
    want = torch.autograd.grad(ref, leaves, grad)
    for workers in (1, 2):
        with expert_threads.expert_threads(workers):
            out = lora_experts.lora_mlp(rows, counts, named, activation, 1.5, backend="loop")
            got = torch.autograd.grad(out, leaves, grad)
        assert out.grad_fn is not None and "LoopLoRA" in type(out.grad_fn).__name__
        torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
        for name, a, b in zip(["rows", *named], got, want):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=lambda m: f"{name} ({workers}): {m}")


def test_expert_adapters_with_no_rows_still_join_the_graph():
    """An expert-parallel rank whose experts got no rows must still run backward's collectives: the empty output is
    tied to the adapters (moe.experts.GroupedExperts.forward) even with the base weights frozen."""
    ex = GroupedExperts(4, 8, 8)
    ex.add_lora(2, 4.0)
    ex.w_in.requires_grad_(False)
    ex.w_out.requires_grad_(False)
    out = ex(torch.zeros(0, 8), torch.zeros(4, dtype=torch.long))
    assert out.shape == (0, 8) and out.requires_grad
    out.sum().backward()
    assert ex.lora_a_in.grad is not None and torch.count_nonzero(ex.lora_a_in.grad) == 0


def test_lora_linear_is_the_merged_linear():
    g = gen("lora-linear")
    lin = torch.nn.Linear(12, 20, bias=True, dtype=torch.float64)
    add_linear_lora(lin, 3, 6.0)
    with torch.no_grad():
        lin.lora_b.copy_(torch.randn(20, 3, generator=g, dtype=torch.float64))
    x = torch.randn(7, 12, generator=g, dtype=torch.float64)
    merged = lin.weight + 2.0 * lin.lora_b @ lin.lora_a
    torch.testing.assert_close(lin(x), F.linear(x, merged, lin.bias), rtol=1e-12, atol=1e-12)
    assert isinstance(lin, LoRALinear) and [n for n, _ in lin.named_parameters()] == ["weight", "bias", "lora_a",
                                                                                        "lora_b"]
    rs = add_linear_lora(torch.nn.Linear(12, 20, bias=False, dtype=torch.float64), 4, 6.0, rslora=True)
    with torch.no_grad():
        rs.lora_b.copy_(torch.randn(20, 4, generator=g, dtype=torch.float64))
    merged = rs.weight + 3.0 * rs.lora_b @ rs.lora_a  # rank-stabilized: alpha / sqrt(r) = 6 / 2
    torch.testing.assert_close(rs(x), F.linear(x, merged), rtol=1e-12, atol=1e-12)


def test_rslora_scales_every_adapter_by_alpha_over_sqrt_rank_and_peft_agrees(tmp_path):
    """--model.lora_rslora: every Linear's and expert stack's scale is alpha / sqrt(r) (9 / sqrt(9) = 3, against
    alpha / r = 1); merging folds that scale; the PEFT export says use_rslora, and PEFT computes the same logits."""
    cfg = dataclasses.replace(preset("mixtral-tiny"), lora_rank=9, lora_alpha=9.0, lora_rslora=True)
    model = build_model(cfg, seed=random.randrange(1 << 20))
    assert set(scales(model).values()) == {3.0} and len(scales(model)) > 8
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_b" in n:
                p.normal_(0.0, 0.05, generator=gen("rslora", n))
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=gen("rslora-ids"))
    import copy

    want = model(ids)
    merged = merge_lora(copy.deepcopy(model))
    torch.testing.assert_close(merged(ids), want, rtol=1e-4, atol=1e-5)
    with torch.no_grad():  # the same adapters at the plain scale compute something else: the scale is in effect
        plain = build_model(dataclasses.replace(cfg, lora_rslora=False), seed=0)
        plain.load_state_dict(model.state_dict())
        assert (plain(ids) - want).abs().max() > 1e-3
    from moekit.models.hf.peft import save_peft
    from moekit.models.hf.peft_check import check_with_peft

    out = save_peft(model, tmp_path / "adapter", layout="fused")
    assert json.loads((out / "adapter_config.json").read_text())["use_rslora"] is True
    if __import__("importlib").util.find_spec("peft"):
        check = check_with_peft(model, out)
        assert check.ok, check.message
        # per expert, PEFT 0.21's conversion to the fused experts doubles gate_up's rank and alpha: right for
        # alpha / r, off by sqrt(2) for rsLoRA; the check says so (and passes once PEFT converts it right)
        check = check_with_peft(model, save_peft(model, tmp_path / "per_expert"))
        assert check.ok or "not rsLoRA's alpha / sqrt(r)" in check.message and "--layout fused" in check.message


@pytest.mark.parametrize("name", ["mixtral-tiny", "deepseek-tiny", "gpt-oss-tiny"])
def test_fresh_adapters_change_nothing_and_merging_keeps_the_logits(name):
    """Fresh adapters (B = 0) leave the logits (bit for bit where the experts' arithmetic is the same ops: the fused
    swiglu_oai loop adds its biases inside addmm, the adapter path after the product); with trained (random) B, merge_lora and fold_lora keep
    them up to rounding, merged_state gives the merged model's tensors, and the base names are the plain model's."""
    seed = random.randrange(1 << 20)
    base = preset(name)
    plain = build_model(base, seed=seed)
    model = build_model(dataclasses.replace(base, lora_rank=4), seed=seed)
    tokens = torch.randint(0, base.vocab_size, (2, 24), generator=gen("lora-fresh", name))
    torch.testing.assert_close(model(tokens), plain(tokens), rtol=0 if name != "gpt-oss-tiny" else 1e-6,
                               atol=0 if name != "gpt-oss-tiny" else 1e-6)
    assert {n for n, _ in model.named_parameters() if not is_adapter(n)} == {n for n, _ in plain.named_parameters()}
    assert all(torch.equal(p, plain.get_parameter(n)) for n, p in model.named_parameters() if not is_adapter(n))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_b" in n:
                p.normal_(0.0, 0.05, generator=gen("lora-b", name, n))
    want = model(tokens)
    assert not torch.allclose(want, plain(tokens), atol=1e-3)  # the adapters do change the function
    state = merged_state(model.state_dict(), scales(model).__getitem__)
    folded = build_model(dataclasses.replace(base, lora_rank=4), seed=seed)
    folded.load_state_dict(model.state_dict())
    assert fold_lora(folded) > 0
    torch.testing.assert_close(folded(tokens), want, rtol=1e-5, atol=1e-5)
    merge_lora(model)
    assert not has_lora(model) and model.config.lora_rank == 0
    torch.testing.assert_close(model(tokens), want, rtol=1e-5, atol=1e-5)
    assert state.keys() == model.state_dict().keys()
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


def test_targets_pick_weights_and_name_the_candidates_when_wrong():
    cfg = preset("deepseek-tiny")
    every = build_model(dataclasses.replace(cfg, lora_rank=2))
    carriers = {n.rsplit(".", 1)[0] for n, _ in every.named_parameters() if is_adapter(n)}
    assert not any(".router" in c or c.endswith(".gate") or c in ("embed", "lm_head") for c in carriers)
    assert any(c.endswith("ffn.experts") for c in carriers) and any(".attn." in c for c in carriers)
    only_in = build_model(dataclasses.replace(cfg, lora_rank=2, lora_targets="layers.1.ffn.experts.w_in"))
    adapters = sorted(n for n, _ in only_in.named_parameters() if is_adapter(n))
    assert adapters == ["layers.1.ffn.experts.lora_a_in", "layers.1.ffn.experts.lora_b_in"]
    with pytest.raises(ValueError, match=r"'\*\.mlp\.\*' names no weight .*layers\.N\.attn\.wq\.weight"):
        build_model(dataclasses.replace(cfg, lora_rank=2, lora_targets="*.mlp.*"))


# -- training -----------------------------------------------------------------------------------------------------

DEEPSEEK = [*TINY_MODEL, "--preset", "deepseek-tiny", "--model.num_layers", "3", "--model.lora_rank", "4",
            "--train.warmup_steps", "0", "--train.lr", "0.01", "--checkpoint.every", "1"]


def weights(ckpt: Path) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in load_moekit(ckpt).state_dict().items()}


def initial(config, seed: int) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in build_model(config, seed=seed).state_dict().items()}


def test_a_lora_run_trains_the_adapters_and_what_trainable_adds(tmp_path, capsys):
    seed = random.randrange(1 << 20)
    run = tmp_path / "run"
    assert train_main([*DEEPSEEK, "--steps", "2", "--train.seed", str(seed), "--train.trainable", "*.router.*",
                       "--run-dir", str(run)]) == 0
    assert "LoRA rank 4, alpha 16 on" in capsys.readouterr().out
    ckpt = run / "checkpoints" / "step_000002"
    after = weights(ckpt)
    init = initial(load_moekit(ckpt).config, seed)
    moved = {k for k in after if not torch.equal(after[k], init[k])}
    adapters = {k for k in after if is_adapter(k)}
    routers = {k for k in after if ".router." in k and not k.endswith("pending_load")}
    assert {k for k in adapters if ".lora_b" in k} <= moved  # every B left 0 ...
    assert moved - {k for k in after if k.endswith("pending_load")} <= adapters | routers  # ... nothing else moved
    assert any(k in moved for k in routers if k.endswith("router.weight"))


def test_esft_on_adapters_trains_the_chosen_experts_adapters_only(tmp_path, capsys):
    """--train.train_experts with LoRA: the adapter rows of the chosen experts move, the others stay as initialised
    (B still 0), the base stacks stay; with adapters only on attention the selection is refused with the fix."""
    from moekit.moe.load import moe_layers
    from tests.test_freezing import random_selection, selection_file

    seed = random.randrange(1 << 20)
    model = build_model(dataclasses.replace(preset("deepseek-tiny"), num_layers=3, hidden_size=32))
    chosen = random_selection([n for n, _ in moe_layers(model)], 16, random.Random())
    sel = selection_file(tmp_path / "sel.json", chosen, 16)
    run = tmp_path / "run"
    assert train_main([*DEEPSEEK, "--steps", "2", "--train.seed", str(seed), "--train.train_experts", str(sel),
                       "--run-dir", str(run)]) == 0
    ckpt = run / "checkpoints" / "step_000002"
    after, init = weights(ckpt), initial(load_moekit(ckpt).config, seed)
    moved = 0
    for name, w in after.items():
        if ".experts.lora_" in name:
            rows = torch.zeros(w.shape[0], dtype=torch.bool)
            rows[chosen[name.split(".experts.")[0]]] = True
            assert torch.equal(w[~rows], init[name][~rows]), name
            moved += int(not torch.equal(w[rows], init[name][rows]))
        elif ".experts.w_" in name:
            assert torch.equal(w, init[name]), name
    assert moved >= 4
    capsys.readouterr()
    assert train_main([*DEEPSEEK, "--steps", "1", "--model.lora_targets", "*.attn.*", "--train.train_experts", str(sel),
                       "--run-dir", str(tmp_path / "x")]) == 2
    one_stderr_line(capsys, "--train.train_experts", "give the experts adapters")


def test_a_lora_run_resumes_bitwise_and_refuses_other_adapters(tmp_path, capsys):
    flags = [*DEEPSEEK, "--train.seed", str(random.randrange(1 << 20)), "--steps", "3"]
    whole = tmp_path / "whole"
    assert train_main([*flags, "--run-dir", str(whole)]) == 0
    ckpt = str(whole / "checkpoints" / "step_000002")
    assert train_main([*flags, "--resume", ckpt, "--run-dir", str(tmp_path / "resumed")]) == 0
    a, b = (weights(d / "checkpoints" / "step_000003") for d in (whole, tmp_path / "resumed"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    capsys.readouterr()
    assert train_main([*flags, "--model.lora_rank", "8", "--resume", ckpt, "--run-dir", str(tmp_path / "x")]) == 2
    one_stderr_line(capsys, "lora_rank=4 (checkpoint) vs 8 (this run)")
    assert train_main([*flags, "--model.lora_rslora", "true", "--resume", ckpt, "--run-dir", str(tmp_path / "y")]) == 2
    one_stderr_line(capsys, "lora_rslora=False (checkpoint) vs True (this run)")


def test_init_from_a_plain_run_gives_fresh_adapters_and_merge_lora_leads_back(tmp_path, capsys):
    """A plain run's weights under fresh adapters: the first logits are the plain model's; a LoRA checkpoint into a
    plain model is refused with the two ways on; merge-lora writes the plain model of the same logits."""
    from moekit.train.convert import main as convert

    plain = tmp_path / "plain"
    flags = [*DEEPSEEK[:DEEPSEEK.index("--model.lora_rank")], "--train.warmup_steps", "0"]
    assert train_main([*flags, "--steps", "1", "--run-dir", str(plain)]) == 0
    lora = tmp_path / "lora"
    assert train_main([*DEEPSEEK, "--steps", "2", "--train.init_from", str(plain), "--run-dir", str(lora)]) == 0
    base = weights(plain / "checkpoints" / "step_000001")
    tuned = weights(lora / "checkpoints" / "step_000002")
    for k, v in base.items():
        if not k.endswith("pending_load") and ".router." not in k:
            assert torch.equal(tuned[k], v), k  # the frozen base is the plain run's
    capsys.readouterr()
    assert train_main([*flags, "--steps", "1", "--train.init_from", str(lora), "--run-dir", str(tmp_path / "x")]) == 2
    one_stderr_line(capsys, "holds LoRA adapters (rank 4", "moekit-convert merge-lora", "--model.lora_rank 4")
    out = tmp_path / "merged.safetensors"
    assert convert(["merge-lora", str(lora), "-o", str(out), "--verify"]) == 0
    assert "keeps the logits" in capsys.readouterr().out
    merged = load_moekit(out)
    assert merged.config.lora_rank == 0 and not has_lora(merged)
    from moekit.train.evaluate import main as evaluate

    for src in (lora, out):  # moekit-eval builds the run's adapters from its config: the merged file's loss
        assert evaluate([str(src), "--max-tokens", "2048"]) == 0
    first, second = (line for line in capsys.readouterr().out.splitlines() if line.startswith("loss "))
    assert first.split()[1] == second.split()[1], (first, second)
    assert train_main([*flags, "--steps", "1", "--train.init_from", str(out), "--run-dir", str(tmp_path / "full")]) == 0
    assert convert(["merge-lora", str(plain), "-o", str(tmp_path / "m.safetensors")]) == 2
    one_stderr_line(capsys, "has no LoRA adapters")


@pytest.mark.parametrize("flags, words", [
    (["--model.lora_rank", "-1"], ["model.lora_rank=-1 is invalid"]),
    (["--model.lora_rank", "4", "--model.lora_alpha", "0"], ["model.lora_alpha=0", "> 0"]),
    (["--model.lora_rank", "4", "--model.lora_targets", "*.nothing.*"], ["'*.nothing.*' names no weight"]),
    (["--model.lora_rank", "4", "--model.expert_backend", "float8"], ["'float8' has no LoRA adapter path"]),
], ids=["rank", "alpha", "targets", "float8"])
def test_bad_lora_settings_are_one_line_before_the_run(tmp_path, capsys, flags, words):
    assert train_main([*TINY_MODEL, "--steps", "1", "--run-dir", str(tmp_path / "r"), *flags]) == 2
    one_stderr_line(capsys, *words)
    assert not (tmp_path / "r" / "checkpoints").exists()


# -- every layout follows one process; the HF export is the merged model -------------------------------------------

# Adam's first steps divide each gradient by its own root mean square: where that is near eps (1e-8), a rounding
# difference between layouts becomes an update difference of lr; eps 1e-4 keeps the comparison at rounding level
# (the final validation on 8 sequences: the checks read the training losses, gradient norms and weights)
LAYOUT = ["--model.hidden_size", "32", "--train.seq_len", "32", "--batch-size", "8", "--eval.every", "0",
          "--eval.sequences", "8", "--log.every", "1", "--log.progress", "off", "--log.tensorboard", "false",
          "--steps", "3",
          "--train.grad_clip", "0.5", "--train.lr", "0.01", "--train.warmup_steps", "0", "--train.eps", "1e-4",
          "--checkpoint.every", "3", "--model.lora_rank", "4", "--model.lora_alpha", "8"]


def losses(run_dir: Path) -> list[float]:
    """Each step's loss and gradient norm (the norm must count every adapter shard once: clipping uses it)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows] + [r["grad_norm"] for r in rows]


def hf_logits(folder: Path) -> torch.Tensor:
    from moekit.models.hf import load_hf

    model = load_hf(folder)
    return model(torch.arange(24).view(2, 12) % model.config.vocab_size)


@pytest.fixture(scope="module")
def lora_reference(tmp_path_factory):
    """One process per preset: the curve, the weights and the HF export's logits every layout must match."""
    from tests.dist_utils import run_trainer

    d = tmp_path_factory.mktemp("lora_layouts")
    seed = str(random.randrange(1 << 20))
    runs: dict[str, dict] = {}

    def reference(preset_name: str) -> dict:
        if preset_name not in runs:
            out = d / preset_name
            flags = ["--preset", preset_name, *LAYOUT, "--train.seed", seed]
            r = run_trainer([*flags, "--run-dir", str(out), "--export-hf", str(out / "hf")], 1,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
            assert r.returncode == 0, r.stderr[-3000:]
            runs[preset_name] = {"flags": flags, "losses": losses(out), "hf": hf_logits(out / "hf"),
                                 "weights": weights(out / "checkpoints" / "step_000003")}
        return runs[preset_name]

    return reference


@pytest.mark.parametrize("preset_name, nproc, extra", [
    ("deepseek-tiny", 4, ["--fsdp", "2", "--ep", "2"]),
    ("deepseek-tiny", 2, ["--ep", "2", "--layout.rebalance_every", "1", "--layout.expert_replicas", "2"]),
    ("deepseek-tiny", 2, ["--pp", "2", "--train.micro_batch_size", "2"]),
    ("deepseek-tiny", 4, ["--tp", "2", "--fsdp", "2", "--layout.sequence_parallel", "true"]),
    ("qwen3.5-tiny", 2, ["--tp", "2"]),
], ids=["fsdp2-ep2", "ep2-rebalanced-replicas", "pp2", "tp2-fsdp2-sp", "qwen3.5-tp2"])
def test_lora_training_is_layout_invariant_and_exports_merged(tmp_path, lora_reference, preset_name, nproc, extra):
    """Adapters sharded by FSDP, over experts (moved between ranks every step, replicated), on pipeline stages, and
    by tensor parallelism (DTensor's column- and row-wise shards of each projection's adapter, sequence parallel;
    Gated DeltaNet's replicated fused projection read in row blocks): the one-process curve and weights; each rank
    folds what it holds into the HF export, which has the one-process export's logits."""
    from tests.dist_utils import run_trainer

    ref = lora_reference(preset_name)
    r = run_trainer([*ref["flags"], *extra, "--run-dir", str(tmp_path), "--export-hf", str(tmp_path / "hf")], nproc,
                    env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert losses(tmp_path) == pytest.approx(ref["losses"], rel=1e-5, abs=1e-6)
    got = weights(tmp_path / "checkpoints" / "step_000003")
    for name, w in ref["weights"].items():
        if not name.endswith("pending_load"):
            torch.testing.assert_close(got[name], w, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    torch.testing.assert_close(hf_logits(tmp_path / "hf"), ref["hf"], rtol=1e-4, atol=1e-5)


FSDP_EP = ["--world-size", "16", "--fsdp", "2", "--ep", "8"]
PP_EP = ["--world-size", "16", "--pp", "2", "--ep", "8", "--train.micro_batch_size", "1"]
TP_FSDP_EP = ["--world-size", "16", "--tp", "2", "--fsdp", "2", "--ep", "4"]


@pytest.mark.parametrize("preset_name, targets, layout", [
    ("mixtral-8x7b", "all", FSDP_EP), ("mixtral-8x7b", "all", PP_EP), ("mixtral-8x7b", "all", TP_FSDP_EP),
    ("deepseek-v3", "*.experts.*,*.attn.*", TP_FSDP_EP), ("qwen3.5-35b-a3b", "all", TP_FSDP_EP),
], ids=["mixtral-fsdp-ep", "mixtral-pp-ep", "mixtral-tp-fsdp-ep", "deepseek-v3-tp-fsdp-ep", "qwen3.5-tp-fsdp-ep"])
def test_the_dry_run_plans_the_adapters(preset_name, targets, layout):
    """The estimate (config alone) against the recipe's real shards with the adapters built, exactly: parameters
    (TP shards a column-wise projection's adapters, replicates a row-wise one's), gradients and AdamW state of the
    adapters alone (memory.AdapterPart); the adapters are a sliver of what is held."""
    from dataclasses import replace

    from moekit.train.cli import parse_args
    from moekit.train.planning import dryrun, memory

    # the release's widths, heads and experts on 4 of its layers (every kind of layer it has: DeepSeek-V3's 3 dense
    # and an MoE one, Qwen3.5's 3 Gated DeltaNet and a full-attention one): the meta build of all of them took seconds
    cfg, opts = parse_args(["--dry-run", "--preset", preset_name, "--batch-size", "16", *layout,
                            "--model.lora_rank", "16", "--model.lora_targets", targets, "--model.num_layers", "4"])
    plan = dryrun.plan_dry_run(cfg, opts.world_size)
    with dryrun.fake_world(plan.world):
        built = dryrun.build(cfg, plan)
    assert not built.refused and built.freeze.startswith("LoRA rank 16")
    wl = replace(plan.workload, expert_replicas=built.replicas)
    est = memory.estimate_memory(cfg.model, built.topology.layout, wl, built.stages[0], plan.ranks_per_node,
                                 plan.hierarchical)
    assert est.params == sum(built.measured.values()) * 4
    assert est.grads == built.trained * 4 and 0 < est.grads < est.params / 20
    assert est.optimizer == built.optimizer[1]


@pytest.mark.parametrize("name, overrides, frozen", [
    ("deepseek-tiny", {"lora_rank": 4, "mtp_layers": 1}, lambda n: not is_adapter(n) and n != "embed.weight"),
    ("mixtral-tiny", {}, lambda n: ".experts." in n or ".attn.wq." in n),
], ids=["lora-deepseek-mtp", "frozen-experts-and-wq"])
def test_mfu_counts_no_weight_gradient_for_frozen_weights(monkeypatch, name, overrides, frozen):
    """The MFU numerator of a partial run (model_stats minus frozen_wgrad_flops) against torch's FlopCounterMode over
    a real forward and backward with those weights frozen, exactly; the embedding trains, so every layer's input
    needs its gradient (below the lowest trained parameter autograd would skip more: the count's stated limit)."""
    from torch.utils.flop_counter import FlopCounterMode

    from moekit.models import attention
    from moekit.models.stats import frozen_wgrad_flops, mean_keys, model_stats
    from tests.test_models import small

    cfg = small(name, num_layers=2, expert_backend="loop", **overrides)
    monkeypatch.setattr(attention, "EXPLICIT_ATTENTION", "always")
    model = build_model(cfg, seed=3)
    names = {n for n, p in model.named_parameters() if frozen(n)}
    for n, p in model.named_parameters():
        p.requires_grad_(n not in names)
    B, S = 2, 48
    tokens = torch.randint(0, cfg.vocab_size, (B, S), generator=gen("lora-flops", name))

    def addmm_(acc_shape, a_shape, b_shape, *args, **kwargs):
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]

    with FlopCounterMode(display=False, custom_mapping={torch.ops.aten.addmm_: addmm_}) as counter:
        model(tokens, targets=tokens.roll(-1, 1)).backward()
    counted = counter.get_total_flops() / (B * S)
    keys = sum(2 * S - 2 * mean_keys(S, cfg.attention_window(i)) for i in range(cfg.num_layers))
    keys += sum((S - k) ** 2 / S for k in range(1, cfg.mtp_layers + 1))
    attention_term = 3 * keys * cfg.num_heads * (cfg.attn_qk_head_dim + cfg.attn_v_head_dim)
    skipped = frozen_wgrad_flops(cfg, names, S)
    assert skipped > 0.1 * model_stats(cfg, S).train_flops_per_token
    assert counted == pytest.approx(model_stats(cfg, S).train_flops_per_token - skipped + attention_term, rel=1e-12)
