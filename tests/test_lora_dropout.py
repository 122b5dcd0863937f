"""LoRA dropout (model.lora_dropout; moe/lora_dropout.py): each adapter's input masked at rate p while training, the
same function on every expert path and against a reference written out here, masks that checkpoint recomputation
draws again, a bool mask saved instead of a dropped copy, the dry run's count of it, tensor parallelism's ranks
drawing one mask (the one-process run's), and the way in and out through PEFT."""
from __future__ import annotations

import dataclasses
import json
import os
import random

import pytest
import torch
import torch.nn.functional as F

from moekit.models.config import ModelConfig, preset
from moekit.models.lora import LoRALinear, add_linear_lora, keep_like, stream_of
from moekit.models.transformer import build_model
from moekit.moe.activations import get_activation
from moekit.moe.experts import GroupedExperts, counts_to_offs
from moekit.moe.lora_dropout import keep_mask
from moekit.moe.lora_experts import _grouped, _masks, lora_mlp
from moekit.train.loop import main as train_main
from tests.helpers import gen, one_stderr_line
from tests.test_lora import ragged_counts
from tests.tiny import TINY_MODEL

# -- the arithmetic ----------------------------------------------------------------------------------------------


def reference(rows, counts, named, activation, scale, drop):
    """The experts with dropped adapter inputs, one expert at a time from the formula (module docstring of
    moe.lora_experts), in float64: no moekit path involved."""
    act, p, outs, start = get_activation(activation), drop["p"], [], 0
    for e, n in enumerate(counts.tolist()):
        x, sl = rows[start:start + n].double(), slice(start, start + n)

        def project(t, side, keep):
            y = t @ named[f"w_{side}"][e].double()
            if f"lora_a_{side}" in named:
                d = t * keep[sl].double() / (1 - p) if keep is not None else t
                y = y + scale * (d @ named[f"lora_a_{side}"][e].double()) @ named[f"lora_b_{side}"][e].double()
            return y

        outs.append(project(act(project(x, "in", drop.get("in"))), "out", drop.get("out")))
        start += n
    outs.append(torch.zeros(rows.shape[0] - start, rows.shape[1], dtype=torch.float64))
    return torch.cat(outs)


@pytest.mark.parametrize("activation", ["swiglu", "swiglu_oai", "gelu"])
@pytest.mark.parametrize("sides", [("in", "out"), ("in",), ("out",)], ids=["both", "in", "out"])
def test_every_expert_path_drops_the_adapters_inputs_as_the_formula(activation, sides):
    """The CPU's loop (the fused autograd function for swiglu / swiglu_oai, autograd ops per expert for gelu) in
    float64 and the grouped path (grouped_mm) in float32 against the formula on the same masks: outputs and every
    gradient, ragged and empty experts and rows no expert owns (output and gradient 0). The masks drop about p of
    each input, so the result is not the undropped one."""
    g = gen("lora-dropout-experts", activation, sides)
    E, H, Fh, r, p = 5, 16, 24, 4, float(torch.empty(1).uniform_(0.1, 0.5, generator=g))
    N = int(torch.randint(40, 80, (1,), generator=g))
    ex = GroupedExperts(E, H, Fh, activation=activation, backend="loop", dtype=torch.float64)
    ex.add_lora(r, alpha=8.0, sides=sides, dropout=p)
    with torch.no_grad():
        for t in ex.parameters():
            t.copy_(torch.randn(t.shape, generator=g, dtype=torch.float64) * 0.3)
    counts = ragged_counts(E, N, g)
    owned = int(counts.sum())
    rows = torch.randn(N, H, generator=g, dtype=torch.float64)
    named = dict(ex.named_parameters())
    seed = int(torch.randint(0, 1 << 30, (1,), generator=g))
    torch.manual_seed(seed)
    drop = _masks(rows, named, p)  # the masks lora_mlp draws after the same seed
    assert set(drop) == {"p", *sides}
    kept = torch.cat([drop[s].flatten() for s in sides]).double().mean()
    assert abs(kept - (1 - p)) < 5 * ((p * (1 - p)) / sum(drop[s].numel() for s in sides)) ** 0.5 + 1e-3

    def grads(out, leaves):
        cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        return torch.autograd.grad(out.double(), leaves, cot)

    x64 = rows.clone().requires_grad_()
    want_out = reference(x64, counts, named, activation, ex.lora_scale, drop)
    want = grads(want_out, [x64, *named.values()])
    undropped = reference(rows, counts, named, activation, ex.lora_scale, {"p": 0.0})
    assert (want_out - undropped).abs().max() > 1e-3  # the masks matter

    x = rows.clone().requires_grad_()
    torch.manual_seed(seed)
    ex.train()
    out = ex(x, counts)  # the layer's loop path (lora_mlp), drawing its own masks
    got = grads(out, [x, *named.values()])
    torch.testing.assert_close(out, want_out, rtol=1e-10, atol=1e-10)
    for name, a, b in zip(["rows", *named], got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10, msg=lambda m: f"loop {name}: {m}")
    assert out[owned:].abs().max() == 0 if N > owned else True
    assert got[0][owned:].abs().max() == 0 if N > owned else True

    n32 = {k: v.detach().float().requires_grad_() for k, v in named.items()}
    x32 = rows.float().requires_grad_()
    out32 = _grouped(x32, counts_to_offs(counts, N), n32, activation, ex.lora_scale, drop)
    got32 = grads(out32, [x32, *n32.values()])
    torch.testing.assert_close(out32.double(), want_out, rtol=1e-4, atol=1e-4)
    for name, a, b in zip(["rows", *named], got32, want):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-4, msg=lambda m: f"grouped {name}: {m}")

    ex.eval()  # evaluation: no masks, the plain adapters
    torch.testing.assert_close(ex(rows, counts), undropped, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lora_mlp(rows, counts, named, activation, ex.lora_scale, "loop", dropout=0.0),
                               undropped, rtol=1e-10, atol=1e-10)


