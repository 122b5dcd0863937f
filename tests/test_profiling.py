"""--profile.every: which steps a run traces (resumed runs included), what each window writes on every rank, time
by category from the module labels, and that profiling changes nothing the run computes (moekit.train.profiling)."""
from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

import pytest
from torch import nn

from moekit.train.profiling import Window, window_at, windows

TINY = ["--preset", "mixtral-tiny", "--batch-size", "4", "--train.seq_len", "32", "--eval.every", "0",
        "--eval.sequences", "8",
        "--log.every", "1", "--log.progress", "off", "--log.tensorboard", "false"]


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)


def simulated(every: int, steps: int, warmup: int, start: int, last: int) -> list[tuple[int, int, int]]:
    """(first step, last step, recorded steps) of each trace, by walking the run step by step: a step is recorded
    when it is among the last ``steps`` before a multiple of ``every``, warm-up when among the ``warmup`` before
    those; a trace exists when all of its recorded steps run after ``start`` and by ``last``."""
    out = []
    for end in range(every, last + 1, every):
        recorded = [s for s in range(end - steps + 1, end + 1)]
        if recorded[0] <= start:
            continue
        warm = [s for s in range(end - steps - warmup + 1, end - steps + 1) if s > start]
        out.append(((warm or recorded)[0], end, len(recorded)))
    return out


def test_windows_end_at_multiples_and_shorten_their_warmup_after_a_resume():
    assert windows(5, 2, 1, 0, 12) == [Window(3, 5, 2), Window(8, 10, 2)]
    assert windows(5, 2, 1, 3, 12)[0] == Window(4, 5, 2)  # resumed in the warm-up: none left
    assert windows(5, 2, 1, 4, 12)[0] == Window(8, 10, 2)  # resumed inside the recorded steps: no partial trace
    assert windows(1, 1, 0, 0, 3) == [Window(1, 1, 1), Window(2, 2, 1), Window(3, 3, 1)]
    assert windows(4, 4, 0, 0, 8) == [Window(1, 4, 4), Window(5, 8, 4)]
    assert windows(10, 1, 1, 0, 9) == []  # the first multiple is past the run's end
    assert Window(3, 5, 2).warmup == 1 and list(Window(3, 5, 2).recorded) == [4, 5]
    assert window_at(4, 5, 2, 1) is None and window_at(3, 5, 2, 1) == Window(3, 5, 2)
    rng = random.Random()
    for _ in range(300):
        every = rng.randint(1, 9)
        steps = rng.randint(1, every)
        warmup = rng.randint(0, every - steps)
        start, last = rng.randint(0, 20), rng.randint(0, 40)
        got = [(w.first, w.end, w.steps) for w in windows(every, steps, warmup, start, last)]
        assert got == simulated(every, steps, warmup, start, last), (every, steps, warmup, start, last)


def trace_events(path: Path) -> list[dict]:
    with gzip.open(path, "rt") as f:
        return json.load(f)["traceEvents"]


def losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_profiled_run_traces_its_windows_and_trains_bitwise_alike(tmp_path, capsys):
    """mixtral-tiny, 4 steps with --profile.every 3 --profile.steps 2, a checkpoint at 4, then resumed to 6: traces of
    steps 2-3 (warm-up 1) and 5-6 (resumed at 4, so no warm-up left); the losses equal an unprofiled 6-step run's
    bit for bit, and no hook or wrapper stays on the model after its windows."""
    from moekit.train.cli import parse_args
    from moekit.train.loop import main
    from moekit.train.profiling import LabelledDispatcher
    from moekit.train.trainer import Trainer

    assert main([*TINY, "--steps", "6", "--checkpoint.every", "0", "--run-dir", str(tmp_path / "plain")]) == 0
    flags = ["--profile.every", "3", "--profile.steps", "2", "--profile.warmup", "1", "--checkpoint.every", "4",
             "--run-dir", str(tmp_path / "prof")]
    capsys.readouterr()
    trainers = []
    for argv in ([*TINY, "--steps", "4", *flags], [*TINY, "--steps", "6", *flags, "--resume"]):
        cfg, opts = parse_args(argv)
        trainers.append(Trainer(cfg, opts))
        assert trainers[-1].train() == 0
    out = capsys.readouterr().out
    assert losses(tmp_path / "prof") == losses(tmp_path / "plain")
    for t in trainers:  # the labels went with their windows (the guard's own hooks stay)
        assert not [h for m in t.model.modules() for h in (*m._forward_hooks.values(), *m._forward_pre_hooks.values())
                    if h.__module__ == "moekit.train.profiling"]
        assert not any(isinstance(getattr(m, "dispatcher", None), LabelledDispatcher) for m in t.model.modules())
    prof = tmp_path / "prof" / "profile"
    assert sorted(p.name for p in prof.iterdir()) == ["step_000003", "step_000006"]
    assert "profile: 1 trace(s) of 2 step(s) each, ending at steps 3" in out
    assert "profile: 1 trace(s) of 2 step(s) each, ending at steps 6" in out
    for end, first in ((3, 2), (6, 5)):
        folder = prof / f"step_{end:06d}"
        assert sorted(p.name for p in folder.iterdir()) == ["rank0.summary.json", "rank0.summary.txt",
                                                            "rank0.trace.json.gz"]
        names = {e.get("name") for e in trace_events(folder / "rank0.trace.json.gz")}
        assert {f"train_step#{first}", f"train_step#{end}"} <= names  # the recorded steps, and only those
        assert not {f"train_step#{s}" for s in (first - 1, end + 1)} & names
        assert {"moekit/attention", "moekit/expert_gemm", "moekit/router", "moekit/permute_unpermute",
                "moekit/head_loss"} <= names
        summary = json.loads((folder / "rank0.summary.json").read_text())
        assert summary["steps"] == [first, end] and summary["warmup_steps"] == (1 if end == 3 else 0)
        cats = summary["categories_ms_per_step"]
        assert sum(cats.values()) == pytest.approx(summary["ms_per_step"])
        for c in ("attention", "expert_gemm", "router", "permute_unpermute", "norm", "embedding", "head_loss",
                  "optimizer"):
            assert cats[c] > 0, (c, cats)
        assert cats["communication"] == 0  # one process
        assert summary["top_ops"] and all(not op["name"].startswith("moekit/") for op in summary["top_ops"])
        assert "expert_gemm" in (folder / "rank0.summary.txt").read_text()
        line = next(ln for ln in out.splitlines() if ln.startswith(f"profile: steps {first}-{end}, "))
        assert str(folder / "rank0.trace.json.gz") in line and "CPU op self time" in line
    # the window's line follows its last step's
    lines = out.splitlines()
    assert lines.index(next(ln for ln in lines if ln.startswith("step=3 "))) + 1 == \
        lines.index(next(ln for ln in lines if ln.startswith("profile: steps 2-3")))


