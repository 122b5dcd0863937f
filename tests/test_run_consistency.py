"""Issue 14: ranks that disagree are refused before training; resuming with changed settings applies and
reports them, or refuses with the reason; config.json records what runs; token counts survive a batch change.

Rank checks run real processes: two `python tools/train.py` ranks started by hand (as two nodes' launch
scripts would), each with its own flags or working directory, over gloo.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from moekit.train.config import TrainConfig
from moekit.train.consistency import data_fingerprint, describe_rank, disagreements, message, rank_ranges
from moekit.train.tokens import write_token_file
from moekit.train.loop import main
from moekit.train.plan import lr_lambda
from tests.dist_utils import free_port
from moekit.train.resume import compare

ROOT = Path(__file__).resolve().parents[1]
TINY = ("--model.hidden_size 32 --model.num_layers 2 --model.num_heads 2 --model.num_kv_heads 1 "
        "--model.ffn_hidden_size 64 --model.moe_ffn_hidden_size 32 --model.max_seq_len 32 --train.seq_len 32 "
        "--batch-size 4 --eval.sequences 8 --eval.every 0 --log.tensorboard false --log.every 1000 "
        "--log.progress off").split()


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


# ---------------------------------------------------------------------------------------------------
# Ranks
# ---------------------------------------------------------------------------------------------------

def test_rank_ranges_and_message_name_each_group():
    assert rank_ranges([5, 0, 2, 1]) == "ranks 0-2, 5" and rank_ranges([3]) == "rank 3"
    rng = np.random.default_rng()
    world = int(rng.integers(3, 9))
    odd = int(rng.integers(0, world))
    descs = [describe_rank(TrainConfig().to_dict()) for _ in range(world)]
    descs[odd]["train"] = None  # not a real key: check the generic path below instead
    del descs[odd]["train"]
    descs[odd]["train.seed"] = 7
    diffs = disagreements(descs)
    assert [k for k, _ in diffs] == ["train.seed"]
    text = message(diffs, world)
    others = [r for r in range(world) if r != odd]
    assert f"{rank_ranges(others)}: 0" in text and f"rank {odd}: 7" in text and "\n" not in text


def test_data_fingerprint_sees_a_change_anywhere():
    rng = np.random.default_rng()
    tokens = rng.integers(0, 256, size=int(rng.integers(50_000, 200_000)), dtype=np.uint16)
    other = tokens.copy()
    assert data_fingerprint(tokens) == data_fingerprint(other)
    other[-1] ^= 1  # the last block is always sampled
    assert data_fingerprint(tokens) != data_fingerprint(other)
    assert data_fingerprint(tokens[:-1]) != data_fingerprint(tokens)  # the count is part of it
    small = tokens[: int(rng.integers(1, 64 * 2048))]  # up to 256 KiB: every token counts, gaps included
    changed = small.copy()
    changed[int(rng.integers(0, small.size))] ^= 1
    assert data_fingerprint(small) != data_fingerprint(changed)


def launch_two_ranks(run: Path, flags: list[list[str]], cwds: list[Path]) -> list[subprocess.CompletedProcess]:
    port = str(free_port())
    procs = []
    for rank in range(2):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        cmd = [sys.executable, str(ROOT / "tools" / "train.py"), *TINY, "--steps", "2", "--layout.timeout_s", "60",
               "--run-dir", str(run), *flags[rank]]
        procs.append(subprocess.Popen(cmd, env=env, cwd=cwds[rank], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=180)
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return out


def test_ranks_started_differently_are_refused_before_training(tmp_path):
    """Two ranks (fresh interpreters, as two nodes start them) that differ in the seed, in two model settings and
    in the content of the data file that one relative path names (each "node" has its own): one line from rank 0
    names every difference, the first three (alphabetically) with each rank's value."""
    run = tmp_path / "run"
    cwds = [tmp_path / "node0", tmp_path / "node1"]
    rng = np.random.default_rng()
    base = rng.integers(0, 256, size=20_000, dtype=np.uint16)
    for i, c in enumerate(cwds):
        c.mkdir()
        tokens = base.copy()
        tokens[int(rng.integers(0, tokens.size))] ^= 1 + i
        write_token_file(c / "data.bin", tokens, 256)
    flags = [["--seed", "0", "--model.top_k", "2", "--data.path", "data.bin"],
             ["--seed", "1", "--model.top_k", "1", "--model.aux_loss_coeff", "0.02", "--data.path", "data.bin"]]
    expect = ["data.content (rank 0: '20000 tokens, crc32", "model.aux_loss_coeff (rank 0: 0.01; rank 1: 0.02)",
              "model.top_k (rank 0: 2; rank 1: 1)", "and 1 more (train.seed)"]
    r0, r1 = launch_two_ranks(run, flags, cwds)
    assert (r0.returncode, r1.returncode) == (2, 2), r0.stderr[-2000:] + r1.stderr[-2000:]
    lines = [ln for ln in r0.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "different settings" in lines[0] and "Traceback" not in r0.stderr, r0.stderr
    for text in expect:
        assert text in lines[0], lines[0]
    assert "error" not in r1.stderr and "Traceback" not in r1.stderr, r1.stderr  # rank 0 speaks for all
    assert not run.exists()  # refused before the run directory was touched


def test_bad_flags_under_torchrun_are_reported_once_per_node(tmp_path):
    """Every local rank fails alike on bad flags; local rank 0 prints and the others wait, so torchrun stops them
    before they repeat the line (train.loop.LOCAL_ECHO_DELAY_S)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                                             "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(ROOT / "tools" / "train.py"), "--train.lr", "-1", "--run-dir", str(tmp_path / "r")],
                          capture_output=True, text=True, timeout=120, env={**env, "OMP_NUM_THREADS": "1"})
    assert proc.returncode != 0
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("train.py: error:")]
    assert errors == ["train.py: error: --train.lr=-1.0 is invalid; AdamW moves every weight by about lr per step, "
                      "so the learning rate must be in (0, 1] (typical: 1e-4 to 1e-2)"], proc.stderr[-3000:]


@pytest.mark.parametrize("local_rank, waits", [("0", False), ("1", True)])
def test_a_local_rank_waits_then_still_reports(monkeypatch, capsys, tmp_path, local_rank, waits):
    """A rank other than local rank 0 waits before printing, and prints if it is still running (its failure may
    be its own); local rank 0, and a process outside torchrun, print at once."""
    from moekit.train import loop

    slept = []
    monkeypatch.setattr(loop.time, "sleep", slept.append)
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert main(["--train.lr", "-1", "--run-dir", str(tmp_path / "r")]) == 2
    assert slept == ([loop.LOCAL_ECHO_DELAY_S] if waits else [])
    assert "--train.lr=-1.0 is invalid" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------
# Resume with changed settings
# ---------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def base_run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("base") / "run"
    assert main([*TINY, "--run-dir", str(run), "--steps", "4", "--checkpoint.every", "2"]) == 0
    return run


def resumed_copy(base: Path, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(base, run)
    shutil.rmtree(run / "checkpoints" / "step_000004")  # resume from step 2
    return run


def test_changed_optimizer_and_schedule_are_applied_and_reported(base_run, tmp_path, capsys):
    run = resumed_copy(base_run, tmp_path)
    rng = np.random.default_rng()
    lr = float(f"{rng.uniform(1e-4, 2e-3):.3g}")
    changed = ["--train.lr", str(lr), "--train.beta2", "0.99", "--train.weight_decay", "0.05", "--steps", "6",
               "--train.warmup_steps", "3", "--train.lr_schedule", "wsd", "--train.decay_fraction", "0.5",
               "--train.wsd_decay", "sqrt"]
    capsys.readouterr()
    assert main([*TINY, "--run-dir", str(run), "--checkpoint.every", "2", "--resume", *changed]) == 0
    out = capsys.readouterr().out
    line = [ln for ln in out.splitlines() if ln.startswith("resuming with changed settings")]
    assert len(line) == 1, out
    for text in (f"train.lr 0.003 -> {lr}", "train.beta2 0.95 -> 0.99", "train.weight_decay 0.1 -> 0.05",
                 "train.steps 4 -> 6", "train.warmup_steps 20 -> 3", "train.lr_schedule 'cosine' -> 'wsd'",
                 "train.wsd_decay 'linear' -> 'sqrt'", "train.decay_fraction 0.2 -> 0.5"):
        assert text in line[0], line[0]
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["train"]["lr"] == lr and cfg["train"]["beta2"] == 0.99 and cfg["train"]["steps"] == 6
    new = TrainConfig.from_dict(cfg)
    rows = metrics(run)
    assert [r["step"] for r in rows] == list(range(1, 7))
    for r in rows[2:]:  # steps 3.. ran with the new base lr and the new schedule
        assert r["lr"] == pytest.approx(lr * lr_lambda(new)(r["step"] - 1), rel=1e-12), r
    # unchanged settings stay bitwise: steps 1-2 are the base run's records, untouched
    assert rows[:2] == metrics(base_run)[:2]


def test_changed_seed_or_data_is_refused_and_nothing_is_written(base_run, tmp_path, capsys):
    run = resumed_copy(base_run, tmp_path)
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    for flags, key in ((["--seed", "3"], "train.seed 0 -> 3"), (["--train.seq_len", "16"], "train.seq_len 32 -> 16"),
                       (["--data.val_fraction", "0.1"], "data.val_fraction 0.05 -> 0.1")):
        capsys.readouterr()
        assert main([*TINY, "--run-dir", str(run), "--resume", "--steps", "6", *flags]) == 2
        err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
        assert len(err) == 1 and key in err[0] and "resume with --" in err[0], err
    after = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    assert after == before  # config.json, metrics, load records untouched


def test_token_count_continues_across_a_batch_size_change(base_run, tmp_path):
    run = resumed_copy(base_run, tmp_path)
    assert main([*TINY, "--run-dir", str(run), "--resume", "--steps", "4", "--batch-size", "8"]) == 0
    rows = metrics(run)
    assert [r["tokens"] for r in rows] == [4 * 32, 2 * 4 * 32, 2 * 4 * 32 + 8 * 32, 2 * 4 * 32 + 2 * 8 * 32]


def test_compare_sorts_changes():
    old = TrainConfig().to_dict()
    new = json.loads(json.dumps(old))
    new["train"]["lr"], new["train"]["init_from_hf"], new["train"]["seed"] = 1e-3, "/x", 4
    new["layout"]["ep"], new["log"]["run_dir"] = 2, "elsewhere"
    c = compare(old, new)
    assert [k for k, *_ in c.applied] == ["layout.ep", "train.lr"]
    assert [k for k, *_ in c.kept] == ["train.init_from_hf"] and [k for k, *_ in c.refused] == ["train.seed"]


def test_kernel_switches_are_part_of_each_rank_and_a_difference_is_named(monkeypatch):
    """A node whose environment set another kernel path (MOEKIT_FUSED_PERMUTE here) is named with the variable and
    the ranks on each side; the switches are the resolved values, so spelling ("ALWAYS", " never ") does not count."""
    from moekit.moe import experts

    base = describe_rank(TrainConfig().to_dict())
    assert base["switch.MOEKIT_FUSED_PERMUTE"] == experts.FUSED_PERMUTE
    assert {"switch.MOEKIT_LM_LOSS", "switch.MOEKIT_SPLIT_ROUTER", "switch.MOEKIT_DELTA_SCAN"} <= base.keys()
    other = "always" if experts.FUSED_PERMUTE != "always" else "never"
    monkeypatch.setattr(experts, "FUSED_PERMUTE", other)
    odd = describe_rank(TrainConfig().to_dict())
    diffs = disagreements([base, base, odd])
    assert [k for k, _ in diffs] == ["switch.MOEKIT_FUSED_PERMUTE"]
    assert f"rank 2: {other!r}" in message(diffs, 3)