def test_the_fused_loops_double_backward_keeps_the_masks():
    """create_graph through the fused loop differentiates the autograd reference on the forward's masks: a
    gradient-of-gradient check against the formula's."""
    g = gen("lora-dropout-double")
    E, H, Fh, r, p = 3, 8, 12, 2, 0.3
    ex = GroupedExperts(E, H, Fh, activation="swiglu", backend="loop", dtype=torch.float64)
    ex.add_lora(r, alpha=4.0, dropout=p)
    with torch.no_grad():
        for t in ex.parameters():
            t.copy_(torch.randn(t.shape, generator=g, dtype=torch.float64) * 0.3)
    counts = torch.tensor([5, 0, 7])
    rows = torch.randn(14, H, generator=g, dtype=torch.float64)
    named = dict(ex.named_parameters())
    torch.manual_seed(3)
    drop = _masks(rows, named, p)
    results = []
    for run in ("fused", "formula"):
        x = rows.clone().requires_grad_()
        torch.manual_seed(3)
        out = ex(x, counts) if run == "fused" else reference(x, counts, named, "swiglu", ex.lora_scale, drop)
        (dx,) = torch.autograd.grad(out.pow(2).sum(), [x], create_graph=True)
        results.append(torch.autograd.grad(dx.pow(2).sum(), [named["lora_a_in"], named["lora_b_out"]]))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