def test_every_rank_writes_its_trace_under_expert_and_pipeline_parallelism(tmp_path):
    """Two ranks: expert parallel (the all-to-alls show as communication), pipelined (the head + loss label opens on
    the last stage's norm and closes with that stage's forward), fully sharded (labels beside FSDP's own hooks): one
    set of files per rank, one console line per window (rank 0's)."""
    from tests.dist_utils import run_trainer

    common = [*TINY, "--steps", "2", "--checkpoint.every", "0", "--profile.every", "2", "--profile.steps", "1"]
    for name, extra in (("ep2", ["--ep", "2"]), ("pp2", ["--pp", "2"]), ("fsdp2", ["--fsdp", "2"])):
        run = tmp_path / name
        r = run_trainer([*common, "--run-dir", str(run), *extra], nproc=2)
        assert r.returncode == 0, r.stderr[-3000:]
        folder = run / "profile" / "step_000002"
        assert sorted(p.name for p in folder.iterdir()) == sorted(
            f"rank{r}.{kind}" for r in (0, 1) for kind in ("summary.json", "summary.txt", "trace.json.gz"))
        assert r.stdout.count("profile: step 2, ") == 1, r.stdout
        cats = [json.loads((folder / f"rank{k}.summary.json").read_text())["categories_ms_per_step"] for k in (0, 1)]
        if name != "pp2":  # the all-to-alls; FSDP's all-gathers and reduce-scatters
            assert all(c["communication"] > 0 and c["expert_gemm"] > 0 for c in cats), cats
        else:  # the first stage holds the embedding, the second the head
            assert cats[0]["embedding"] > 0 and cats[0]["head_loss"] == 0, cats
            assert cats[1]["head_loss"] > 0 and cats[1]["embedding"] == 0, cats
            assert all(c["attention"] > 0 for c in cats), cats


@pytest.mark.parametrize("argv,expected", [
    (["--profile.every", "-1"], "--profile.every=-1 is invalid"),
    (["--profile.every", "5", "--profile.steps", "0"], "--profile.steps=0 is invalid"),
    (["--profile.every", "5", "--profile.warmup", "-2"], "--profile.warmup=-2 is invalid"),
    (["--profile.every", "3", "--profile.steps", "3", "--profile.warmup", "1"],
     "raise --profile.every to at least 4"),
    (["--profile.memory", "true", "--train.device", "cpu"], "this run is on cpu"),
    (["--profile.every", "x"], "--profile.every"),
])
def test_bad_profile_settings_are_refused_in_one_line(tmp_path, capsys, argv, expected):
    from moekit.train.loop import main

    run = tmp_path / "run"
    assert main([*TINY, "--steps", "2", *argv, "--run-dir", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0] and "Traceback" not in err[0], err
    assert not run.exists()


def test_a_run_shorter_than_every_says_it_traces_nothing(tmp_path, capsys):
    from moekit.train.loop import main

    assert main([*TINY, "--steps", "2", "--checkpoint.every", "0", "--profile.every", "5",
                 "--run-dir", str(tmp_path / "run")]) == 0
    assert "--profile.every 5 traces no step of this run (steps 1-2)" in capsys.readouterr().out
    assert not (tmp_path / "run" / "profile").exists()


def test_labels_come_off_with_their_window():
    """install_labels' remover takes every hook and dispatcher wrapper away and closes a range left open."""
    import torch

    from moekit.models.config import preset
    from moekit.models.transformer import Transformer
    from moekit.train.profiling import Labels, install_labels

    model = Transformer(preset("mixtral-tiny"))
    before = {id(m): m.dispatcher for m in model.modules() if hasattr(m, "dispatcher")}
    labels = Labels()
    remove = install_labels(model, labels)
    hooked = [m for m in model.modules() if m._forward_hooks]
    assert hooked and any(isinstance(m, nn.RMSNorm) for m in hooked)
    model(torch.randint(0, 100, (1, 8)), targets=torch.randint(0, 100, (1, 8)))
    assert labels.stack == []  # the head + loss range closed with the model's forward
    labels.push("attention")
    remove()
    assert labels.stack == []
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert {id(m): m.dispatcher for m in model.modules() if hasattr(m, "dispatcher")} == before
