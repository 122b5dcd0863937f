"""moekit.train.plan.resolve_layout: the one resolution of degrees and batch split (no processes needed).

The real run, ``--dry-run`` and the command line's checks all call it, so one table of cases covers them.
"""
from __future__ import annotations

import dataclasses

import pytest

from moekit.comm.topology import Layout, LayoutError
from moekit.models.config import preset
from moekit.train import UserError
from moekit.train.cli import parse_args
from moekit.train.config import LayoutSection, TrainSection, new_config
from moekit.train.plan import ResolvedLayout, plan_run, resolve_config, resolve_layout
from moekit.train.planning.dryrun import plan_dry_run

MIXTRAL = preset("mixtral-tiny")  # 4 heads, 2 kv heads, 4 layers, 8 experts


def resolve(world: int, model=MIXTRAL, batch: int = 16, micro: int = 0, seq_len: int = 64, **layout) -> ResolvedLayout:
    return resolve_layout(LayoutSection(**layout), world, model, TrainSection(batch_size=batch, micro_batch_size=micro,
                                                                                 seq_len=seq_len))


# ---------------------------------------------------------------------------------------------------
# Valid layouts: degrees, dp inference, the batch split
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("world,layout,degrees", [
    (1, {}, Layout()),
    (4, {}, Layout(dp=4)),  # dp = 0: inferred from the world size
    (8, dict(tp=2, ep=2), Layout(dp=4, tp=2, ep=2)),
    (8, dict(fsdp=2, ep=4), Layout(dp=4, fsdp=2, ep=4)),
    (8, dict(pp=2, fsdp=2), Layout(pp=2, dp=2, fsdp=2)),
    (4, dict(dp=2, fsdp=2, ep=4), Layout(dp=2, fsdp=2, ep=4)),  # explicit dp is kept
])
def test_degrees_and_dp_inference(world, layout, degrees):
    r = resolve(world, **layout)
    assert r.layout == degrees and r.world_size == world
    assert r.data_parallel == degrees.dp * degrees.fsdp


@pytest.mark.parametrize("world,micro,layout,split", [
    (1, 0, {}, (16, 16, 1)),  # (per_rank, micro_batch, accum): no accumulation by default
    (1, 4, {}, (16, 4, 4)),
    (4, 2, {}, (4, 2, 2)),
    (8, 0, dict(tp=2), (4, 4, 1)),  # TP ranks share their data rank's sequences
    (2, 0, dict(pp=2), (16, 4, 4)),  # pipeline: 2 * pp micro-batches by default
    (2, 0, dict(pp=2, pp_microbatches=8), (16, 2, 8)),
    (2, 8, dict(pp=2), (16, 8, 2)),  # the micro-batch size implies the pipeline's count
    (4, 0, dict(pp=2, pp_schedule="gpipe", pp_microbatches=1), (8, 8, 1)),
])
def test_batch_split(world, micro, layout, split):
    r = resolve(world, micro=micro, **layout)
    assert (r.per_rank, r.micro_batch, r.accum) == split
    assert r.per_rank * r.data_parallel == 16 and r.micro_batch * r.accum == r.per_rank


def test_a_tied_head_resolves_under_a_pipeline():  # the last stage keeps a replica of the embedding (models.pipeline)
    assert resolve(2, model=dataclasses.replace(MIXTRAL, tie_embeddings=True), pp=2).layout.pp == 2


def test_knobs():
    assert resolve(1).hierarchical is None and resolve(1).ranks_per_node == 0
    assert resolve(8, hierarchical="on", ranks_per_node=4).hierarchical is True
    assert resolve(8, hierarchical="off", ranks_per_node=4).ranks_per_node == 4


# ---------------------------------------------------------------------------------------------------
# Every refusal: LayoutError, one line naming the value and the fix
# ---------------------------------------------------------------------------------------------------