def test_a_linear_adapter_drops_its_input_and_the_base_reads_it_whole():
    """LoRALinear: y = x W^T + b + s ((x * keep / (1 - p)) A^T) B^T on the mask drawn after the same seed, its
    gradients as autograd gives for the formula; in eval mode and under p 0 the plain adapter."""
    g = gen("lora-dropout-linear")
    lin = torch.nn.Linear(12, 10, dtype=torch.float64)
    add_linear_lora(lin, 3, 6.0, dropout=0.25)
    assert isinstance(lin, LoRALinear) and "lora_dropout=0.25" in repr(lin)
    with torch.no_grad():
        lin.lora_b.normal_(generator=g)
    x = torch.randn(2, 7, 12, generator=g, dtype=torch.float64, requires_grad=True)
    torch.manual_seed(11)
    keep = keep_like(x, 0.25)
    assert keep.dtype == torch.bool
    want = F.linear(x, lin.weight, lin.bias) + lin.lora_scale * F.linear(
        F.linear(x * keep.double() / 0.75, lin.lora_a), lin.lora_b)
    torch.manual_seed(11)
    got = lin(x)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    cot = torch.randn(got.shape, generator=g, dtype=torch.float64)
    leaves = [x, lin.weight, lin.bias, lin.lora_a, lin.lora_b]
    for a, b in zip(torch.autograd.grad(got, leaves, cot), torch.autograd.grad(want, leaves, cot)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    plain = F.linear(x, lin.weight, lin.bias) + lin.lora_scale * F.linear(F.linear(x, lin.lora_a), lin.lora_b)
    assert (got - plain).abs().max() > 1e-3
    torch.manual_seed(11)
    with torch.no_grad():  # no graph: the same function
        torch.testing.assert_close(lin(x), want, rtol=1e-12, atol=1e-12)
    lin.eval()
    torch.testing.assert_close(lin(x), plain, rtol=1e-12, atol=1e-12)


def test_under_autocast_the_dropped_product_differentiates_in_the_forwards_dtype():
    """bf16 autocast: backward forms the product again under the forward's autocast, so the gradients are the
    float64 formula's on the same mask to bf16 rounding, in the parameters' float32."""
    g = gen("lora-dropout-autocast")
    lin = add_linear_lora(torch.nn.Linear(32, 24), 4, 8.0, dropout=0.3)
    with torch.no_grad():
        lin.lora_b.normal_(generator=g)
    x = torch.randn(40, 32, generator=g, requires_grad=True)
    torch.manual_seed(2)
    keep = keep_like(x, 0.3)
    torch.manual_seed(2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = lin(x)
    assert y.dtype == torch.bfloat16
    cot = torch.randn(y.shape, generator=g)
    got = torch.autograd.grad(y, [x, lin.lora_a, lin.lora_b], cot.bfloat16())
    p64 = [t.detach().double().requires_grad_() for t in (x, lin.weight, lin.bias, lin.lora_a, lin.lora_b)]
    ref = F.linear(p64[0], p64[1], p64[2]) + lin.lora_scale * F.linear(
        F.linear(p64[0] * keep.double() / 0.7, p64[3]), p64[4])
    want = torch.autograd.grad(ref, [p64[0], p64[3], p64[4]], cot.double())
    torch.testing.assert_close(y.double(), ref, rtol=0.03, atol=0.1)
    for a, b in zip(got, want):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a.double(), b, rtol=0.03, atol=0.1 * b.abs().max().item())


def saved_bytes(fn) -> int:
    """Bytes of the distinct storages autograd saves while ``fn`` runs (layer_probes.KeptForBackward)."""
    from moekit.bench.layer_probes import KeptForBackward

    with KeptForBackward() as kept:
        out = fn()
    n = kept.bytes()  # while out holds the graph
    del out
    return n


def test_dropout_saves_a_one_byte_mask_per_input_element_not_a_dropped_copy():
    """What a LoRALinear keeps for backward grows by the input's element count in bytes (its bool mask; the input
    itself is the base projection's), where an nn.Dropout before the adapter keeps a dropped copy and its mask."""
    torch.manual_seed(0)
    T, H, r = 64, 48, 4
    lin = add_linear_lora(torch.nn.Linear(H, H, bias=False), r, 8.0)
    x = torch.randn(T, H, requires_grad=True)
    plain = saved_bytes(lambda: lin(x))
    lin.lora_dropout = 0.1
    ours = saved_bytes(lambda: lin(x))
    drop = torch.nn.Dropout(0.1)
    naive = saved_bytes(lambda: F.linear(x, lin.weight) + F.linear(F.linear(drop(x), lin.lora_a), lin.lora_b))
    assert ours - plain == T * H  # one byte per element
    assert naive - plain >= T * H * 4  # at least the float32 dropped copy


def test_masks_are_fresh_per_call_equal_per_seed_and_stream_and_keep_one_minus_p():
    torch.manual_seed(5)
    a = keep_mask((400, 300), 0.2, "cpu", 0)
    b = keep_mask((400, 300), 0.2, "cpu", 0)
    assert not torch.equal(a, b)  # the generator moved on
    torch.manual_seed(5)
    assert torch.equal(keep_mask((400, 300), 0.2, "cpu", 0), a)
    torch.manual_seed(5)
    c = keep_mask((400, 300), 0.2, "cpu", 1)  # another stream: other tokens, another mask
    assert not torch.equal(c, a)
    kept = a.double().mean().item()
    assert abs(kept - 0.8) < 5 * (0.16 / a.numel()) ** 0.5
    torch.manual_seed(5)
    state = torch.get_rng_state()
    keep_mask((3,), 0.5, "cpu", 0)
    one = torch.get_rng_state()
    torch.set_rng_state(state)
    keep_mask((5000,), 0.5, "cpu", 7)
    assert torch.equal(torch.get_rng_state(), one)  # one draw whatever the shape and stream
    assert stream_of(torch.zeros(2)) == 0  # no process group: rank 0


def model_grads(cfg, mode: str, seed: int):
    from moekit.models.init import init_weights
    from moekit.models.parallelize import apply_activation_checkpointing

    model = build_model(cfg)
    init_weights(model, 0)
    with torch.no_grad():
        for name, t in model.named_parameters():
            if ".lora_b" in name:  # adapters that already moved: the masks reach the loss
                t.normal_(0.0, 0.2, generator=torch.Generator().manual_seed(len(name)))
    apply_activation_checkpointing(model, mode)
    model.train()
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(seed)
    loss = model(tokens, targets=tokens)
    loss.backward()
    return loss.item(), {n: t.grad for n, t in model.named_parameters() if t.grad is not None}


@pytest.mark.parametrize("p", [0.05, 0.5])
def test_every_lane_of_the_packed_draw_keeps_one_minus_p(p):
    """keep_mask packs three 16-bit uniforms per 63-bit draw: each lane (position mod 3), and each 4th, keeps
    1 - p (the draw's top lane, short of its sign bit, would keep everything at p 0.5), and neighbours are
    independent (both of a pair kept: (1 - p)^2)."""
    torch.manual_seed(random.randrange(1 << 20))
    m = keep_mask((300_000,), p, "cpu", 0).double()
    n = m.numel() // 12 * 12
    tol = 5 * (p * (1 - p) / (n / 4)) ** 0.5
    for period in (3, 4):
        for lane in m[:n].view(-1, period).mean(0).tolist():
            assert abs(lane - (1 - p)) < tol, (period, lane)
    both = (m[:n:2] * m[1:n:2]).mean().item()
    assert abs(both - (1 - p) ** 2) < tol


@pytest.mark.parametrize("mode", ["full", "selective", "ffn"])
def test_checkpointed_blocks_recompute_the_forwards_masks(mode):
    """Activation checkpointing recomputes with the generator restored: the gradients are those of the masks the
    forward used (equal to the unchekpointed run's), while another seed draws other masks (another loss)."""
    cfg = dataclasses.replace(preset("mixtral-tiny"), num_layers=2, lora_rank=4, lora_dropout=0.2)
    seed = random.randrange(1 << 20)
    loss, grads = model_grads(cfg, "none", seed)
    ck_loss, ck_grads = model_grads(cfg, mode, seed)
    assert ck_loss == loss
    assert grads.keys() == ck_grads.keys() and grads
    for name in grads:
        torch.testing.assert_close(ck_grads[name], grads[name], rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")
    assert model_grads(cfg, mode, seed + 1)[0] != loss


@pytest.mark.parametrize("value, words", [
    (1.0, ["model.lora_dropout=1.0 is invalid", "[0, 1)"]), (-0.1, ["model.lora_dropout=-0.1"]),
    (True, ["model.lora_dropout=True"]), ("0.1", ["model.lora_dropout='0.1'"]),
])
def test_bad_dropout_values_are_refused_naming_the_field(value, words):
    with pytest.raises(ValueError) as exc:
        ModelConfig(lora_rank=4, lora_dropout=value).validate()
    assert all(w in str(exc.value) for w in words), exc.value
    with pytest.raises(ValueError, match="model.lora_rank is 0"):
        ModelConfig(lora_dropout=0.1).validate()
    with pytest.raises(ValueError, match="lora_dropout=2"):
        GroupedExperts(2, 4, 4).add_lora(2, 4.0, dropout=2)


def test_the_cli_refuses_dropout_without_adapters_in_one_line(tmp_path, capsys):
    assert train_main([*TINY_MODEL, "--steps", "1", "--run-dir", str(tmp_path / "r"), "--model.lora_dropout",
                       "0.1"]) == 2
    one_stderr_line(capsys, "model.lora_dropout=0.1", "model.lora_rank is 0")


# -- the dry run counts the masks ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name, mode, dtype, over", [
    ("mixtral-tiny", "none", "float32", {}), ("mixtral-tiny", "selective", "float32", {}),
    ("mixtral-tiny", "ffn", "float32", {}),
    ("qwen3.5-tiny", "none", "float32", {"full_attention_every": 2}),  # Gated DeltaNet's fused projection, gated GQA
    ("mixtral-tiny", "none", "float32",
     {"activation": "gelu", "shared_ffn_hidden_size": 64, "shared_expert_gate": True}),
    ("deepseek-tiny", "selective", "float32", {}),
    # bf16 autocast: a Linear adapter's A keeps no autocast copy under dropout (the dropped product casts it again
    # in backward); the experts' adapters keep theirs (the layer casts its stacks once)
    ("deepseek-tiny", "none", "bfloat16", {}), ("qwen3.5-tiny", "none", "bfloat16", {"full_attention_every": 2}),
])
def test_the_planner_counts_the_adapters_products_and_masks(name, mode, dtype, over):
    """Activations with adapters and dropout against the measured bytes (tests/test_dryrun.py's measurement): the
    r-wide products, the bool masks, what op-level checkpointing caches, autocast's weight copies; within 0.5% as
    without adapters."""
    from moekit.comm.topology import Layout
    from moekit.train.planning.memory import Workload, estimate_memory
    from tests.test_dryrun import B, S, measure_one_process

    cfg = dataclasses.replace(preset(name), num_layers=2, lora_rank=4, lora_dropout=0.1, **over)
    autocast = getattr(torch, dtype) if dtype != "float32" else None
    measured = measure_one_process(cfg, mode, autocast=autocast, backward=autocast is None)
    est = estimate_memory(cfg, Layout(), Workload(B, S, dtype, mode, "cpu"))
    assert est.activations == pytest.approx(measured["activations"], rel=0.005), est.breakdown
    without = estimate_memory(dataclasses.replace(cfg, lora_dropout=0.0), Layout(), Workload(B, S, dtype, mode, "cpu"))
    if mode != "selective":  # the masks are counted (selective checkpointing draws them again)
        assert est.activations > without.activations


