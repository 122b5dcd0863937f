"""train.muon (--train.optimizer muon): the Newton-Schulz orthogonalisation against the SVD, one step against the
update written out matrix by matrix (gated expert stacks as gate and up, per expert) and AdamW's for the rest, the
parameter split, its state bytes against the planner, and runs: it learns, resumes bitwise, ep2, fsdp2 x ep2, tp2
and pp2 follow one process, and bad settings are refused."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from moekit.models.config import preset
from moekit.models.transformer import build_model
from moekit.train.muon import Muon, muon_param_groups, orthogonalize
from tests.dist_utils import run_ranks
from tests.test_train_distributed import TINY, losses, run


def tiny(name: str, **over):
    return dataclasses.replace(preset(name), num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8,
                               ffn_hidden_size=48, moe_ffn_hidden_size=16, **over)


@pytest.mark.parametrize("shape", [(24, 16), (16, 24), (3, 20, 12)])
def test_orthogonalize_is_near_the_svds_orthogonal_factor(shape):
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    o = orthogonalize(g)
    assert o.shape == g.shape and o.dtype == torch.float32
    u, s, vh = torch.linalg.svd(g.double(), full_matrices=False)
    sv = torch.linalg.svdvals(o.double())
    assert sv.min() > 0.5 and sv.max() < 1.3, sv  # the quintic's band around 1, not exactly 1
    # the same singular vectors: O = U diag(f(s)) V^T with f(s) in the band, so O V = U diag(f(s))
    proj = (u.mT @ o.double() @ vh.mT)  # diag(f(s)), up to the iteration's off-diagonal residue
    diag = torch.diagonal(proj, dim1=-2, dim2=-1)
    assert (proj - torch.diag_embed(diag)).abs().max() < 0.05 and diag.min() > 0.5


def test_large_batches_run_in_slices_with_the_same_result(monkeypatch):
    from moekit.train import muon

    g = torch.randn(5, 12, 8, generator=torch.Generator().manual_seed(3))
    whole = orthogonalize(g)
    monkeypatch.setattr(muon, "BATCH_ELEMENTS", 2 * 12 * 8)  # slices of 2 matrices: 2, 2, 1
    torch.testing.assert_close(orthogonalize(g), whole, rtol=1e-6, atol=1e-7)


def test_parameter_split():
    """Matrices (attention, router, experts, shared expert) to Muon, a gated stack as 2 chunks; the embedding,
    head, norms and biases (gpt-oss's expert, gate and attention biases, its sinks) to AdamW."""
    model = build_model(tiny("gpt-oss-tiny"), seed=0)
    groups = muon_param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    muon = {names[id(p)]: c for p, c in zip(groups[0]["params"], groups[0]["chunks"])}
    adamw = {names[id(p)] for g in groups[1:] for p in g["params"]}
    assert muon["layers.0.ffn.experts.w_in"] == 2 and muon["layers.0.ffn.experts.w_out"] == 1
    assert {"layers.0.attn.wq.weight", "layers.0.ffn.router.weight"} <= set(muon)
    assert {"embed.weight", "lm_head.weight", "layers.0.ffn.experts.b_in", "layers.0.attn.sinks",
            "layers.0.attn.wq.bias", "layers.0.ffn.router.bias", "norm.weight"} <= adamw
    assert not set(muon) & adamw and len(muon) + len(adamw) == len(list(model.parameters()))
    assert [g["weight_decay"] for g in groups] == [0.1, 0.1, 0.0]


def test_one_step_is_the_update_written_out():
    torch.manual_seed(1)
    model = build_model(tiny("deepseek-tiny"), seed=1)
    tokens = torch.randint(0, model.config.vocab_size, (2, 12))
    model(tokens, targets=tokens).backward()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    lr, wd, mu = 0.01, 0.1, 0.95
    opt = Muon(muon_param_groups(model, wd), lr=lr, momentum=mu)
    opt.step()
    after = dict(model.named_parameters())

    def muon_ref(w, g, chunks):  # first step: buffer = g, Nesterov u = g + mu * g; each matrix on its own
        u = g * (1 + mu)
        mats = [x for x in u.chunk(chunks, -1)]
        upd = []
        for m in mats:
            per = m if m.dim() == 2 else None
            upd.append(orthogonalize(per) if per is not None else torch.stack([orthogonalize(e) for e in m]))
        o = torch.cat(upd, -1)
        rows, cols = mats[0].shape[-2:]
        return w * (1 - lr * wd) - lr * 0.2 * math.sqrt(max(rows, cols)) * o

    w_in = "layers.1.ffn.experts.w_in"  # a gated stack [E, H, 2F]: gate and up per expert
    torch.testing.assert_close(after[w_in], muon_ref(before[w_in], grads[w_in], 2), rtol=1e-5, atol=1e-6)
    wq = "layers.0.attn.wq.weight"
    torch.testing.assert_close(after[wq], muon_ref(before[wq], grads[wq], 1), rtol=1e-5, atol=1e-6)
    # AdamW's first step: the update is lr * g / (|g| + eps) after the decay (norms: no decay)
    for name, decay in (("embed.weight", wd), ("norm.weight", 0.0)):
        g = grads[name]
        want = before[name] * (1 - lr * decay) - lr * g / (g.abs() + 1e-8)
        torch.testing.assert_close(after[name], want, rtol=1e-5, atol=1e-6)


# (mesh, placements, shape, chunks, dtype, owners: the ranks that orthogonalise it when spread) on 4 ranks:
# a 1-D "fsdp" mesh of 4, or a 2-D ("ep", "edp") mesh of 2 x 2
SPREAD_CASES = [
    ("flat", ("S0",), (10, 6), 1, torch.float32, 1),  # rows 3 3 3 1
    ("flat", ("S1",), (6, 10), 1, torch.float32, 1),  # TP row-wise: columns cut
    ("flat", ("S0",), (5, 7), 1, torch.float32, 1),  # rows 2 2 1 0: one rank holds nothing
    ("flat", ("S1",), (3, 6, 8), 2, torch.float32, 1),  # a gated expert stack, H cut (FSDP on dim 1)
    ("flat", ("S0",), (8, 4), 1, torch.bfloat16, 1),  # sent as float32 over gloo
    ("flat", ("R",), (4, 4), 1, torch.float32, 4),  # whole on every rank: orthogonalised where it is
    ("grid", ("S0", "S1"), (4, 6, 4), 1, torch.float32, 2),  # experts kept on their ep rank, H cut over edp
    ("grid", ("S0", "S1"), (6, 8), 1, torch.float32, 4),  # cut twice (FSDP x TP): the all-gather path
    ("grid", ("R", "S0"), (7, 5), 1, torch.float32, 2),  # HSDP: replicated over "ep", cut over "edp"
]


def _spread_ranks(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import moekit.train.muon as muon_mod

    meshes = {"flat": init_device_mesh("cpu", (4,), mesh_dim_names=("fsdp",)),
              "grid": init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "edp"))}
    place = {"S0": Shard(0), "S1": Shard(1), "R": Replicate()}
    gen = torch.Generator().manual_seed(7)  # the same values on every rank
    full = [(torch.randn(shape, generator=gen).to(dtype), [torch.randn(shape, generator=gen).to(dtype)
             for _ in range(2)]) for _, _, shape, _, dtype, _ in SPREAD_CASES]
    counted = []
    real = muon_mod.orthogonalize
    muon_mod.orthogonalize = lambda g, *a, **k: counted.append(g.shape) or real(g, *a, **k)
    results = {}
    for spread in (True, False):
        params = [torch.nn.Parameter(distribute_tensor(w.clone(), meshes[m], [place[x] for x in pl]))
                  for (m, pl, *_), (w, _) in zip(SPREAD_CASES, full)]
        opt = Muon([{"params": params, "kind": "muon", "chunks": [c[3] for c in SPREAD_CASES],
                     "weight_decay": 0.1}], lr=0.02, spread=spread)
        counted.clear()
        for step in range(2):
            for p, (_, grads) in zip(params, full):
                p.grad = distribute_tensor(grads[step].clone(), p.device_mesh, p.placements)
            opt.step()
        results[spread] = ([p.full_tensor() for p in params], list(counted))
    muon_mod.orthogonalize = real
    (spread_w, spread_calls), (gather_w, gather_calls) = results[True], results[False]
    for i, (a, b) in enumerate(zip(spread_w, gather_w)):
        assert torch.equal(a, b), f"case {i} {SPREAD_CASES[i][:3]}: spread differs from all-gather"
    # one process, whole tensors
    ref = [torch.nn.Parameter(w.clone()) for w, _ in full]
    opt = Muon([{"params": ref, "kind": "muon", "chunks": [c[3] for c in SPREAD_CASES], "weight_decay": 0.1}],
               lr=0.02)
    for step in range(2):
        for p, (_, grads) in zip(ref, full):
            p.grad = grads[step].clone()
        opt.step()
    for i, (a, b) in enumerate(zip(spread_w, ref)):
        torch.testing.assert_close(a, b.detach(), rtol=1e-6, atol=1e-6, msg=lambda m: f"case {i}: {m}")
    # the work: each cut matrix orthogonalised by one rank of its group, not by all of them
    counts = torch.tensor([len(spread_calls), len(gather_calls)], dtype=torch.float64)
    torch.distributed.all_reduce(counts)
    spread_calls = sum(chunks * owners for *_, chunks, _, owners in SPREAD_CASES)  # per step, all ranks
    gather_calls = sum(4 * chunks for *_, chunks, _, _ in SPREAD_CASES)
    assert counts.tolist() == [2 * spread_calls, 2 * gather_calls], counts


