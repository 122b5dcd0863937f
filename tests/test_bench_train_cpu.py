"""tools/bench/cpu_train.py measures the trainer's own loop on a tiny config (this tree; --baseline's git
worktree plumbing on its own: a second worker would double the test's time)."""
import json
import subprocess

import pytest
from moekit.bench import cpu_train

from tests.tiny import TINY_MODEL


def test_cpu_train_smoke(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert cpu_train.main(["--rounds", "1", "--steps", "2", "--warmup", "1", "--json", str(out),
                           "--env", "OMP_NUM_THREADS=1", "--", *TINY_MODEL]) == 0
    data = json.loads(out.read_text())
    assert data["env"] == {"OMP_NUM_THREADS": "1"} and data["threads"] == 1  # --env reached the worker (tests: 2)
    assert data["tokens_per_step"] == 4 * 32  # --batch-size 4 x --train.seq_len 32
    assert set(data["trees"]) == {"current"}
    for tree in data["trees"].values():
        phases = tree["phases_ms"]
        assert set(phases) == set(cpu_train.PHASES) and min(phases.values()) >= 0
        assert sum(phases.values()) == pytest.approx(tree["step_ms"], rel=1e-6)
        assert tree["tokens_per_s"] == pytest.approx(data["tokens_per_step"] / tree["step_ms"] * 1e3)
        # the profiler labels reached the trainer's model: the work is found where it ran, not in other_model
        assert all(phases[p] > 0 for p in ("router", "experts", "attention", "norm", "head_loss", "optimizer"))
        assert tree["fwd_bwd_split"]["other_model"] < 0.5
        assert tree["minor_faults_per_step"] >= 0
    assert "tokens/s" in capsys.readouterr().out


def test_baseline_tree_is_importable_and_removed(tmp_path):
    with cpu_train.git_worktree("HEAD", tmp_path) as tree:
        shim = cpu_train.link_tree(tree, tmp_path / "shim")
        assert (shim / "moekit" / "train" / "loop.py").resolve() == (tree / "train" / "loop.py").resolve()
        assert (shim / "moekit" / "bench" / "cpu_train.py").resolve() == cpu_train.REPO / "tools/bench/cpu_train.py"
    assert not tree.exists()
    listed = subprocess.run(["git", "worktree", "list"], cwd=cpu_train.REPO, capture_output=True, text=True).stdout
    assert str(tree) not in listed


@pytest.mark.parametrize("argv, words", [(["--rounds", "0"], "--rounds 0"),
                                         (["--", "--batch-size", "-3"], "trainer flags --batch-size -3"),
                                         (["--env", "OMP_WAIT_POLICY"], "expected VAR=VALUE")])
def test_bad_arguments_are_one_line(argv, words, capsys):
    with pytest.raises(SystemExit):
        cpu_train.main(argv)
    assert words in capsys.readouterr().err