# -- PEFT: the dropout goes out and comes back ------------------------------------------------------------------


def test_export_lora_writes_the_dropout_and_import_lora_trains_on_with_it(tmp_path, capsys):
    from moekit.models.hf import save_hf
    from moekit.models.hf.peft import save_peft
    from moekit.train.convert import main as convert
    from moekit.train.modelfiles import load_moekit

    cfg = dataclasses.replace(preset("mixtral-tiny"), num_layers=1, lora_rank=4, lora_dropout=0.05)
    model = build_model(cfg)
    base = dataclasses.replace(cfg, lora_rank=0, lora_dropout=0.0)
    folder = save_peft(model, tmp_path / "adapter", base_model=str(tmp_path / "base"))
    assert json.loads((folder / "adapter_config.json").read_text())["lora_dropout"] == 0.05
    plain = build_model(base)
    plain.load_state_dict({k: v for k, v in model.state_dict().items() if "lora_" not in k})
    save_hf(plain, tmp_path / "base")
    out = tmp_path / "imported.safetensors"
    assert convert(["import-lora", str(tmp_path / "base"), str(folder), "-o", str(out)]) == 0
    assert "lora_dropout 0.05, as the adapter was trained" in capsys.readouterr().out
    assert load_moekit(out).config.lora_dropout == 0.05


