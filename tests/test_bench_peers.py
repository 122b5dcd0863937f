"""The peers the issue-9 benchmarks time compute the same numbers as moekit: the torchtitan-style MoE
reference, the plain-torch dispatch / combine, and the activation-memory accounting."""
from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn
from moekit.bench import dispatch_bandwidth
from moekit.bench import layer_probes
from moekit.bench import suite_summary
from moekit.bench.titan_ref import TitanStyleMoE

from moekit.moe import MoELayer, build_router


def grads_of(module, layer, x, g):
    x.grad = None
    layer.zero_grad(set_to_none=True)
    y = module(x)
    y.backward(g)
    return [y.detach(), x.grad.clone()] + [p.grad.clone() for p in layer.parameters()]


@pytest.mark.parametrize("backend", ["loop", "torch"])
@pytest.mark.parametrize("experts,top_k", [(4, 2), (8, 4)])
def test_titan_reference_matches_moelayer(backend, experts, top_k):
    torch.manual_seed(0)
    H, F, T = 32, 16, 48
    layer = MoELayer(H, F, experts, build_router("topk", H, experts, top_k=top_k, aux_loss_coeff=0.0), backend=backend)
    x = torch.randn(2, T // 2, H, requires_grad=True)
    g = torch.randn(2, T // 2, H)
    ours = grads_of(layer, layer, x, g)
    ref = grads_of(TitanStyleMoE(layer), layer, x, g)  # shares the layer's parameters
    names = ["output", "dx", "router", "w_in", "w_out"]
    for name, a, b in zip(names, ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def test_titan_reference_refuses_what_it_does_not_implement():
    with pytest.raises(ValueError, match="dropless"):
        TitanStyleMoE(MoELayer(16, 8, 4, build_router("topk", 16, 4, top_k=2, capacity_factor=1.0)))
    with pytest.raises(ValueError, match="SwiGLU"):
        TitanStyleMoE(MoELayer(16, 8, 4, "topk", activation="gelu"))


def test_dispatch_peers_compute_the_same_thing():
    s = dispatch_bandwidth.setup(40, 24, 8, 3, torch.float32, torch.device("cpu"), seed=0)
    peers = dispatch_bandwidth.op_peers(s, 40, 24, 4)
    moekit_rows = peers["dispatch_fwd"][1]["moekit"]()
    assert torch.equal(moekit_rows, peers["dispatch_fwd"][1]["torch"]())  # permute == a plain gather
    assert torch.equal(moekit_rows, s["x"][s["meta"].row_slot // 3])
    for op in ("dispatch_bwd", "combine_fwd", "combine_bwd"):
        a, b = peers[op][1]["moekit"](), peers[op][1]["torch"]()
        for p, q in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-5)
    nbytes, fns = peers["combine_bwd"]
    assert nbytes == 3 * 40 * 3 * 24 * 4 and fns["copy"]().numel() * 4 * 2 == nbytes  # the copy moves the same bytes


def test_saved_bytes_count_activations_not_parameters():
    lin = nn.Linear(16, 8)
    x = torch.randn(10, 16)
    assert layer_probes.saved_activation_bytes(lin, x)["saved_tensors_bytes"] == 10 * 16 * 4  # the input only
    parts = layer_probes.minimum_activation_bytes(tokens=10, hidden=16, ffn=8, experts=4, top_k=2, elem=2)
    assert parts["gathered_rows"] == 20 * 16 * 2 and parts["expert_hidden"] == 20 * 16 * 2
    assert parts["total"] == sum(v for k, v in parts.items() if k != "total")


def test_phase_steps_run_and_reach_their_inputs():
    layer = MoELayer(16, 8, 4, build_router("topk", 16, 4, top_k=2, aux_loss_coeff=0.01))
    steps = layer_probes.phase_steps(layer, torch.randn(12, 16))
    assert set(steps) == set(layer_probes.PHASES)
    for step in steps.values():
        step()
    assert layer.router.weight.grad is not None and layer.experts.w_in.grad is not None
    assert layer_probes.host_sync_check(steps, torch.device("cpu")) == dict.fromkeys(steps, "not checked (CPU)")
    assert layer_probes.device_times(steps, torch.device("cpu")) == {}  # GPU kernel time: CUDA only


def test_kernel_time_sums_device_kernels_per_run():
    """The profiler events' device time: what each host-side op launched, summed once; the GPU-side copies
    of record_function ranges (device type CUDA) are not counted again."""
    from types import SimpleNamespace as Ev

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    events = [Ev(device_type=cpu, self_device_time_total=1500.0), Ev(device_type=cpu, self_device_time_total=500.0),
              Ev(device_type=cuda, self_device_time_total=9000.0), Ev(self_device_time_total=0.0)]
    assert layer_probes.kernel_ms(events, runs=2) == pytest.approx(1.0)  # (1500 + 500) us / 2 runs
    assert layer_probes.kernel_ms([], runs=3) == 0.0


def test_kernel_table_groups_device_kernels_by_name_per_run():
    """kernel_table: device events only (no host ops, no record_function ranges), grouped by name, most time
    first, per run; the tail past ``top`` is one "(others)" entry, and the totals are kept."""
    from types import SimpleNamespace as Ev

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def k(name, us, **kw):
        return Ev(name=name, device_type=cuda, device_time_total=us, **kw)

    events = [k("gather", 100.0), k("sort_pass", 30.0), k("gather", 120.0), k("sort_pass", 30.0), k("fill", 4.0),
              k("scatter", 10.0), k("my_range", 999.0, is_user_annotation=True),
              Ev(name="aten::index_select", device_type=cpu, device_time_total=220.0)]
    table = layer_probes.kernel_table(events, runs=2, top=2)
    assert [r["kernel"] for r in table] == ["gather", "sort_pass", "(others)"]
    assert table[0] == {"kernel": "gather", "us": 110.0, "launches": 1.0}
    assert table[1]["launches"] == 1.0 and table[2] == {"kernel": "(others)", "us": 7.0, "launches": 1.0}
    assert sum(r["us"] for r in table) == pytest.approx((220 + 60 + 14) / 2)
    assert layer_probes.kernel_table([], runs=3) == []
    assert layer_probes.kernel_breakdown({"x": lambda: None}, torch.device("cpu")) == {}


def test_summary_reads_targets(tmp_path):
    rows = [{"shape": "fine-grained", "ratios": {"triton/torch_grouped:fwd": 1.1, "triton/loop:fwd": 2.0,
                                                 "triton/triton_tma:fwd": 0.8}},
            {"shape": "mixtral-8x7b", "ratios": {"triton/torch_grouped:fwd": 0.95}}]
    (tmp_path / "grouped_gemm.json").write_text(json.dumps({"rows": rows, "skew_ratios": []}))
    (tmp_path / "moe_layer.json").write_text(json.dumps({"results": [
        {"impl": "titan-style", "moekit_speedup": 1.3}], "cases": [
        {"router_permute_combine_share": 0.2, "router_permute_combine_kernel_share": 0.08,
         "host_syncs": {"router": "none"}}]}))
    assert suite_summary.main([str(tmp_path)]) == 0
    status = {t["target"]: t["status"] for t in json.loads((tmp_path / "summary.json").read_text())["targets"]}
    assert status["grouped GEMM: triton / torch grouped_mm, fine-grained shapes"] == "met"
    assert status["grouped GEMM: triton / torch grouped_mm, Mixtral-8x7B"] == "met"
    assert status["grouped GEMM: triton / per-expert loop, fine-grained shapes"] == "missed"
    assert status["grouped GEMM: triton Zipf(1.2) / uniform routing"] == "no data"
    targets = {t["target"]: t for t in json.loads((tmp_path / "summary.json").read_text())["targets"]}
    assert targets["  with the TMA variants: triton_tma / torch grouped_mm, fine-grained"]["worst"] == pytest.approx(1.1 / 0.8)
    assert targets["  with the TMA variants: triton_tma / torch grouped_mm, Mixtral-8x7B"]["status"] == "no data"
    assert targets["grouped GEMM: TMA variants / pointer kernels (triton_tma / triton; > 1: make them the default)"][
        "worst"] == pytest.approx(1.25)
    assert status["MoE layer fwd+bwd: titan-style time / moekit time"] == "met"
    assert status["MoE layer: router + permute + combine share of layer time"] == "missed"
    assert status["  the same share of GPU kernel time (no launch overhead)"] == "met"
    assert status["MoE layer: router forward+backward free of host syncs (1 = none)"] == "met"


def test_summary_dispatch_by_wall_clock_and_by_kernel_time(tmp_path):
    """Each dispatch op: moekit / copy by wall clock, then by the op's GPU kernel time against the same
    config's copy (the small-op case where the kernel runs at copy speed and the isolated call's host time
    makes the wall-clock ratio miss); rows without a profile give no kernel line."""
    def row(op, impl, ms, vs_copy=None, kernel_ms=None, config="mixtral"):
        return {"config": config, "tokens": 16384, "op": op, "impl": impl, "median_ms": ms, "vs_copy": vs_copy,
                **({"kernel_ms": kernel_ms} if kernel_ms is not None else {})}

    results = [row("dispatch_bwd", "copy", 0.134, 1.0), row("dispatch_bwd", "moekit", 0.343, 0.39, 0.136),
               row("dispatch_bwd", "copy", 0.7, 1.0, config="ds"), row("dispatch_bwd", "moekit", 0.71, 0.98, 1.4, "ds"),
               row("combine_fwd", "copy", 0.135, 1.0), row("combine_fwd", "moekit", 0.208, 0.65)]
    (tmp_path / "dispatch_bandwidth.json").write_text(json.dumps({"results": results}))
    assert suite_summary.main([str(tmp_path)]) == 0
    targets = json.loads((tmp_path / "summary.json").read_text())["targets"]
    names = [t["target"] for t in targets]
    at = names.index("local dispatch_bwd: moekit GB/s / plain copy GB/s")
    wall, kernel = targets[at], targets[at + 1]
    assert wall["status"] == "missed" and wall["worst"] == pytest.approx(0.39)
    assert kernel["target"].startswith("  the same by GPU kernel time") and kernel["status"] == "missed"
    assert kernel["worst"] == pytest.approx(0.5) and kernel["median"] == pytest.approx((0.5 + 0.134 / 0.136) / 2)
    combine = targets[names.index("local combine_fwd: moekit GB/s / plain copy GB/s") + 1]
    assert combine["status"] == "no data"


def test_summary_lists_the_fused_permute_run_beside_the_ab_runs(tmp_path):
    """gpu_suite's train_mfu_fused step writes its own JSON: its run is a target line of its own, marked fused, after
    train_mfu.json's base / legacy lines; without it only those."""
    runs = {"results": [{"config": "auto-compile-on-base", "mfu": 0.36}, {"config": "auto-compile-on-legacy", "mfu": 0.31}]}
    (tmp_path / "train_mfu.json").write_text(json.dumps(runs))
    assert suite_summary.main([str(tmp_path)]) == 0
    names = [t["target"] for t in json.loads((tmp_path / "summary.json").read_text())["targets"]]
    assert [n for n in names if "MFU" in n] == ["training MFU, auto-compile-on-base", "training MFU, auto-compile-on-legacy"]
    (tmp_path / "train_mfu_fused.json").write_text(json.dumps({"results": [{"config": "auto-compile-on", "mfu": 0.38}]}))
    assert suite_summary.main([str(tmp_path)]) == 0
    targets = json.loads((tmp_path / "summary.json").read_text())["targets"]
    fused = [t for t in targets if t["target"] == "training MFU, auto-compile-on-fused"]
    assert len(fused) == 1 and fused[0]["worst"] == pytest.approx(0.38) and fused[0]["status"] == "missed"


def test_summary_help_and_bad_folders(tmp_path, capsys):
    """--help says what it reads and prints (it used to be taken for a folder); a missing folder or a file is one
    line and exit status 2, with nothing written; a corrupt input is named in a note, not passed over."""
    with pytest.raises(SystemExit) as exc:
        suite_summary.main(["--help"])
    out = capsys.readouterr().out
    assert exc.value.code == 0 and "grouped_gemm.json" in out and "summary.json" in out and "FOLDER" in out
    for bad, words in ((tmp_path / "nope", "nope: no such folder"), (tmp_path / "f.txt", "f.txt: is a file")):
        if bad.suffix:
            bad.write_text("x\n")
        with pytest.raises(SystemExit) as exc:
            suite_summary.main([str(bad)])
        err = capsys.readouterr().err.strip().splitlines()
        assert exc.value.code == 2 and len(err) == 1 and words in err[0], err
        assert err[0].startswith("suite_summary.py: error: ")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.txt"]
    (tmp_path / "moe_layer.json").write_text('{"results": [')  # cut short
    assert suite_summary.main([str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert "moe_layer.json: cannot be read as JSON" in err and (tmp_path / "summary.json").exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert suite_summary.main([str(empty)]) == 0
    assert "holds none of grouped_gemm.json" in capsys.readouterr().err


@pytest.mark.parametrize("shared,backward", [(0, False), (24, True)])
def test_gemm_floor_runs_the_layers_gemms(shared, backward):
    """The floor step of tools/bench/cpu_layer.py issues exactly the layer's matmuls for this routing (router,
    shared expert, each routed expert's block; x3 with backward) and counts their flops."""
    from torch.utils._python_dispatch import TorchDispatchMode

    torch.manual_seed(0)
    T, H, F, E, k = 40, 16, 12, 4, 2
    layer = MoELayer(H, F, E, build_router("topk", H, E, top_k=k), shared_ffn_hidden_size=shared,
                     shared_expert_gate=shared > 0)
    x = torch.randn(T, H)
    step, flop = layer_probes.gemm_floor_step(layer, x, backward)
    counts = layer.router(x).tokens_per_expert.tolist()
    busy = sum(1 for c in counts if c)
    passes = 3 if backward else 1
    dense = [(T, H, E)] + ([(T, H, shared), (T, H, shared), (T, shared, H), (T, H, 1)] if shared else [])
    assert flop == passes * 2 * (sum(m * kk * n for m, kk, n in dense) + T * k * H * (2 * F + F))

    class Count(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.calls += func in (torch.ops.aten.mm.out, torch.ops.aten.mm.default)
            return func(*args, **(kwargs or {}))

    from moekit.moe.expert_threads import expert_threads

    with expert_threads(1), Count():
        step()
    assert Count.calls == passes * (len(dense) + 2 * busy)


def test_cpu_layer_benchmark_smoke(tmp_path, capsys):
    """tools/bench/cpu_layer.py end to end at a tiny size: every peer, the floor and the ceiling rows. (In this
    process: its default --host-memory system leaves the allocator as it is, and its oneDNN cache setting is made
    when the module is imported, as test_gpt_oss_peer_computes_moekits_layer below imports it.)"""
    from moekit.bench import cpu_layer

    out = tmp_path / "cpu_layer.json"
    assert cpu_layer.main(["--tokens", "64", "--hidden", "32", "--shapes", "deepseek", "--dtypes", "float32",
                           "--repeats", "1", "--warmup", "1", "--out", str(out)]) == 0, capsys.readouterr().err[-2000:]
    payload = json.loads(out.read_text())
    assert payload["host_memory"].startswith("host memory: ")  # what the process's allocator did is recorded
    rows = payload["results"]
    ceilings = [r for r in rows if r["impl"].startswith("=> ceiling")]
    has_hf = any(r["impl"].startswith("transformers[") for r in rows)
    assert len(ceilings) == 2 and all((r["ratio"] is not None) == has_hf for r in ceilings)
    assert all(r["faults_per_call"] >= 0 for r in rows if "min_ms" in r)
    floor = [r for r in rows if r["impl"] == "GEMMs alone (floor)"]
    assert len(floor) == 2 and all(r["min_ms"] > 0 and r["gflops"] > 0 for r in floor)


@pytest.mark.parametrize("impl", ["eager", "grouped_mm"])
def test_gpt_oss_peer_computes_moekits_layer(impl):
    """The gpt-oss peer of tools/bench/cpu_layer.py and moe_layer.py (transformers' GptOssMLP, weights copied
    with gate / up interleaved, random router and expert biases) is moekit's function: output and the input's
    gradient, with both of transformers' experts implementations, else the ratios compare different work."""
    pytest.importorskip("transformers.models.gpt_oss")
    from moekit.bench import cpu_layer, moe_layer

    torch.manual_seed(0)
    H, F, E, k, T = 32, 16, 8, 4, 40
    layer = cpu_layer.moekit_layer(H, F, E, k, 0, gpt_oss=True)
    moe_layer.randomize_biases(layer, torch.Generator().manual_seed(1))
    assert layer.router.bias.abs().min() > 0 and layer.experts.b_in.abs().min() > 0  # a dropped bias would show
    block = cpu_layer.hf_block(H, F, E, k, 0, impl, gpt_oss=True)
    moe_layer.copy_into_hf(layer, block)
    x = 3 * torch.randn(2, T // 2, H)  # h past swiglu_oai's clamp for some rows
    g = torch.randn(2, T // 2, H)
    ours, theirs = [grads_of(m, m, x.clone().requires_grad_(), g)[:2] for m in (layer, block)]
    for name, a, b in zip(("output", "dx"), ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m: f"{impl} {name}: {m}")


def test_cpu_fusion_peers_compute_moekits_functions():
    """tools/bench/cpu_fusion.py times plain-torch versions of the combine and the SwiGLU epilogues against
    moekit's eager ones: they must be the same functions (fresh random routing with empty and ragged experts,
    float64 so only the maths can differ), else the ratios compare different work."""
    from moekit.bench import cpu_fusion
    from moekit.moe.dispatch import PermuteMeta, sort_slots, unpermute

    T, k, E, H, F = 37, 3, 6, 8, 5
    ids = torch.randint(0, E - 2, (T, k))  # the last two experts get nothing
    ids[:5] = 0  # one crowded expert
    row_slot, slot_row = sort_slots(ids, T * k)
    weights, rows = torch.rand(T, k, dtype=torch.float64), torch.randn(T * k, H, dtype=torch.float64)
    meta = PermuteMeta(T, k, row_slot, slot_row, weights, may_drop=False)
    # the reference another way: each token's rows found by searching row_slot, not through slot_row
    ref = torch.stack([sum(weights[t, j] * rows[(row_slot == t * k + j).nonzero().item()] for j in range(k))
                       for t in range(T)])
    torch.testing.assert_close(unpermute(rows, meta), ref)
    torch.testing.assert_close(cpu_fusion.combine_plain(rows, slot_row, weights), ref)

    N = 23
    h = torch.randn(N, 2 * F, dtype=torch.float64, requires_grad=True)
    da = torch.randn(N, F, dtype=torch.float64)
    a = torch.nn.functional.silu(h[:, :F]) * h[:, F:]  # autograd is the reference for both epilogues
    (dh_ref,) = torch.autograd.grad(a, h, da)
    h = h.detach()
    torch.testing.assert_close(cpu_fusion.swiglu_eager(h, torch.empty(N, F, dtype=h.dtype)), a.detach())
    torch.testing.assert_close(cpu_fusion.swiglu_plain(h), a.detach())
    torch.testing.assert_close(cpu_fusion.swiglu_bwd_eager(da, h, torch.empty_like(h)), dh_ref)
    torch.testing.assert_close(cpu_fusion.swiglu_bwd_plain(da, h), dh_ref)

    B, heads, S, D = 2, 3, 7, 4
    q, kk, v = (torch.randn(B, heads, S, D, dtype=torch.float64) for _ in range(3))
    mask = torch.full((S, S), -math.inf, dtype=torch.float64).triu(1).expand(B * heads, S, S)
    torch.testing.assert_close(cpu_fusion.attention_explicit(q, kk, v, mask),
                               torch.nn.functional.scaled_dot_product_attention(q, kk, v, is_causal=True))


def test_cpu_fusion_benchmark_smoke(tmp_path):
    """tools/bench/cpu_fusion.py end to end at a tiny size, with torch.compile's aot_eager backend (no C++
    compile in CI): every case's peers are timed, checked against moekit's output and written to the JSON."""
    from moekit.bench import cpu_fusion

    out = tmp_path / "cpu_fusion.json"
    try:
        assert cpu_fusion.main(["--tokens", "48", "--hidden", "16", "--shapes", "fine", "--dtypes", "float32",
                                "--attn-batch", "2", "--attn-seq", "8", "--repeats", "1", "--warmup", "1",
                                "--compile-backend", "aot_eager", "--out", str(out)]) == 0
    finally:
        torch._dynamo.reset()
    rows = json.loads(out.read_text())["results"]
    assert {r["case"] for r in rows} == set(cpu_fusion.CASES)
    for r in rows:
        assert r["min_ms"] > 0 and r["ratio"] > 0
        if r["impl"] in ("moekit", "SDPA"):  # each case's base
            assert r["ratio"] == 1.0
        if r["max_err"] is not None:
            assert r["max_err"] < 1e-5, r
    with pytest.raises(SystemExit):
        cpu_fusion.main(["--tokens", "0"])
