"""Expert placement: any assignment of experts to EP ranks, with and without replicas, reproduces one process.

Cheapest first: the Placement type, the planner and the traffic model (no processes); then one spawn of 4
gloo ranks that runs every layout (flat and hierarchical dispatch, replicas, FSDP, a pipeline) against the
one-process reference and moves a checkpoint between placements and into one process; then the trainer
under torchrun: a placement file plus rebalancing every 2 steps follows the one-process curve, and a
resume after a rebalance is bitwise the uninterrupted run.
"""
from __future__ import annotations

import copy
import json
import os
import random
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from moekit.comm.placement import (Placement, default_placement, imbalance, load_placements, plan_placement,
                                   save_placements)
from moekit.train.planning import cost_model
from tests.dist_utils import run_ranks, run_trainer

ROOT = Path(__file__).resolve().parents[1]
H, FF = 8, 16


def random_placement(E: int, P: int, R: int, seed: int) -> Placement:
    """A random assignment of E experts plus R copies to P ranks (no rank holds an expert twice)."""
    rng = random.Random(seed)
    S = (E + R) // P
    while True:
        ids = list(range(E)) + [rng.randrange(E) for _ in range(R)]
        rng.shuffle(ids)
        rows = [ids[p * S:(p + 1) * S] for p in range(P)]
        if all(len(set(r)) == S for r in rows):
            return Placement(tuple(map(tuple, rows)), E)


# --------------------------------------------------------------------------------------------------
# No processes: the type, the planner, the traffic model, the command line
# --------------------------------------------------------------------------------------------------


def test_placement_type_and_file(tmp_path):
    p = Placement(((3, 0, 5), (1, 2, 0), (4, 5, 6), (7, 2, 1)), 8)  # 0, 1, 2 and 5 have two copies
    assert (p.ep, p.slots_per_rank, p.replicas, p.is_contiguous) == (4, 3, 4, False)
    assert p.copies()[0] == [1, 5] and p.primary_mask(1) == [True, True, False]
    assert Placement.contiguous(8, 4).is_contiguous and not default_placement(8, 4, 4).is_contiguous
    assert default_placement(8, 4, 4).slots[3] == (6, 7, 0)
    # tokens go to copies on their own node first (nodes of 2 ranks): expert 5 has copies on both nodes
    assert p.route_table(0, (0, 0, 1, 1))[5] == [2] and p.route_table(2, (0, 0, 1, 1))[5] == [7]
    assert p.route_table(0)[5] == [2, 7]
    np.testing.assert_allclose(p.route_matrix().sum(1), 1.0)
    with pytest.raises(ValueError, match=r"leaves experts \[7\] on no rank"):
        Placement(((0, 1), (2, 3), (4, 5), (6, 6)), 8)
    with pytest.raises(ValueError, match="same positive number of slots"):
        Placement(((0, 1, 2), (3,)), 4)
    save_placements(tmp_path / "p.json", {"layers.0.ffn": p, "layers.1.ffn": Placement.contiguous(8, 4)}, note="x")
    back, doc = load_placements(tmp_path / "p.json")
    assert back == {"layers.0.ffn": p, "layers.1.ffn": Placement.contiguous(8, 4)} and doc["note"] == "x"
    (tmp_path / "bad.json").write_text('{"format": "other"}')
    with pytest.raises(ValueError, match="not a 'moekit-expert-placement' document"):
        load_placements(tmp_path / "bad.json")


def skewed_load(steps=20, layers=2, E=16, seed=0) -> np.ndarray:
    """Zipf-like expert popularity, a different order per layer, noisy per step: [steps, L, E] token counts."""
    rng = np.random.default_rng(seed)
    base = 1.0 / np.arange(1, E + 1) ** 1.1
    out = np.zeros((steps, layers, E), dtype=np.int64)
    for layer in range(layers):
        share = base[rng.permutation(E)]
        out[:, layer] = rng.multinomial(4096, share / share.sum(), size=steps)
    return out


