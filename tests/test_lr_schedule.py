"""The learning-rate schedules (moekit.train.plan.lr_lambda) against the same curves written another way: numpy
over every step, the warmup-stable-decay as a piecewise-linear interpolation (np.interp) or its shapes applied to
the decay's own progress. Then the properties a user relies on, and the refusals."""
from __future__ import annotations

import json

import numpy as np
import pytest

from moekit.train import UserError
from moekit.train.cli import parse_args
from moekit.train.config import LR_SCHEDULES, WSD_DECAYS, TrainConfig
from moekit.train.plan import DECAY_SHAPES, lr_lambda


def config(**train) -> TrainConfig:
    cfg = TrainConfig()
    for k, v in train.items():
        setattr(cfg.train, k, v)
    return cfg


def expected(steps: int, warmup: int, floor: float, schedule: str, fraction: float, decay: str) -> np.ndarray:
    s = np.arange(steps, dtype=np.float64)
    p = np.clip((s - warmup) / max(steps - 1 - warmup, 1), 0.0, 1.0)  # 1 at the last step
    if schedule == "cosine":
        after = floor + (1 - floor) * (np.cos(np.pi * p) + 1) / 2
    elif schedule == "linear":
        after = np.interp(p, [0.0, 1.0], [1.0, floor])
    elif schedule == "constant":
        after = np.ones_like(p)
    elif decay == "linear":
        after = np.interp(p, [0.0, 1.0 - fraction, 1.0], [1.0, 1.0, floor])
    else:
        q = np.clip((p - (1.0 - fraction)) / fraction, 0.0, 1.0)
        shape = 1 - np.sqrt(q) if decay == "sqrt" else (1 + np.cos(np.pi * q)) / 2
        after = floor + (1 - floor) * shape
    return np.where(s < warmup, (s + 1) / max(warmup, 1), after)


CASES = [(s, d) for s in LR_SCHEDULES if s != "wsd" for d in ["linear"]] + [("wsd", d) for d in WSD_DECAYS]


@pytest.mark.parametrize("schedule,decay", CASES, ids=[f"{s}-{d}" for s, d in CASES])
def test_schedules_match_the_curves_written_another_way(schedule, decay):
    rng = np.random.default_rng()
    steps, warmup = int(rng.integers(20, 400)), int(rng.integers(0, 15))
    floor, fraction = float(rng.uniform(0, 0.5)), float(rng.uniform(0.05, 1.0))
    extra = dict(decay_fraction=fraction, wsd_decay=decay) if schedule == "wsd" else {}
    f = lr_lambda(config(steps=steps, warmup_steps=warmup, min_lr_ratio=floor, lr_schedule=schedule, **extra))
    got = np.array([f(i) for i in range(steps)])
    want = expected(steps, warmup, floor, schedule, fraction, decay)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12, err_msg=f"{steps=} {warmup=} {floor=} {fraction=}")
    after = got[warmup:]
    assert after[0] == 1.0  # the peak right after warmup
    assert np.all(np.diff(after) <= 1e-15)  # never rises again
    if schedule != "constant":  # the last step trains at the floor, however short the decay
        assert after[-1] == pytest.approx(floor, abs=1e-12)
    if schedule == "wsd":  # exactly the peak until the decay starts
        stable = after[: int((1 - fraction) * (steps - 1 - warmup)) + 1]
        assert np.all(stable == 1.0)


@pytest.mark.parametrize("decay", WSD_DECAYS)
def test_a_short_wsd_decay_still_reaches_the_floor(decay):
    """A decay shorter than one step (decay_fraction * steps < 1) still ends the run at the floor."""
    f = lr_lambda(config(steps=100, warmup_steps=0, min_lr_ratio=0.1, lr_schedule="wsd", decay_fraction=0.005,
                         wsd_decay=decay))
    assert [f(i) for i in range(98)] == [1.0] * 98 and f(99) == pytest.approx(0.1)


def test_every_wsd_decay_has_a_shape():
    assert sorted(DECAY_SHAPES) == sorted(WSD_DECAYS)
    for shape in DECAY_SHAPES.values():
        assert shape(0.0) == 1.0 and abs(shape(1.0)) < 1e-15