def test_spread_orthogonalisation_equals_the_all_gather_and_one_process():
    """Muon over a 4-rank mesh (gloo): matrices cut over FSDP / TP ranks (uneven and empty shards, a gated stack,
    bf16, experts kept on their ep rank) are orthogonalised once per group, by the rank that gathered them
    (all-to-all there and back), and the weights after two steps equal the all-gather path's bit for bit and one
    process's on whole tensors; whole and twice-cut matrices keep the all-gather path."""
    run_ranks(_spread_ranks, 4)


@pytest.mark.parametrize("name", ["deepseek-tiny", "gpt-oss-tiny"])
def test_state_bytes_are_what_the_planner_counts(name):
    from moekit.comm.topology import Layout
    from moekit.train.planning.dryrun import optimizer_state_bytes
    from moekit.train.planning.memory import Workload, estimate_memory

    cfg = tiny(name)
    model = build_model(cfg, seed=0)
    tokens = torch.randint(0, cfg.vocab_size, (2, 8))
    model(tokens, targets=tokens).backward()
    opt = Muon(muon_param_groups(model, 0.1), lr=1e-3)
    opt.step()
    measured = sum(t.numel() * t.element_size() for st in opt.state.values() for t in st.values())
    assert optimizer_state_bytes(model, "muon") == ("Muon", measured)
    est = estimate_memory(cfg, Layout(), Workload(2, 8, "float32", device="cpu", optimizer="muon"))
    assert est.optimizer == measured
    adamw = estimate_memory(cfg, Layout(), Workload(2, 8, "float32", device="cpu"))
    matrices = opt.param_groups[0]["params"]  # what Muon saves: their second moment and step scalar
    assert adamw.optimizer - measured == sum(4 * p.numel() + 4 for p in matrices)