# -- tensor parallelism: one mask per replicated input, the one-process run's ---------------------------------------

FLAGS = ["--model.hidden_size", "32", "--train.seq_len", "32", "--batch-size", "4", "--eval.every", "0",
         "--eval.sequences", "8", "--log.every", "1", "--log.progress", "off", "--log.tensorboard", "false",
         "--steps", "2", "--train.lr", "0.01", "--train.warmup_steps", "0", "--train.eps", "1e-4",
         "--checkpoint.every", "0", "--model.lora_rank", "4", "--model.lora_alpha", "8", "--model.lora_dropout", "0.3",
         "--model.lora_targets", "*.attn.*"]


def curve(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows] + [r["grad_norm"] for r in rows]


@pytest.mark.parametrize("preset_name, extra", [
    ("deepseek-tiny", ["--tp", "2", "--layout.sequence_parallel", "true"]),
    ("qwen3.5-tiny", ["--tp", "2"]),
], ids=["deepseek-tp2-sp", "qwen3.5-tp2"])
def test_tensor_parallel_ranks_draw_the_one_process_masks(tmp_path, preset_name, extra):
    """Attention's adapters under TP read DTensors (column-wise: replicated inputs; row-wise wo: a shard, its slice
    of the whole mask) and Gated DeltaNet's replicated fused projection: every TP rank draws what one process
    draws, so the curve is the one-process curve with dropout on, and not the curve without it."""
    from tests.dist_utils import run_trainer

    seed = str(random.randrange(1 << 20))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    flags = ["--preset", preset_name, *FLAGS, "--train.seed", seed]
    runs = {}
    for name, nproc, more in (("one", 1, []), ("tp", 2, extra), ("off", 1, ["--model.lora_dropout", "0"])):
        r = run_trainer([*flags, *more, "--run-dir", str(tmp_path / name)], nproc, env=env)
        assert r.returncode == 0, r.stderr[-3000:]
        runs[name] = curve(tmp_path / name)
    assert runs["tp"] == pytest.approx(runs["one"], rel=1e-5, abs=1e-6)
    assert runs["off"] != pytest.approx(runs["one"], rel=1e-4)