@pytest.mark.parametrize("flags,words", [
    (["--train.lr_schedule", "step"], "--train.lr_schedule='step' is invalid; choose one of"),
    (["--train.lr_schedule", "wsd", "--train.decay_fraction", "0"], "--train.decay_fraction=0.0 is invalid"),
    (["--train.lr_schedule", "wsd", "--train.decay_fraction", "1.5"], "it must be in (0, 1]"),
    (["--train.lr_schedule", "wsd", "--train.wsd_decay", "exp"], "--train.wsd_decay='exp' is invalid"),
    (["--train.decay_fraction", "0.3"], "--train.decay_fraction=0.3 applies to --train.lr_schedule wsd only"),
    (["--train.wsd_decay", "cosine"], "--train.wsd_decay=cosine applies to --train.lr_schedule wsd only"),
    (["--train.decay_steps", "50"], "--train.decay_steps=50 applies to --train.lr_schedule wsd only"),
    (["--train.lr_schedule", "wsd", "--train.decay_steps", "1"], "--train.decay_steps=1 is invalid"),
    (["--train.lr_schedule", "wsd", "--steps", "100", "--train.decay_steps", "81"],
     "from 2 to the 80 steps after warmup (--steps 100, --train.warmup_steps 20)"),
    (["--train.lr_schedule", "wsd", "--train.decay_steps", "10", "--train.decay_fraction", "0.1"],
     "both set the decay's length; keep one"),
])
def test_schedule_settings_are_checked(flags, words):
    with pytest.raises(UserError) as err:
        parse_args(flags)
    assert words in str(err.value), str(err.value)
    cfg, _ = parse_args(["--train.lr_schedule", "wsd", "--train.decay_fraction", "0.3", "--train.wsd_decay", "sqrt"])
    assert (cfg.train.lr_schedule, cfg.train.decay_fraction, cfg.train.wsd_decay) == ("wsd", 0.3, "sqrt")


def test_a_run_that_only_warms_up_says_its_schedule_never_applies(tmp_path, capsys):
    from moekit.train.loop import main
    from tests.test_train import TINY

    assert main([*TINY, "--run-dir", str(tmp_path / "a"), "--steps", "2", "--train.lr_schedule", "wsd"]) == 0
    assert ("note: --train.warmup_steps 20 >= --steps 2: the whole run warms up, so --train.lr_schedule wsd never "
            "applies") in capsys.readouterr().out
    assert main([*TINY, "--run-dir", str(tmp_path / "b"), "--steps", "2", "--train.lr_schedule", "wsd",
                 "--train.warmup_steps", "1"]) == 0
    assert "never applies" not in capsys.readouterr().out


@pytest.mark.parametrize("decay", WSD_DECAYS)
def test_decay_steps_decay_over_exactly_the_last_n_steps(decay):
    """--train.decay_steps n: the LR is 1 before the last n steps, then the decay's shape from 1 (its first step) to
    the floor (the last), written here over the decay's own steps."""
    rng = np.random.default_rng()
    steps, warmup = int(rng.integers(30, 200)), int(rng.integers(0, 10))
    n, floor = int(rng.integers(2, steps - warmup + 1)), float(rng.uniform(0, 0.5))
    f = lr_lambda(config(steps=steps, warmup_steps=warmup, min_lr_ratio=floor, lr_schedule="wsd", decay_steps=n,
                         wsd_decay=decay))
    got = np.array([f(i) for i in range(steps)])
    q = np.clip((np.arange(steps) - (steps - n)) / (n - 1), 0, None)  # 0 at the decay's first step, 1 at the last
    shape = {"linear": 1 - q, "sqrt": 1 - np.sqrt(q), "cosine": (1 + np.cos(np.pi * q)) / 2}[decay]
    want = np.where(np.arange(steps) < steps - n, 1.0, floor + (1 - floor) * shape)
    want[:warmup] = (np.arange(warmup) + 1) / warmup
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    assert (got[warmup : steps - n] == 1.0).all() and got[-1] == pytest.approx(floor)


def test_a_cooldown_branches_from_a_stable_checkpoint(tmp_path):
    """A wsd run's stable-phase checkpoint resumed into another run directory with --steps S + 4 and
    --train.decay_steps 4: its four steps' LRs are the decay's, the checkpoint's run is untouched."""
    from moekit.train.loop import main
    from tests.test_train import TINY

    flags = [*TINY, "--train.lr_schedule", "wsd", "--train.warmup_steps", "1", "--train.min_lr_ratio", "0.1"]
    stable = tmp_path / "stable"
    assert main([*flags, "--run-dir", str(stable), "--steps", "12", "--checkpoint.every", "6",
                 "--checkpoint.keep", "2"]) == 0
    branch = tmp_path / "cooldown"
    assert main([*flags, "--run-dir", str(branch), "--steps", "10", "--train.decay_steps", "4",
                 "--resume", str(stable / "checkpoints" / "step_000006")]) == 0
    rows = [json.loads(line) for line in (branch / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [7, 8, 9, 10]
    assert [r["lr"] / TrainConfig().train.lr for r in rows] == pytest.approx([1.0, 0.7, 0.4, 0.1])  # linear from 1 to the floor
    assert len((stable / "metrics.jsonl").read_text().splitlines()) == 12
