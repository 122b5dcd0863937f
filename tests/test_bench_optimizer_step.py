"""tools/bench/optimizer_step.py at tiny size: the JSON's structure, Muon's state half of AdamW's on the matrices,
its Newton-Schulz FLOP count against the formula, and the flags it refuses; tools/bench/muon_step.py (Muon spread
over FSDP ranks against the all-gather) on 2 gloo ranks: its table, JSON and counts, and its bad flags."""
import json

import pytest

from moekit.bench import muon_step, optimizer_step
from tests.dist_utils import run_ranks


def test_optimizer_step_bench_smoke(tmp_path, capsys):
    out = tmp_path / "opt.json"
    assert optimizer_step.main(["--presets", "deepseek-tiny", "--repeats", "1", "--warmup", "0",
                                "--out", str(out)]) == 0
    assert "time / adamw" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["benchmark"] == "optimizer_step" and "partial" not in data
    rows = {r["peer"]: r for r in data["rows"]}
    assert set(rows) == {"adamw", "muon"} and rows["adamw"]["ratio"] == 1.0
    assert rows["muon"]["state_mib"] < 0.6 * rows["adamw"]["state_mib"]
    assert rows["muon"]["ns_gflop"] > 0 and rows["adamw"]["ns_gflop"] is None


def test_ns_flops_formula():
    import torch
    from torch import nn

    model = nn.Module()
    model.w = nn.Parameter(torch.zeros(4, 6))  # one 4 x 6 matrix: 5 * (2*16*6 + 2*64 + 2*16*6)
    assert optimizer_step.ns_flops(model) == 5 * (2 * 16 * 6 + 2 * 64 + 2 * 16 * 6)


@pytest.mark.parametrize("args,match", [(["--presets", "gpt-9"], "unknown"), (["--dtype", "bfloat16"], "float32")])
def test_optimizer_step_bench_refuses_bad_flags(args, match, capsys):
    with pytest.raises(SystemExit) as exit_info:
        optimizer_step.main(args)
    assert exit_info.value.code == 2 and match in capsys.readouterr().err


def _muon_step_ranks(rank, world, out):
    import torch

    args = muon_step.parse(["--world", "2", "--presets", "deepseek-tiny", "--repeats", "1", "--warmup", "0",
                            "--out", out])
    rows = muon_step.measure(args, world, rank, torch.device("cpu"))
    if rank == 0:
        muon_step.report(args, world, torch.device("cpu"), rows)


def test_muon_step_bench_on_two_ranks(tmp_path, capsys):
    """Each rank orthogonalises its own experts and half of the cut matrices when spread (all of them otherwise)
    and, at R = 2, receives as many bytes; the rows compare both peers on one preset."""
    out = tmp_path / "muon.json"
    run_ranks(_muon_step_ranks, 2, str(out))
    data = json.loads(out.read_text())
    assert data["benchmark"] == "muon_step" and data["world"] == 2
    rows = {r["peer"]: r for r in data["rows"]}
    assert set(rows) == {"spread", "all-gather"} and rows["all-gather"]["vs_all_gather"] == 1.0
    spread, gather = rows["spread"], rows["all-gather"]
    from moekit.models.config import preset
    from moekit.models.transformer import Transformer, meta_device
    from moekit.train.muon import muon_param_groups

    with meta_device():
        group = muon_param_groups(Transformer(preset("deepseek-tiny")), 0.0)[0]
    cut = [c for p, c in zip(group["params"], group["chunks"]) if p.dim() == 2]  # 2-D: cut along rows
    stacks = sum(c for p, c in zip(group["params"], group["chunks"]) if p.dim() == 3)  # experts stay whole
    assert gather["ns_per_rank"] == sum(cut) + stacks
    assert spread["ns_per_rank"] == sum(cut[0::2]) + stacks  # rank 0 owns matrices 0, 2, 4, ...
    assert gather["recv_mib"] > 0 and spread["recv_mib"] == pytest.approx(gather["recv_mib"])  # 2/R of it: R = 2
    assert spread["ms"] > 0 and gather["ms"] > 0


def test_muon_step_received_bytes():
    """Per batch of R matrices of M values a rank receives (R-1)/R M for the one it owns and M/R of each other
    update: 2 (R-1)/R M, against the all-gather's (R-1) M; expert stacks (cut along the experts) move nothing."""
    shapes = [(8, 4)] * 4 + [(4, 6, 2)]
    mib = 4 / 2 ** 20
    assert muon_step.received_mib(shapes, 4, spread=True) == (24 + 3 * 8) * mib
    assert muon_step.received_mib(shapes, 4, spread=False) == 4 * 24 * mib
    assert muon_step.received_mib([(5, 3)] * 2, 4, spread=True) == (15 - 6 + 6) * mib  # rows 2 2 1 0


@pytest.mark.parametrize("args,match", [(["--world", "1"], "must be >= 2"), (["--presets", "gpt-9"], "unknown"),
                                        (["--repeats", "0"], "--repeats")])
def test_muon_step_bench_refuses_bad_flags(args, match, capsys):
    with pytest.raises(SystemExit) as exit_info:
        muon_step.main(args)
    assert exit_info.value.code == 2 and match in capsys.readouterr().err