def test_an_fsdp_expert_parallel_run_with_dropout_everywhere_resumes_bitwise(tmp_path):
    """FSDP-sharded adapters (the dropped product saves the unsharded parameter as a projection does), every
    adapter dropped (attention, shared and routed experts, whose rows differ by rank): each rank's
    generator still advances one draw per mask, so the rank-0 generator state a checkpoint keeps resumes every
    rank's stream: the resumed run's weights are the uninterrupted run's, bit for bit."""
    from tests.dist_utils import run_trainer
    from tests.test_lora import weights

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    flags = ["--preset", "deepseek-tiny", *FLAGS, "--model.lora_targets", "all", "--steps", "3", "--checkpoint.every",
             "1", "--fsdp", "2", "--ep", "2", "--train.seed", str(random.randrange(1 << 20))]
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    r = run_trainer([*flags, "--run-dir", str(whole)], 4, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    r = run_trainer([*flags, "--resume", str(whole / "checkpoints" / "step_000002"), "--run-dir", str(resumed)], 4,
                    env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = (weights(d / "checkpoints" / "step_000003") for d in (whole, resumed))
    moved = [k for k in a if ".lora_" in k and ".experts." in k]
    assert moved and a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_compiled_adapter_draws_the_eager_masks(backend):
    """Inside torch.compile the mask is drawn eagerly (a graph break around it): the same output and input
    gradient as eager after the same seed, another seed another output."""
    lin = add_linear_lora(torch.nn.Linear(16, 8), 4, 8.0, dropout=0.3)
    with torch.no_grad():
        lin.lora_b.normal_(generator=gen("lora-dropout-compile"))

    def f(x):
        return torch.relu(lin(x)) * 2

    torch._dynamo.reset()
    compiled = torch.compile(f, backend=backend)
    x = torch.randn(6, 16, generator=gen("lora-dropout-compile-x"), requires_grad=True)
    outs = []
    for fn in (f, compiled):
        torch.manual_seed(4)
        y = fn(x)
        (dx,) = torch.autograd.grad(y.sum(), [x])
        outs.append((y, dx))
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=0, atol=0)
    torch.testing.assert_close(outs[1][1], outs[0][1], rtol=1e-6, atol=1e-6)
    torch.manual_seed(5)
    assert (compiled(x) - outs[0][0]).abs().max() > 1e-3