MUON = ["--train.optimizer", "muon", "--checkpoint.every", "2", *TINY]


@pytest.fixture(scope="module")
def single_muon(tmp_path_factory):
    d = tmp_path_factory.mktemp("single_muon")
    r = run(["--preset", "deepseek-tiny", "--steps", "4", "--run-dir", str(d), *MUON])
    assert r.returncode == 0, r.stderr[-3000:]
    return d


def test_muon_learns_and_resumes_bitwise(tmp_path, single_muon):
    curve = losses(single_muon)
    assert curve[-1] < curve[0]
    resumed = tmp_path / "resumed"
    r = run(["--preset", "deepseek-tiny", "--steps", "4", "--run-dir", str(resumed), *MUON, "--resume",
             str(single_muon / "checkpoints" / "step_000002")])
    assert r.returncode == 0, r.stderr[-3000:]
    assert losses(resumed) == curve[2:]
    r = run(["--preset", "deepseek-tiny", "--steps", "4", "--run-dir", str(tmp_path / "adamw"), *TINY, "--resume",
             str(single_muon / "checkpoints" / "step_000002")])  # the checkpoint's state is Muon's
    assert r.returncode == 2 and "train.optimizer" in r.stderr and "Muon's momentum" in r.stderr, r.stderr[-2000:]


@pytest.mark.parametrize("layout", [["--ep", "2"], ["--fsdp", "2", "--ep", "2"], ["--tp", "2"],
                                    ["--ep", "2", "--layout.expert_replicas", "2", "--layout.rebalance_every", "2"]],
                         ids=["ep2", "fsdp2-ep2", "tp2", "ep2-replicas-rebalanced"])
def test_parallel_muon_follows_one_process(tmp_path, single_muon, layout):
    """ep2 (dp2 folded): each rank orthogonalises its own experts' matrices. fsdp2 x ep2 and tp2 cut matrices:
    their momentum is gathered along the cut dims, orthogonalised whole, and each rank keeps its shard (an
    orthogonalised shard would not be the whole matrix's rows: the curve would leave one process's). With 2
    redundant expert copies moved every 2 steps, the momentum buffers move with their experts."""
    r = run(["--preset", "deepseek-tiny", "--steps", "4", "--run-dir", str(tmp_path), *MUON, *layout], nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    assert losses(tmp_path) == pytest.approx(losses(single_muon), rel=1e-5, abs=1e-6)
    if "--layout.rebalance_every" in layout:
        assert r.stdout.count("rebalanced the experts") == 2, r.stdout[-2000:]


def test_pipeline_muon_follows_one_process(tmp_path):
    """pp2: each stage's optimizer holds its own layers (the gated expert stacks still split into gate and up)."""
    args = ["--preset", "deepseek-tiny", "--steps", "3", *MUON, "--train.micro_batch_size", "2"]
    r = run([*args, "--run-dir", str(tmp_path / "one")])
    assert r.returncode == 0, r.stderr[-3000:]
    r = run([*args, "--run-dir", str(tmp_path / "pp2"), "--pp", "2"], nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    assert losses(tmp_path / "pp2") == pytest.approx(losses(tmp_path / "one"), rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("args,match", [
    (["--train.muon_momentum", "1.0"], "--train.muon_momentum=1.0 is invalid; it must be in [0, 1)"),
    (["--train.muon_momentum", "-0.5"], "--train.muon_momentum=-0.5 is invalid"),
])
def test_bad_muon_settings_are_refused(tmp_path, capsys, args, match):
    from tests.test_bad_inputs import refused

    refused(capsys, tmp_path / "r", ["--train.optimizer", "muon", *args], match)


def test_unknown_optimizer_is_named(tmp_path, capsys):
    from tests.test_bad_inputs import refused

    refused(capsys, tmp_path / "r", ["--train.optimizer", "sgd"], "--train.optimizer='sgd' is invalid; choose one of")
