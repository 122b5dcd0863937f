"""Reliability of tools/train.py (issue 8): non-finite steps, imbalance stress, determinism, memory, data.

In-process runs call ``moekit.train.loop.main(argv)`` with a tiny model; two torchrun launches (2 gloo ranks,
ep 2) check that ranks agree on a skipped step and that all tokens on one expert neither hangs nor
loses count. Non-finite values are injected with the MOEKIT_DEBUG_NAN hook (moekit.train.guard).
"""
from __future__ import annotations

import gc
import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
from moekit.train import guard
from moekit.train.loop import main
from moekit.train.records import load_rows

from tests.dist_utils import run_trainer
from tests.tiny import TINY_MODEL

from moekit.moe import build_router

TINY = [*TINY_MODEL, *"--checkpoint.every 0 --log.progress off".split()]


def rows(run_dir: Path, name: str = "metrics.jsonl") -> list[dict]:
    return [json.loads(line) for line in (run_dir / name).read_text().splitlines()]


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# ---------------------------------------------------------------------------------------------------
# 1. Non-finite loss or gradient: every rank stops or skips together, and the layer is named
# ---------------------------------------------------------------------------------------------------


def test_skip_discards_the_step_and_names_the_gradient(tmp_path, monkeypatch, capsys):
    """A NaN router gradient in MoE layer 1 at step 2: that step is recorded as skipped and changes nothing."""
    monkeypatch.setenv(guard.POISON_ENV, "2:1:grad")
    run = tmp_path / "skip"
    assert main([*TINY, "--run-dir", str(run), "--steps", "3", "--train.on_nonfinite", "skip"]) == 0
    got = rows(run)
    assert [r["step"] for r in got] == [1, 2, 3]
    event = {k: got[1][k] for k in ("step", "skipped", "nonfinite", "value", "where")}
    assert event == {"step": 2, "skipped": True, "nonfinite": "gradient norm", "value": None,
                     "where": "MoE layer layers.1.ffn: router weight gradient (backward)"}
    # the keys every metrics line has (DESIGN.md), with nothing measured for a discarded step
    assert got[1]["loss"] is None and got[1]["aux_loss"] is None and got[1]["tokens_per_s"] == 0.0
    assert got[1]["lr"] > 0
    assert "step=2 skipped: non-finite gradient norm (nan)" in (out := capsys.readouterr().out)
    assert "; non-finite gradient in router" in out  # the part whose norm went bad (moekit.train.grad_parts)
    parts = got[1]["grad_norm_by_part"]
    assert parts["router"] is None and all(v is not None for k, v in parts.items() if k != "router"), parts
    assert np.isfinite([got[0]["loss"], got[2]["loss"], got[2]["grad_norm"]]).all()
    assert [r["step"] for r in load_rows(run)[1:]] == [1, 3]  # no load line for step 2
    # the scheduler did not move at step 2: step 3 trains at the LR a clean run uses at step 2
    clean = tmp_path / "clean"
    monkeypatch.delenv(guard.POISON_ENV)
    assert main([*TINY, "--run-dir", str(clean), "--steps", "3"]) == 0
    assert got[2]["lr"] == rows(clean)[1]["lr"]
    timings = ("tokens_per_s", "step_s", "elapsed_s", "mem_gb")
    assert got[0] == {**rows(clean)[0], **{k: got[0][k] for k in timings}}


def test_stop_names_the_router_that_went_nan(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(guard.POISON_ENV, "2:0:router")
    run = tmp_path / "stop"
    assert main([*TINY, "--run-dir", str(run), "--steps", "3"]) == 1  # default: stop
    line = one_line(capsys.readouterr().err)
    assert "non-finite loss (nan) at step 2" in line and "MoE layer layers.0.ffn: router output (forward)" in line
    assert [r["step"] for r in rows(run)] == [1]


def test_skipping_every_step_gives_up(tmp_path, monkeypatch, capsys):
    from moekit.models import transformer

    for mod, name in ((torch.nn.functional, "cross_entropy"), (transformer, "chunked_lm_loss")):  # either loss path
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, real=real, **k: real(*a, **k) * float("nan"))
    monkeypatch.setattr(guard, "MAX_CONSECUTIVE_SKIPS", 2)
    assert main([*TINY, "--run-dir", str(tmp_path / "r"), "--steps", "5", "--train.on_nonfinite", "skip"]) == 1
    line = one_line(capsys.readouterr().err)
    assert "at step 2 after 2 skipped steps in a row" in line and "the loss, with finite MoE layer outputs" in line