REFUSED = [
    (dict(world=1, dp=2), "layout --dp 2 --ep 1 --tp 1 --pp 1 --fsdp 1 needs dp*fsdp*tp*pp = 2 processes but the "
                          "world size is 1"),
    (dict(world=512, dp=100), "world size is 512"),
    (dict(world=6, tp=4), "world size 6 is not divisible by pp*fsdp*tp = 1*1*4 = 4"),
    (dict(world=1, ep=2), "layout --dp 1 --ep 2"),
    (dict(world=4, ep=3), "ep=3 must divide the data-parallel size dp*fsdp = 4"),
    (dict(world=6, ep=3), "num_experts=8 is not divisible by ep=3; choose --ep among [1, 2, 4, 8]"),
    (dict(world=1, tp=0), "--tp=0 is invalid"),
    (dict(world=1, dp=-1), "--dp=-1 is invalid"),
    (dict(world=1, ranks_per_node=-1), "--ranks-per-node=-1 is invalid"),
    (dict(world=4, ranks_per_node=3), "--ranks-per-node 3 must divide the world size 4"),
    (dict(world=6, tp=3), "--tp 3 must divide num_heads=4, num_kv_heads=2"),
    (dict(world=4, tp=4), "--tp 4 must divide num_kv_heads=2"),
    (dict(world=2, tp=2, sequence_parallel=True, seq_len=63), "seq_len=63 is not divisible by --tp 2"),
    (dict(world=1, sequence_parallel=True), "layout.sequence_parallel splits each sequence over the tensor-parallel "
                                            "ranks, and --tp is 1"),
    (dict(world=1, ep=2), "launch at least 2 processes (torchrun --nproc-per-node 2"),
    (dict(world=64), "--batch-size 16 must split into 64 data-parallel shares (dp*fsdp)"),
    (dict(world=1, batch=6, micro=4),
     "--batch-size 6 must split into 1 data-parallel shares of whole micro-batches of 4"),
    (dict(world=1, batch=2, micro=4), "whole micro-batches of 4"),  # larger than the rank's share
    (dict(world=8, pp=8), "num_layers=4 is fewer than the 8 pipeline stages"),
    (dict(world=2, pp=2, pp_microbatches=3), "--pp 2: each data-parallel rank's 16 sequences do not split into 3"),
    (dict(world=2, pp=2, micro=3), "--pp 2: each data-parallel rank's 16 sequences do not split into 5"),
    (dict(world=2, pp=2, micro=4, pp_microbatches=2), "--train.micro_batch_size 4 x --layout.pp_microbatches 2 != 16"),
    (dict(world=4, pp=4, pp_microbatches=2), "1f1b needs at least pp=4 micro-batches per step, got 2"),
    (dict(world=2, pp=2, pp_microbatches=-1), "pp_microbatches=-1 is invalid"),
    (dict(world=1, pp_schedule="zigzag"), "layout.pp_schedule='zigzag' is unknown"),
    (dict(world=2, pp=2, pp_schedule="interleaved"), "interleaved needs layout.pp_stages_per_rank >= 2"),
    (dict(world=1, pp_stages_per_rank=2), "runs one stage per rank"),
    (dict(world=1, hierarchical="maybe"), "--layout.hierarchical 'maybe': use auto, on or off"),
    (dict(world=1, timeout_s=float("nan")), "--layout.timeout_s nan"),
    (dict(world=1, timeout_s=0.0), "--layout.timeout_s 0.0"),
]


@pytest.mark.parametrize("kwargs,match", REFUSED, ids=[m[:40] for _, m in REFUSED])
def test_refusals(kwargs, match):
    with pytest.raises(LayoutError) as info:
        resolve(kwargs.pop("world"), **kwargs)
    msg = str(info.value)
    assert match in msg and "\n" not in msg, msg


# ---------------------------------------------------------------------------------------------------
# One resolution behind the command line, the real run and the dry run
# ---------------------------------------------------------------------------------------------------


def test_trainer_gets_user_error_and_the_inferred_dp(monkeypatch):
    cfg = new_config("mixtral-tiny")
    cfg.layout.ep = 3
    with pytest.raises(UserError, match="num_experts=8 is not divisible by ep=3"):
        resolve_config(cfg, 6)
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(UserError, match="WORLD_SIZE='two' is not an integer"):
        resolve_config(new_config("mixtral-tiny"))
    monkeypatch.setenv("WORLD_SIZE", "4")
    cfg, _ = parse_args(["--ep", "2"])
    assert (cfg.layout.dp, cfg.layout.ep) == (4, 2)  # written back: --print-config and config.json show it


def test_run_and_dry_run_plan_from_the_same_resolution(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cfg, _ = parse_args(["--batch-size", "8", "--train.micro_batch_size", "2", "--train.device", "cpu"])
    run = plan_run(cfg)
    assert (run.per_rank, run.micro_batch, run.accum) == (8, 2, 4) and run.resolved == resolve_config(cfg, 1)
    cfg, opts = parse_args(["--dry-run", "--world-size", "4", "--pp", "2", "--batch-size", "8"])
    dry = plan_dry_run(cfg, opts.world_size)
    assert dry.resolved == resolve_config(cfg, 4) and dry.world == 4 and dry.resolved.layout == Layout(pp=2, dp=2)
    assert (dry.workload.micro_batch, dry.workload.microbatches) == (1, 4)  # 4 sequences per rank, M = 2 * pp
