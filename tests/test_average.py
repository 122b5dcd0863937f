"""moekit-convert average (moekit.train.averaging): the weighted mean of a run's checkpoints against the mean
computed here in float64 from each checkpoint loaded on its own, the HF folder it writes, and bad input; the
milestone checkpoints (--checkpoint.keep_every) a run keeps for it."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from moekit.train.convert import main as convert_main
from moekit.train.loop import main as train_main
from moekit.train.modelfiles import load_moekit
from tests.tiny import TINY_MODEL

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A tiny run keeping all 4 of its checkpoints (router expert-bias buffers included: deepseek-tiny)."""
    run = tmp_path_factory.mktemp("avg") / "run"
    assert train_main([*TINY_MODEL, "--preset", "deepseek-tiny", "--steps", "4", "--checkpoint.every", "1",
                       "--checkpoint.keep", "4", "--run-dir", str(run)]) == 0
    return run


def one_line(capsys, rc: int) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and " error: " in err[0], err  # moekit-convert (installed) or convert.py
    return err[0]


def test_the_average_is_the_weighted_mean_of_the_checkpoints(run, tmp_path, capsys):
    steps = sorted((run / "checkpoints").iterdir())[-3:]
    weights = [random.uniform(0.1, 3) for _ in steps]
    out = tmp_path / "avg.safetensors"
    argv = ["average", str(run), "--last", "3", "-o", str(out), "--weights", ",".join(map(repr, weights))]
    assert convert_main(argv) == 0
    assert f"the mean of 3 sources ({steps[0]} x" in capsys.readouterr().out
    models = [load_moekit(s) for s in steps]
    got = load_moekit(out).state_dict()
    floats = 0
    for name, t in got.items():
        if not t.is_floating_point():
            assert torch.equal(t, models[-1].state_dict()[name]), name
            continue
        want = sum(w * m.state_dict()[name].double() for w, m in zip(weights, models)) / sum(weights)
        torch.testing.assert_close(t.double(), want, rtol=1e-6, atol=1e-7)
        floats += 1
    assert any("expert_bias" in name for name in got) and floats > 10
    # the same three as explicit sources, equal weights, to an HF folder: it reloads with the same logits
    folder = tmp_path / "hf"
    assert convert_main(["average", *map(str, steps), "-o", str(folder), "--verify"]) == 0
    printed = capsys.readouterr().out
    assert "verified: average ->" in printed and f"tokenizer from {run}" in printed
    assert (folder / "config.json").is_file()


@pytest.mark.parametrize("argv, expected", [
    (["{run}/checkpoints/step_000004", "-o", "{tmp}/a.pt"], "average needs at least two sources"),
    (["{run}", "--last", "5", "-o", "{tmp}/a.pt"], "holds 4 checkpoint(s) that verify"),
    (["{run}", "--last", "1", "-o", "{tmp}/a.pt"], "--last 1 is invalid"),
    (["{run}", "{run}", "--last", "2", "-o", "{tmp}/a.pt"], "--last 2 takes one moekit-train run directory"),
    (["{run}", "--last", "2", "--weights", "1", "-o", "{tmp}/a.pt"], "has 1 weight(s) for 2 sources"),
    (["{run}", "--last", "2", "--weights", "1,-1", "-o", "{tmp}/a.pt"], "each must be a finite number >= 0"),
    (["{run}", "--last", "2", "--weights", "0,0", "-o", "{tmp}/a.pt"], "not all 0"),
    (["{run}", "--last", "2", "--weights", "a,b", "-o", "{tmp}/a.pt"], "not numbers"),
    (["{run}", "--last", "2", "-o", "{run}"], "OUT"),
])
def test_bad_average_input_is_one_line(run, tmp_path, capsys, argv, expected):
    argv = [a.format(run=run, tmp=tmp_path) for a in argv]
    line = one_line(capsys, convert_main(["average", *argv]))
    assert expected in line, line


def test_checkpoints_of_another_model_are_refused(run, tmp_path, capsys):
    other = tmp_path / "other"
    assert train_main([*TINY_MODEL, "--preset", "deepseek-tiny", "--model.hidden_size", "48", "--steps", "1",
                       "--checkpoint.every", "1", "--run-dir", str(other)]) == 0
    capsys.readouterr()
    line = one_line(capsys, convert_main(["average", str(run / "checkpoints" / "step_000004"),
                                          str(other / "checkpoints" / "step_000001"), "-o", str(tmp_path / "a.pt")]))
    assert "is another model than" in line and "hidden_size 32 vs 48" in line


def test_milestone_checkpoints_outlive_the_rotation(tmp_path, capsys):
    """--checkpoint.keep 1 --checkpoint.keep_every 2, a save every step: steps 2 and 4 stay beside the newest, 5;
    resumed to step 8, the milestones 6 and 8 join them and 5 goes."""
    run = tmp_path / "run"
    flags = [*TINY_MODEL, "--checkpoint.every", "1", "--checkpoint.keep", "1", "--checkpoint.keep_every", "2",
             "--run-dir", str(run)]
    assert train_main([*flags, "--steps", "5"]) == 0
    names = lambda: sorted(p.name for p in (run / "checkpoints").iterdir())  # noqa: E731
    assert names() == ["step_000002", "step_000004", "step_000005"]
    assert train_main([*flags, "--steps", "8", "--resume"]) == 0
    assert names() == ["step_000002", "step_000004", "step_000006", "step_000008"]
    capsys.readouterr()
    assert train_main([*flags, "--checkpoint.keep_every", "3", "--checkpoint.every", "2", "--steps", "1"]) == 2
    assert "--checkpoint.keep_every=3 is invalid" in capsys.readouterr().err