def test_planner_balances_skewed_load():
    load = skewed_load()
    E, P = load.shape[2], 4
    contiguous = imbalance(Placement.contiguous(E, P).rank_loads(load[:, 0])).mean()
    plain = plan_placement(load, P)
    replicated = plan_placement(load, P, replicas=4)
    assert len(plain) == 2 and all(p.slots_per_rank == 4 for p in plain)
    assert all(p.slots_per_rank == 5 and p.replicas == 4 for p in replicated)
    before, after, more = (float(imbalance(p.rank_loads(load[:, 0])).mean()) for p in
                           (Placement.contiguous(E, P), plain[0], replicated[0]))
    # without copies the hottest expert (1.32 x a rank's mean share) bounds the plan: it shares its rank with
    # the 3 coldest; with copies it is split and every rank is within a few percent of the mean
    assert before == contiguous and before > 1.8 and after < 1.53 and more < 1.05, (before, after, more)
    hottest = int(load[:, 0].sum(0).argmax())
    assert len(replicated[0].copies()[hottest]) > 1  # the hottest expert got a copy
    # two nodes of two ranks: an expert's copies are spread evenly over the nodes (tokens use the copies on
    # their own node), and the ranks stay balanced under that routing
    nodes = (0, 0, 1, 1)
    node_aware = plan_placement(load, P, ranks_per_node=2, replicas=4)[0]
    spread = [np.bincount([c // 10 for c in copies], minlength=2) for copies in node_aware.copies()]
    assert all(c.max() - c.min() <= 1 for c in spread) and max(c.max() for c in spread) == 2
    assert float(imbalance(node_aware.rank_loads(load[:, 0], nodes)).mean()) < 1.05
    # group-limited routing (4 groups over 2 nodes): whole groups stay on one node
    grouped = plan_placement(load, P, ranks_per_node=2, num_groups=4)[0]
    node_of = {e: p // 2 for p, row in enumerate(grouped.slots) for e in row}
    assert all(len({node_of[e] for e in range(g * 4, g * 4 + 4)}) == 1 for g in range(4))
    with pytest.raises(ValueError, match="multiple of ep=4"):
        plan_placement(load, P, replicas=2)
    with pytest.raises(ValueError, match="not divisible by ep=3"):
        plan_placement(load, 3)


def test_traffic_model_reduces_to_the_cost_model():
    """Uniform shares and contiguous blocks: the load-weighted model is cost_model's, exactly."""
    from moekit.train.placement import expected_rows

    for nodes, per_node, E, k in [(2, 4, 32, 4), (4, 2, 16, 3), (2, 2, 8, 2)]:
        flat, hier = expected_rows(Placement.contiguous(E, nodes * per_node), np.ones(E), k, per_node)
        want_flat, want_hier = cost_model.flat(nodes, per_node, E, k), cost_model.hierarchical(nodes, per_node, E, k)
        assert flat.inter_rows == pytest.approx(want_flat.inter_rows) and flat.intra_rows == pytest.approx(want_flat.intra_rows)
        assert hier.inter_rows == pytest.approx(want_hier.inter_rows)
        assert hier.intra_rows == pytest.approx(want_hier.intra_rows)


def synthetic_run(run_dir: Path, load: np.ndarray, top_k: int = 1) -> None:
    """A run directory with config.json and an expert-load record (the format read_expert_load reads)."""
    from moekit.train import records

    run_dir.mkdir(parents=True)
    (run_dir / records.CONFIG).write_text(json.dumps({"model": {"hidden_size": 64, "router_options": {}}}))
    names = [f"layers.{i}.ffn" for i in range(load.shape[1])]
    w = records.JsonlWriter(run_dir / records.EXPERT_LOAD)
    w.write({"format": records.LOAD_FORMAT, "version": records.LOAD_VERSION, "router": "switch", "top_k": top_k,
             "num_experts": load.shape[2], "layers": names})
    for step, counts in enumerate(load, 1):
        w.write({"step": step, "tokens": counts.tolist(), "assigned": counts.tolist(), "dropped": [0] * len(names)})
    w.close()


def test_placement_cli(tmp_path, capsys):
    from moekit.train.placement import main

    synthetic_run(tmp_path / "run", skewed_load())
    out = tmp_path / "p.json"
    assert main([str(tmp_path / "run"), "--ep", "4", "--ranks-per-node", "2", "--replicas", "4", "--steps", "5:20",
                 "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "steps 5-20 (16 recorded)" in text and "hierarchical inter-node" in text
    placements, doc = load_placements(out)
    assert list(placements) == ["layers.0.ffn", "layers.1.ffn"] and doc["ep"] == 4 and doc["slots_per_rank"] == 5
    assert doc["predicted"]["imbalance_planned"] < doc["predicted"]["imbalance_contiguous"]
    assert main([str(tmp_path / "run"), "--ep", "3", "-o", str(out)]) == 2
    assert "not divisible by ep=3" in capsys.readouterr().err
    assert main([str(tmp_path / "run"), "--ep", "4", "--steps", "50:60", "-o", str(out)]) == 2
    assert "no expert-load records there" in capsys.readouterr().err


@pytest.mark.parametrize("flags,match", [
    (["--layout.expert_replicas", "2"], "needs --ep > 1"),
    (["--ep", "2", "--layout.expert_replicas", "3"], "must be a multiple of --ep 2"),
    (["--ep", "2", "--layout.expert_placement", "nope.json"], "no such file"),
    (["--ep", "2", "--layout.rebalance_every", "-1"], "rebalance_every=-1 is invalid"),
])
def test_placement_flags_are_checked(flags, match):
    from moekit.train import UserError
    from moekit.train.config import TrainConfig, set_value
    from moekit.train.validation import validate_placement

    cfg = TrainConfig()
    for flag, value in zip(flags[::2], flags[1::2]):
        set_value(cfg, "layout.ep" if flag == "--ep" else flag[2:], value)
    with pytest.raises(UserError, match=match):
        validate_placement(cfg)


# --------------------------------------------------------------------------------------------------
# 4 gloo ranks, one spawn: layers, a model under FSDP, a checkpoint, a pipeline
# --------------------------------------------------------------------------------------------------


def _slot_box(p) -> slice:
    """The dim-1 slice of the global expert tensor this rank holds (FSDP shards dim 1), as a slice."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return slice(offset[1], offset[1] + shape[1])


def check_expert_rows(layer, ref_layer, placement, values, where, **tol):
    """Every slot of this rank holds ``values(ref tensor)[its expert]`` (the dim-1 part it holds)."""
    pos = layer.dispatcher.ep_position
    for name in layer.experts.param_names():  # the weights, and the biases of an ffn_bias layer
        p, want = getattr(layer.experts, name), values(getattr(ref_layer.experts, name))
        got, box = values(p).to_local(), _slot_box(p)
        for s, e in enumerate(placement.slots[pos]):
            torch.testing.assert_close(got[s], want[e][box], msg=lambda m: f"{where} {name} slot {s} (e{e}): {m}", **tol)


def _layer_case(rank, dp, ep, per_node, hier, R, seed, bias=False):
    from moekit.comm.expert_parallel import apply_expert_parallel
    from moekit.comm.grad_sync import global_grad_norm, gradient_roles, sync_gradients
    from moekit.comm.relocate import tag_primaries
    from moekit.comm.topology import Layout, Topology
    from moekit.moe import MoELayer, build_router

    topo = Topology(Layout(dp=dp, ep=ep), rank, per_node).build()
    E, k, T = 8, 3, 6
    torch.manual_seed(seed)
    ref = MoELayer(H, FF, E, build_router("topk", H, E, top_k=k, aux_loss_coeff=0.1, z_loss_coeff=0.01,
                                          gate_bias=bias), backend="loop", ffn_bias=bias).double()
    if bias:  # gpt-oss's biases, non-zero: they must travel with their experts
        with torch.no_grad():
            for b in (ref.router.bias, ref.experts.b_in, ref.experts.b_out):
                b.copy_(torch.randn(b.shape, dtype=torch.float64))
    layer = copy.deepcopy(ref)
    placement = random_placement(E, ep, R, seed)
    apply_expert_parallel(layer, topo, hierarchical=hier, placements={"": placement})
    tag_primaries(layer)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(dp * T, H, generator=g, dtype=torch.float64)
    c = torch.randn(dp * T, H, generator=g, dtype=torch.float64)
    y_ref = ref(x)
    ((y_ref * c).sum() / (dp * T)).backward()
    mine = slice(rank * T, (rank + 1) * T)
    y = layer(x[mine])
    where = f"layer dp{dp} ep{ep} nodes of {per_node} {'hier' if hier else 'flat'} R={R}"
    torch.testing.assert_close(y, y_ref[mine].detach(), msg=lambda m: f"{where}: {m}")
    ((y * c[mine]).sum() / T).backward()
    sync_gradients(layer, topo, gradient_roles(layer))
    torch.testing.assert_close(layer.router.weight.grad, ref.router.weight.grad)
    check_expert_rows(layer, ref, placement, lambda t: t.grad, where)
    want = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()])
    got = global_grad_norm(list(layer.parameters()), torch.device("cpu"))
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=0, msg=lambda m: f"{where} norm: {m}")
    if bias:  # a rebalance moves every expert parameter, biases included, to the new slots
        from moekit.comm.relocate import rebalance

        other = random_placement(E, ep, R, seed + 100)
        rebalance(layer, None, {"": other})
        check_expert_rows(layer, ref, other, lambda t: t.detach(), f"{where} rebalanced")


def tiny_config(**over):
    from moekit.models.config import ModelConfig

    base = dict(name="placement-test", hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, max_seq_len=16,
                ffn_hidden_size=32, num_experts=8, moe_ffn_hidden_size=16, top_k=2, capacity_factor=None,
                aux_loss_coeff=0.05, z_loss_coeff=0.01, vocab_size=64, router_options={"normalize": True})
    base.update(over)
    return ModelConfig(**base)


def _lm_loss(model, tokens):
    return F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _state(model, opt):
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    from moekit.comm.relocate import logical_state

    weights, optim = get_model_state_dict(model), get_optimizer_state_dict(model, opt)
    logical_state(model, weights, optim)
    return {"model": weights, "optim": optim}


def _fsdp_case(rank, world, ckpt):
    """fsdp4 x ep2 (experts: EP shards of a random placement with 2 copies, FSDP-sharded over the 2 ranks
    holding the same experts): gradients and norm of one process, one AdamW step, a checkpoint in logical
    order; it loads under another placement (4 copies) with the same weights and moments."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    from moekit.comm.grad_sync import global_grad_norm, sync_gradients
    from moekit.comm.relocate import physical_state
    from moekit.comm.topology import Layout, Topology
    from moekit.models.parallelize import parallelize
    from moekit.models.transformer import build_model

    topo = Topology(Layout(fsdp=4, ep=2), rank, world).build()
    cfg = tiny_config()
    tokens = torch.randint(0, cfg.vocab_size, (8, 17), generator=torch.Generator().manual_seed(5))
    ref = build_model(cfg, seed=3)
    _lm_loss(ref, tokens).backward()
    placements = {f"layers.{i}.ffn": random_placement(8, 2, 2, 40 + i) for i in range(2)}
    model = build_model(cfg, seed=3)
    done = parallelize(model, topo, expert_placement=placements)
    _lm_loss(model, tokens.view(4, 2, 17)[topo.data_rank()]).backward()
    sync_gradients(model, topo, done.grad_roles, fsdp=True)
    refs = dict(ref.named_modules())
    for name, p in model.named_parameters():
        if ".experts." not in name:
            torch.testing.assert_close(_full(p.grad), dict(ref.named_parameters())[name].grad, rtol=1e-4, atol=1e-6)
    for name, placement in placements.items():
        check_expert_rows(dict(model.named_modules())[name], refs[name], placement, lambda t: t.grad,
                          f"fsdp {name}", rtol=1e-4, atol=1e-6)
    want = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()])
    torch.testing.assert_close(global_grad_norm(list(model.parameters()), torch.device("cpu")), want, rtol=1e-5, atol=0)
    opt, opt_ref = (torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=False) for m in (model, ref))
    opt.step(), opt_ref.step()
    for name, placement in placements.items():  # both copies took the same step
        check_expert_rows(dict(model.named_modules())[name], refs[name], placement, lambda t: t.detach(),
                          f"fsdp step {name}", rtol=1e-5, atol=5e-5)
    saved = _state(model, opt)
    dcp.save(saved, checkpoint_id=ckpt)
    if rank == 0:
        torch.save({"model": ref.state_dict(), "exp_avg": {n: opt_ref.state[p]["exp_avg"] for n, p in
                                                            ref.named_parameters()}}, f"{ckpt}.ref.pt")
    other = {name: random_placement(8, 2, 4, 60 + i) for i, name in enumerate(placements)}
    model2 = build_model(cfg, seed=99)  # another init: whatever matches came from the checkpoint
    parallelize(model2, topo, expert_placement=other)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2, foreach=False)
    template = _state(model2, opt2)
    dcp.load(template, checkpoint_id=ckpt)
    physical_state(model2, template["model"], template["optim"])
    set_model_state_dict(model2, template["model"])
    set_optimizer_state_dict(model2, opt2, template["optim"])
    again = _state(model2, opt2)  # logical again: bitwise what was saved
    for key in saved["model"]:
        assert torch.equal(_full(again["model"][key]), _full(saved["model"][key])), key
    for key, state in saved["optim"]["state"].items():
        for k, v in state.items():
            assert torch.equal(_full(again["optim"]["state"][key][k]), _full(v)), (key, k)
    for name, placement in other.items():
        check_expert_rows(dict(model2.named_modules())[name], refs[name], placement, lambda t: t.detach(),
                          f"loaded {name}", rtol=1e-5, atol=5e-5)


def _pipeline_case(rank, world):
    """pp2 x dp2, ep2 inside each stage with 2 copies per layer (1F1B, 2 micro-batches): losses and
    gradients of one process."""
    from moekit.comm.expert_parallel import apply_expert_parallel
    from moekit.comm.grad_sync import gradient_roles, sync_gradients
    from moekit.comm.relocate import tag_primaries
    from moekit.comm.topology import Layout, Topology
    from moekit.models.pipeline import build_pipeline, lm_loss
    from moekit.models.transformer import build_model
    from moekit.moe.layer import set_aux_loss_scale

    topo = Topology(Layout(pp=2, dp=2, ep=2), rank, world).build()
    cfg, M = tiny_config(num_layers=4), 2
    ref = build_model(cfg, seed=7)
    pipe = build_pipeline(build_model(cfg, seed=7), topo, "1f1b", 1, seq_len=16)
    placements = {f"layers.{i}.ffn": random_placement(8, 2, 2, 80 + i) for i in range(4)}
    apply_expert_parallel(pipe.model, topo, placements=placements)
    tag_primaries(pipe.model)
    for m in (ref, pipe.model):
        set_aux_loss_scale(m, microbatches=M)
    seqs = torch.randint(0, cfg.vocab_size, (8, 17), generator=torch.Generator().manual_seed(1))
    x, y = seqs[:, :-1], seqs[:, 1:]
    for m in range(M):  # global micro-batch m = each data rank's m-th pair of sequences
        rows = [r * 4 + m * 2 + i for r in range(2) for i in range(2)]
        (lm_loss(ref(x[rows]), y[rows]) / M).backward()
    d = topo.data_rank()
    pipe.step(x[d * 4:(d + 1) * 4], y[d * 4:(d + 1) * 4], M)
    sync_gradients(pipe.model, topo, gradient_roles(pipe.model))
    ref_params, refs = dict(ref.named_parameters()), dict(ref.named_modules())
    for name, p in pipe.model.named_parameters():
        if ".experts." not in name:
            torch.testing.assert_close(_full(p.grad), ref_params[name].grad, rtol=1e-4, atol=1e-6,
                                       msg=lambda msg: f"pp {name}: {msg}")
    for name, layer in dict(pipe.model.named_modules()).items():
        if name in placements:
            check_expert_rows(layer, refs[name], placements[name], lambda t: t.grad, f"pp {name}", rtol=1e-4, atol=1e-6)


LAYER_CASES = [  # (dp, ep, ranks per node, hierarchical, replicas, seed)
    (4, 4, 4, False, 0, 1), (4, 4, 4, False, 4, 2), (4, 4, 2, True, 0, 3), (4, 4, 2, True, 8, 4), (4, 2, 4, False, 2, 5),
    (4, 2, 4, False, 2, 6, True),  # + expert and router biases (ffn_bias, gate_bias), then a rebalance
]


def _all_cases(rank, world, ckpt):
    for case in LAYER_CASES:
        _layer_case(rank, *case)
    _fsdp_case(rank, world, ckpt)
    _pipeline_case(rank, world)


def test_placements_match_one_process_and_checkpoints_stay_logical(tmp_path):
    """Random placements (flat, hierarchical over 2 simulated nodes, with copies, two EP groups) give the
    one-process outputs, gradients and gradient norm; FSDP and a pipeline too; the FSDP run's checkpoint
    loads under another placement bitwise and here in one process."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    from moekit.models.transformer import build_model

    ckpt = str(tmp_path / "ckpt")
    run_ranks(_all_cases, 4, ckpt)
    ref = torch.load(f"{ckpt}.ref.pt")
    single = build_model(tiny_config(), seed=99)
    opt = torch.optim.AdamW(single.parameters(), lr=1e-2, foreach=False)
    state = {"model": get_model_state_dict(single), "optim": get_optimizer_state_dict(single, opt)}
    dcp.load(state, checkpoint_id=ckpt, no_dist=True)
    for name, value in ref["model"].items():
        # one AdamW step of about lr = 1e-2 per weight: rounding in tiny gradients moves a few by ~1e-5
        torch.testing.assert_close(state["model"][name], value, rtol=1e-5, atol=5e-5, msg=lambda m: f"{name}: {m}")
        torch.testing.assert_close(state["optim"]["state"][name]["exp_avg"], ref["exp_avg"][name], rtol=1e-4,
                                   atol=1e-7, msg=lambda m: f"{name} exp_avg: {m}")


# --------------------------------------------------------------------------------------------------
# The trainer under torchrun
# --------------------------------------------------------------------------------------------------

TINY = ["--model.hidden_size", "32", "--model.num_layers", "2", "--train.seq_len", "32", "--batch-size", "8",
        "--eval.every", "0", "--eval.sequences", "8", "--log.every", "1", "--log.progress", "off",
        "--log.tensorboard", "false", "--steps", "4"]


def train(args, nproc: int) -> subprocess.CompletedProcess:
    """tools/train.py with TINY on ``nproc`` ranks forked as torchrun starts them (tests.dist_utils.run_trainer)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    env.pop("WORLD_SIZE", None)
    return run_trainer([*TINY, *args], nproc, env=env, timeout=300)


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


EMA = ["--train.ema_decay", "0.5"]  # a parameter average (moekit.train.ema): it must move with its expert


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> list[dict]:
    """The one-process metrics of the TINY run with a parameter average (the reference of the flat and FSDP
    trainer runs): the losses, and val_loss_ema after the last step."""
    run_dir = tmp_path_factory.mktemp("single")
    r = train(["--run-dir", str(run_dir), "--checkpoint.every", "0", *EMA], nproc=1)
    assert r.returncode == 0, r.stderr[-3000:]
    return metrics(run_dir)


def losses(rows: list[dict]) -> list[float]:
    return [m["loss"] for m in rows]


def test_trainer_placement_file_and_rebalance_resume_bitwise(tmp_path, single):
    """ep2 from a moekit-placement file (2 copies), re-planned and moved every 2 steps: the one-process
    losses, and the parameter average's loss (its rows moved with the experts'); the step-2 checkpoint (saved
    right after a rebalance) resumes bitwise, the average included."""
    from moekit.train.placement import main as plan_main

    synthetic_run(tmp_path / "recorded", skewed_load(steps=4, layers=2, E=8), top_k=2)
    placement = tmp_path / "placement.json"
    assert plan_main([str(tmp_path / "recorded"), "--ep", "2", "--replicas", "2", "-o", str(placement)]) == 0
    run_a, run_b = tmp_path / "a", tmp_path / "b"
    flags = ["--ep", "2", "--layout.expert_placement", str(placement), "--layout.rebalance_every", "2", *EMA]
    r = train(["--run-dir", str(run_a), "--checkpoint.every", "2", *flags], nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "expert placement: 5 expert slots per rank (2 redundant), rebalanced every 2 steps" in r.stdout
    assert r.stdout.count("rebalanced the experts") == 2
    meta = json.loads((run_a / "checkpoints" / "step_000002" / "meta.json").read_text())
    assert meta["placement"]["slots_per_rank"] == 5 and sum(map(sum, meta["placement"]["rebalance_window"].values())) == 0
    got = metrics(run_a)
    assert losses(got) == pytest.approx(losses(single), rel=1e-5, abs=1e-6)
    assert got[-1]["val_loss_ema"] == pytest.approx(single[-1]["val_loss_ema"], rel=1e-5)
    r = train(["--run-dir", str(run_b), "--resume", str(run_a / "checkpoints" / "step_000002"), "--checkpoint.every",
               "0", "--export-hf", str(tmp_path / "hf-placed"), "--train.export_hf_ema", "true", *flags], nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    same = ("loss", "grad_norm", "aux_loss", "imbalance")
    assert [{k: m[k] for k in same} for m in metrics(run_b)] == [{k: m[k] for k in same} for m in got[2:]]
    assert metrics(run_b)[-1]["val_loss_ema"] == got[-1]["val_loss_ema"]
    exported_ema = "): the parameter EMA" in r.stdout
    assert r.stdout.count("rebalanced the experts") == 1
    # --export-hf under the placement (2 replicas) of the parameter average (--train.export_hf_ema): each expert
    # written once, from one of its slots; the same folder as one process exporting the final checkpoint's average,
    # which holds the experts in logical order
    from safetensors.torch import load_file

    r = train(["--run-dir", str(tmp_path / "c"), "--resume", str(run_b / "checkpoints" / "step_000004"),
               "--export-hf", str(tmp_path / "hf-one"), *EMA, "--train.export_hf_ema", "true"], nproc=1)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "): the parameter EMA" in r.stdout and exported_ema  # both folders hold the average, not the weights
    placed, one = ({k: v for p in (tmp_path / f).glob("*.safetensors") for k, v in load_file(p).items()}
                   for f in ("hf-placed", "hf-one"))
    assert sorted(placed) == sorted(one) and "model.layers.1.block_sparse_moe.experts.7.w2.weight" in one
    assert all(torch.equal(placed[k], one[k]) for k in one)


def test_trainer_rebalances_under_fsdp_hierarchical_and_pipeline(tmp_path, single):
    """4 ranks, rebalancing every 2 steps with 4 copies: dp2 x fsdp2 with ep4 over 2 simulated nodes
    (hierarchical dispatch) follows the one-process curve; so does pp2 x dp2 with ep2 inside each stage
    (aux loss off and 2-sequence micro-batches, as tests/test_train_distributed.py compares pipelines), its
    --export-hf equals one process's export of its final checkpoint, and --init-from-hf of that folder into the
    same layout starts at one process's loss."""
    r = train(["--run-dir", str(tmp_path / "fsdp"), "--checkpoint.every", "0", "--dp", "2", "--fsdp", "2", "--ep", "4",
               "--ranks-per-node", "2", "--layout.hierarchical", "on", "--layout.expert_replicas", "4",
               "--layout.rebalance_every", "2", *EMA], nproc=4)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("rebalanced the experts") == 2 and "3 expert slots per rank (4 redundant)" in r.stdout
    fsdp = metrics(tmp_path / "fsdp")
    assert losses(fsdp) == pytest.approx(losses(single), rel=1e-5, abs=1e-6)
    assert fsdp[-1]["val_loss_ema"] == pytest.approx(single[-1]["val_loss_ema"], rel=1e-5)
    for a, b in zip(fsdp, single):  # replicated experts count once in their part, as in the total
        assert a["grad_norm_by_part"] == pytest.approx(b["grad_norm_by_part"], rel=1e-5, abs=1e-6)
    micro = ["--checkpoint.every", "0", "--model.aux_loss_coeff", "0", "--train.micro_batch_size", "2"]
    r = train(["--run-dir", str(tmp_path / "micro"), *micro], nproc=1)
    assert r.returncode == 0, r.stderr[-3000:]
    r = train(["--run-dir", str(tmp_path / "pp"), *micro, "--pp", "2", "--ep", "2", "--layout.expert_replicas", "2",
               "--layout.rebalance_every", "2", "--export-hf", str(tmp_path / "hf-pp")], nproc=4)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("rebalanced the experts") == 2
    want = [m["loss"] for m in metrics(tmp_path / "micro")]
    assert [m["loss"] for m in metrics(tmp_path / "pp")] == pytest.approx(want, rel=1e-5, abs=1e-6)
    # each pipeline rank exported its stages' placed slots: one process's export of the final checkpoint
    from safetensors.torch import load_file

    r = train(["--run-dir", str(tmp_path / "one"), *micro, "--resume", str(tmp_path / "pp" / "checkpoints" /
               "step_000004"), "--export-hf", str(tmp_path / "hf-one")], nproc=1)
    assert r.returncode == 0, r.stderr[-3000:]
    piped, one = ({k: v for p in (tmp_path / f).glob("*.safetensors") for k, v in load_file(p).items()}
                  for f in ("hf-pp", "hf-one"))
    assert sorted(piped) == sorted(one) and all(torch.equal(piped[k], one[k]) for k in one)
    # and that folder imports into the same pipeline and placement by slices: one process's first loss
    first = []
    for name, layout, n in (("import-pp", ["--pp", "2", "--ep", "2", "--layout.expert_replicas", "2"], 4),
                            ("import-one", [], 1)):
        r = train(["--run-dir", str(tmp_path / name), *micro, *layout, "--init-from-hf", str(tmp_path / "hf-one"),
                   "--steps", "1"], nproc=n)
        assert r.returncode == 0, r.stderr[-3000:]
        first.append(metrics(tmp_path / name)[0]["loss"])
    assert first[0] == pytest.approx(first[1], rel=1e-5)


def test_placement_cli_refuses_bad_flags_and_files_before_planning(tmp_path, capsys):
    from moekit.train.placement import main

    synthetic_run(tmp_path / "run", skewed_load())
    run = str(tmp_path / "run")
    out = tmp_path / "p.json"
    assert main([run, "--ep", "4", "-o", str(out)]) == 0
    capsys.readouterr()
    doc = json.loads(out.read_text())
    wrong_ep, not_ints = tmp_path / "ep.json", tmp_path / "ints.json"
    wrong_ep.write_text(json.dumps({**doc, "ep": 2}))
    first = next(iter(doc["layers"]))
    not_ints.write_text(json.dumps({**doc, "layers": {**doc["layers"], first: [["a"]] + doc["layers"][first][1:]}}))
    (tmp_path / "f").write_text("x")
    for argv, expected in (([run, "--ep", "0"], "--ep 0 is invalid; it must be a positive integer"),
                           ([run, "--ep", "4", "--bytes-per-elem", "-1"], "--bytes-per-elem -1 is invalid"),
                           ([run, "--ep", "4", "--replicas", "-4"], "--replicas -4 is invalid"),
                           ([run, "--ep", "4", "-o", str(tmp_path)], "-o/--out"),
                           ([run, "--ep", "4", "-o", str(tmp_path / "f" / "p.json")], "-o/--out"),
                           ([run, "--check", str(wrong_ep)], "says ep=2 but its layers place the experts on [4] ranks"),
                           ([run, "--check", str(not_ints)], "malformed (ValueError: invalid literal")):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and expected in err[0], (argv, err)