@pytest.mark.parametrize("value", ["x", "0:0:grad", "1:9:grad", "1:0:weights", "1:0:grad:-1"])
def test_bad_poison_variable_is_one_line(tmp_path, monkeypatch, capsys, value):
    monkeypatch.setenv(guard.POISON_ENV, value)
    assert main([*TINY, "--run-dir", str(tmp_path / "r"), "--steps", "1"]) == 2
    assert guard.POISON_ENV in one_line(capsys.readouterr().err)


def _torchrun(args, env_extra=None) -> subprocess.CompletedProcess:
    """tools/train.py at ep 2 on two ranks forked as torchrun starts them (tests.dist_utils.run_trainer)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **(env_extra or {})}
    env.pop("WORLD_SIZE", None)
    return run_trainer([*TINY, "--ep", "2", *args], 2, env=env, timeout=300)


def test_torchrun_ranks_skip_together_with_all_tokens_on_one_expert(tmp_path):
    """ep 2, dropless, every token's first slot on expert 0 (rank 0), and rank 1's router in MoE layer 1
    goes NaN at step 2: both ranks skip step 2 (else the next collective would hang) and name that router."""
    run = tmp_path / "r"
    r = _torchrun(["--steps", "3", "--run-dir", str(run), "--train.on_nonfinite", "skip",
                   "--model.router_options.force_expert", "0"], {guard.POISON_ENV: "2:1:router:1"})
    assert r.returncode == 0, r.stderr[-3000:]
    got = rows(run)
    assert [x.get("skipped", False) for x in got] == [False, True, False]
    assert got[1]["where"] == "MoE layer layers.1.ffn: router output (forward)"
    tokens = 4 * 32  # global batch
    for line in load_rows(run)[1:]:
        for layer in line["tokens"]:  # dropless: expert 0 took every token, nothing was lost
            assert layer[0] == tokens and sum(layer) == 2 * tokens
    assert got[2]["imbalance"] >= 4  # max/mean over 8 experts: expert 0 holds half of all slots


def test_torchrun_capacity_drops_when_all_tokens_pick_one_expert(tmp_path):
    run = tmp_path / "r"
    r = _torchrun(["--steps", "2", "--run-dir", str(run), "--capacity-factor", "1.0",
                   "--model.router_options.force_expert", "0"])
    assert r.returncode == 0, r.stderr[-3000:]
    capacity = 2 * 32 * 2 // 8  # per rank: T=64 tokens, k=2, 8 experts, factor 1
    for line in load_rows(run)[1:]:
        assert all(layer[0] == 2 * capacity for layer in line["tokens"])  # two ranks, each full
        assert all(layer[0] == 4 * 32 for layer in line["assigned"])  # every token chose it
    dropped = (4 * 32 - 2 * capacity) / (2 * 4 * 32)  # expert 0's overflow alone: 96 of 256 slots
    assert all(m["dropped_fraction"] >= dropped for m in rows(run))


# ---------------------------------------------------------------------------------------------------
# 2. Imbalance stress: the debug router option and a clear out-of-memory message
# ---------------------------------------------------------------------------------------------------


def test_force_expert_is_selection_only():
    torch.manual_seed(0)
    free = build_router("topk", 16, 8, top_k=2)
    forced = build_router("topk", 16, 8, top_k=2, force_expert=5)
    forced.load_state_dict(free.state_dict())
    x = torch.randn(64, 16)
    r = forced(x)
    assert (r.indices[:, 0] == 5).all() and r.tokens_per_expert[5] == 64
    scores = free.logits(x).softmax(-1)
    picked = scores.gather(1, r.indices)
    torch.testing.assert_close(r.weights, picked / picked.sum(-1, keepdim=True))  # the real scores
    with pytest.raises(ValueError, match=r"force_expert=8 is invalid; it must be an integer in \[0, 7\]"):
        build_router("topk", 16, 8, force_expert=8)


def test_out_of_memory_in_an_expert_names_layer_expert_and_rows(tmp_path, monkeypatch, capsys):
    from moekit.moe.experts import GroupedExperts

    real = GroupedExperts.forward

    def tight(self, rows, counts):  # a device that fits 100 rows per expert
        if int(counts.max()) > 100:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(self, rows, counts)

    monkeypatch.setattr(GroupedExperts, "forward", tight)
    argv = [*TINY, "--run-dir", str(tmp_path / "r"), "--steps", "1", "--model.router_options.force_expert", "3"]
    assert main(argv) == 2
    line = one_line(capsys.readouterr().err)
    assert "out of memory in MoE layer layers.0.ffn: expert 3 got 128 rows (256 rows" in line
    assert "--capacity-factor" in line
    assert main([*argv, "--capacity-factor", "1.0"]) == 0  # capacity: 128 * 2 / 8 = 32 rows per expert fit


# ---------------------------------------------------------------------------------------------------
# 3. Determinism
# ---------------------------------------------------------------------------------------------------


def test_deterministic_runs_are_bitwise_identical(tmp_path, monkeypatch):
    """Two --deterministic runs: the same losses and the same final weights, bit for bit (CPU)."""
    pytest.importorskip("safetensors")
    from moekit.models import transformer

    seen = []

    def spy(real):
        def loss_fn(*a, **k):
            seen.append(torch.are_deterministic_algorithms_enabled())
            return real(*a, **k)
        return loss_fn

    for mod, name in ((torch.nn.functional, "cross_entropy"), (transformer, "chunked_lm_loss")):  # either loss path
        monkeypatch.setattr(mod, name, spy(getattr(mod, name)))
    a, b = tmp_path / "a", tmp_path / "b"
    for run in (a, b):
        assert main([*TINY, "--steps", "3", "--deterministic", "--run-dir", str(run), "--export-hf", str(run / "hf"),
                     "--train.micro_batch_size", "2"]) == 0
    assert seen and all(seen) and not torch.are_deterministic_algorithms_enabled()  # on in the run, restored
    assert [r["loss"] for r in rows(a)] == [r["loss"] for r in rows(b)]
    assert [r["grad_norm"] for r in rows(a)] == [r["grad_norm"] for r in rows(b)]
    weights = sorted((a / "hf").glob("*.safetensors"))
    assert weights and all(w.read_bytes() == (b / "hf" / w.name).read_bytes() for w in weights)


# ---------------------------------------------------------------------------------------------------
# 4. Memory: nothing accumulates across steps
# ---------------------------------------------------------------------------------------------------


def _live_tensor_bytes() -> tuple[int, int]:
    gc.collect()
    count = total = 0
    for obj in gc.get_objects():
        try:
            if type(obj) in (torch.Tensor, torch.nn.Parameter) and not obj.is_meta:  # type(): no module proxies
                count += 1
                total += obj.untyped_storage().nbytes()
        except (ReferenceError, RuntimeError):  # weakref proxies, tensors without storage
            continue
    return count, total


@pytest.mark.parametrize("ac", ["none", "full"])
def test_live_tensors_do_not_grow_between_step_10_and_200(tmp_path, monkeypatch, ac):
    """Live tensors (count and bytes, gc-reachable) after step 10 and after step 200 of one run differ by
    < 1%: no per-step growth in ExpertLoad, router state, the guard's flags, the optimizer or records,
    with and without activation checkpointing."""
    from moekit.train import records

    seen = {}
    real = records.ExpertLoadWriter.write

    def write(self, step, load, force=False):
        written = real(self, step, load, force)
        if step in (10, 200):
            seen[step] = _live_tensor_bytes()
        return written

    monkeypatch.setattr(records.ExpertLoadWriter, "write", write)
    small = ["--model.hidden_size", "16", "--model.num_layers", "1", "--model.moe_ffn_hidden_size", "16",
             "--model.num_experts", "2", "--model.top_k", "1",
             "--model.ffn_hidden_size", "16", "--train.seq_len", "8", "--batch-size", "2",
             "--model.router_options", '{"expert_bias": true, "bias_update_rate": 0.001}']
    assert main([*TINY, *small, "--run-dir", str(tmp_path / "r"), "--steps", "200",
                 "--train.activation_checkpointing", ac]) == 0
    (n10, b10), (n200, b200) = seen[10], seen[200]
    assert n200 == n10, (n10, n200)
    assert abs(b200 - b10) <= 0.01 * b10, (b10, b200)


# ---------------------------------------------------------------------------------------------------
# 7. Data: a batch too small for every data-parallel rank fails at start-up
# ---------------------------------------------------------------------------------------------------


def test_batch_smaller_than_the_data_parallel_ranks_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    assert main([*TINY, "--batch-size", "2", "--run-dir", str(tmp_path / "r")]) == 2
    assert "--batch-size 2 must split into 4 data-parallel shares" in one_line(capsys.readouterr().err)
    assert not (tmp_path / "r").exists()
