"""--data.blend: weighted mixtures of token sets. Deterministic per seed, weights respected, bitwise resume
mid-epoch, a fixed weighted validation mix, the config-file forms, and one line for each bad blend."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from moekit.train import UserError
from moekit.train.data import BlendSampler, Sampler, blend_spec, parse_blend, weighted_shares
from moekit.train.loop import main
from moekit.train.prepare import main as prepare
from tests.tiny import TINY_MODEL


def sets(sizes, gap=1_000_000) -> list[np.ndarray]:
    """Window starts of each set at distinct offsets (as BlendSplit gives them)."""
    return [np.arange(n, dtype=np.int64) * 7 + i * gap for i, n in enumerate(sizes)]


def source_of(starts: np.ndarray, gap=1_000_000) -> np.ndarray:
    return starts // gap


def test_blend_counts_follow_the_weights_at_every_point():
    weights = [0.5, 0.3, 0.2]
    s = BlendSampler(sets([50, 40, 30]), weights, seed=1, names=["a", "b", "c"])
    drawn = np.concatenate([s.next(16) for _ in range(40)])  # 640 windows: several epochs of every set
    which = source_of(drawn)
    counts = np.zeros(3)
    for k, i in enumerate(which, 1):
        counts[i] += 1
        assert np.all(np.abs(counts - np.array(weights) * k) <= 1 + 1e-9), (k, counts)
    for b in range(40):  # every batch of 16 is within one window per set of its share
        per_batch = np.bincount(which[16 * b : 16 * (b + 1)], minlength=3)
        assert np.all(np.abs(per_batch - np.array(weights) * 16) < 2), per_batch
    # within a set, each epoch visits every window once (its own seeded permutation)
    a = drawn[which == 0]
    assert sorted(a[:50].tolist()) == sets([50])[0].tolist()
    assert s.tokens_by_source(10) == {"a": 3200, "b": 1920, "c": 1280}


def test_blend_is_deterministic_per_seed_and_independent_of_batch_size():
    starts, w = sets([30, 30]), [0.6, 0.4]
    a = np.concatenate([BlendSampler(starts, w, 3, ["a", "b"]).next(60)])
    b = BlendSampler(starts, w, 3, ["a", "b"])
    b = np.concatenate([b.next(n) for n in (1, 7, 13, 39)])
    assert np.array_equal(a, b)
    c = BlendSampler(starts, w, 4, ["a", "b"]).next(60)
    assert np.array_equal(source_of(a), source_of(c)) and not np.array_equal(a, c)  # same mix, other order
    # two sets of equal size do not walk in lockstep (each set has its own stream)
    first, second = a[source_of(a) == 0] % 1_000_000, a[source_of(a) == 1] % 1_000_000
    assert not np.array_equal(first[:20], second[:20])


def test_blend_resumes_exactly_mid_epoch_and_refuses_other_blends():
    starts, w = sets([25, 11]), [0.7, 0.3]
    a = BlendSampler(starts, w, 0, ["a", "b"])
    a.next(9)  # mid-epoch for both sets
    state = json.loads(json.dumps(a.state_dict()))  # what a checkpoint holds (plain values)
    rest = np.concatenate([a.next(5) for _ in range(12)])  # crosses epochs of both
    b = BlendSampler(starts, w, 0, ["a", "b"])
    b.load_state_dict(state)
    assert np.array_equal(rest, np.concatenate([b.next(5) for _ in range(12)]))
    for other in (BlendSampler(starts, [0.5, 0.5], 0, ["a", "b"]), BlendSampler(starts, w, 1, ["a", "b"]),
                  BlendSampler(sets([25, 12]), w, 0, ["a", "b"])):
        with pytest.raises(UserError, match="resume with the same --data.blend, --seed and --train.seq_len"):
            other.load_state_dict(state)
    with pytest.raises(UserError, match="is for one data set"):
        b.load_state_dict(Sampler(starts[0], 0).state_dict())


def test_weighted_shares():
    assert weighted_shares(8, [0.7, 0.3]) == [6, 2]
    assert weighted_shares(10, [0.98, 0.01, 0.01]) == [8, 1, 1]  # every set validated when n allows
    assert weighted_shares(2, [0.5, 0.3, 0.2]) == [1, 1, 0]
    assert sum(weighted_shares(64, [0.123, 0.456, 0.421])) == 64


def test_blend_spec_forms():
    assert parse_blend("a.bin:0.7, b.bin:3") == [("a.bin", 0.7), ("b.bin", 3.0)]
    assert blend_spec({"a.bin": 0.7, "dir/b.bin": 1}, "x") == "a.bin:0.7,dir/b.bin:1.0"
    assert blend_spec([{"path": "a.bin", "weight": 2}], "x") == "a.bin:2.0"
    assert blend_spec("", "x") == ""
    for bad, message in [("a.bin", "is not PATH:WEIGHT"), ("a.bin:x", "is not a number"), ("a.bin:0", "invalid"),
                         ("a.bin:-1", "invalid"), ("a.bin:nan", "invalid"), ("a.bin:1,a.bin:2", "listed twice"),
                         ({"a.bin": True}, "must be a number"), ([["a.bin", 1]], "each array entry")]:
        with pytest.raises(UserError, match=message):
            blend_spec(bad, "--data.blend")


# ---------------------------------------------------------------------------------------------------
# Training on a blend
# ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def blend_sets(tmp_path_factory):
    """Two byte-token sets (different text) and one with another tokenizer (bytes, no EOS)."""
    folder = tmp_path_factory.mktemp("blend")
    rng = np.random.default_rng()
    letters = np.array(list("abcdefghij klmnop\n"))
    for name, size, extra in (("a", 40_000, []), ("b", 12_000, []), ("c", 12_000, ["--no-eos"])):
        text = folder / f"{name}.txt"
        text.write_text("\n".join("".join(rng.choice(letters, size=80)) for _ in range(size // 80)))
        assert prepare([str(text), "--docs-per-line", "--tokenizer", "bytes", "-o", str(folder / f"{name}.bin"),
                        "--quiet", *extra]) == 0
    return folder


def run(run_dir: Path, *flags: str) -> int:
    return main([*TINY_MODEL, "--run-dir", str(run_dir), *flags])


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_blend_trains_and_resumes_bitwise(blend_sets, tmp_path):
    spec = f"{blend_sets / 'a.bin'}:0.75,{blend_sets / 'b.bin'}:0.25"
    flags = ["--data.blend", spec, "--steps", "8", "--checkpoint.every", "4", "--eval.every", "4"]
    straight = tmp_path / "straight"
    assert run(straight, *flags) == 0
    rows = metrics(straight)
    assert rows[-1]["tokens_by_source"] == {str(blend_sets / "a.bin"): 24 * 32, str(blend_sets / "b.bin"): 8 * 32}
    config = json.loads((straight / "config.json").read_text())
    assert config["model"]["vocab_size"] == 257 and config["data"]["blend"] == spec
    assert json.loads((straight / "tokenizer_info.json").read_text())["eos_id"] == 256
    resumed = tmp_path / "resumed"
    shutil.copytree(straight, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_000008")
    assert run(resumed, *flags, "--resume") == 0
    a, b = metrics(straight), metrics(resumed)
    assert [r["loss"] for r in a] == [r["loss"] for r in b] and [r.get("val_loss") for r in a] == [
        r.get("val_loss") for r in b]
    assert [r["tokens_by_source"] for r in a] == [r["tokens_by_source"] for r in b]


def test_blend_from_a_config_file_and_validation_mix(blend_sets, tmp_path, capsys):
    from moekit.train.cli import parse_args
    from moekit.train.data import load_data

    a, b = blend_sets / "a.bin", blend_sets / "b.bin"
    for body in (f'[data.blend]\n"{a}" = 3\n"{b}" = 1\n',
                 f'[data]\nblend = [{{path = "{a}", weight = 3}}, {{path = "{b}", weight = 1}}]\n'):
        cfg_file = tmp_path / "c.toml"
        cfg_file.write_text(body)
        cfg, _ = parse_args(["--config", str(cfg_file), *TINY_MODEL])
        assert cfg.data.blend == f"{a}:3.0,{b}:1.0"
    split = load_data(cfg.data, cfg.model.vocab_size).split(32, 0.05)
    val = split.validation(8)
    offset_b = split.tokens.offsets[1]
    assert (val < offset_b).sum() == 6 and (val >= offset_b).sum() == 2  # the fixed 3:1 mix
    assert np.array_equal(val, split.validation(8))
    x = split.tokens[val[:, None] + np.arange(4)]
    assert x.shape == (8, 4) and x.max() < 257


def test_bad_blends(blend_sets, tmp_path, capsys):
    a, b, c = (str(blend_sets / f"{n}.bin") for n in "abc")
    cases = [
        ([f"{a}:0.5,{b}:0"], "weight 0.0 of"),
        ([f"{a}:1,{tmp_path / 'gone.bin'}:1"], f"--data.blend: {tmp_path / 'gone.bin'}: no such file"),
        ([f"{a}:1,{c}:1"], "were not prepared with the same tokenizer"),
        ([f"{a}:1", "--data.path", a], "--data.blend and --data.path are both set"),
        ([f"{a}:1,{b}:1", "--model.vocab_size", "256"], "its tokenizer has vocab_size 257"),
    ]
    for flags, message in cases:
        rc = run(tmp_path / "r", "--steps", "1", "--data.blend", *flags)
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and len(err) == 1 and err[0].startswith("train.py: error: ") and message in err[0], err
    assert not (tmp_path / "r").exists()
    # resuming with other weights: refused in one line
    first = tmp_path / "first"
    assert run(first, "--data.blend", f"{a}:1,{b}:1", "--steps", "2", "--checkpoint.every", "1") == 0
    capsys.readouterr()
    assert run(first, "--data.blend", f"{a}:2,{b}:1", "--steps", "3", "--resume") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "data.blend" in err[0] and "counts windows drawn from each set" in err[0], err
    assert f"resume with --data.blend {a}:1.0,{b}:1.0" in err[0], err


def test_validation_loss_per_set_under_one_process_and_two_data_ranks(blend_sets, tmp_path):
    """A 3:1 blend's 8 validation windows are 6 of a and 2 of b: val_loss_by_source holds each set's loss on its
    share (b's equal to a loss computed here from the checkpoint on b's windows), val_loss is their window-weighted
    mean, and two data-parallel ranks get the same numbers."""
    import torch
    import torch.nn.functional as F

    from moekit.train.config import DataSection
    from moekit.train.data import load_data
    from moekit.train.inference import load_for_inference
    from moekit.train.tokens import read_token_file
    from tests.dist_utils import run_trainer

    a, b = str(blend_sets / "a.bin"), str(blend_sets / "b.bin")
    flags = ["--data.blend", f"{a}:3,{b}:1", "--steps", "3", "--checkpoint.every", "3", "--log.progress", "off"]
    assert run(tmp_path / "one", *flags) == 0
    last = metrics(tmp_path / "one")[-1]
    by = last["val_loss_by_source"]
    assert sorted(by) == sorted([a, b])
    assert last["val_loss"] == pytest.approx((6 * by[a] + 2 * by[b]) / 8, rel=1e-6)
    split = load_data(DataSection(blend=f"{a}:3,{b}:1"), 257).split(32, 0.05)
    windows = split.parts[1].validation(2)  # b's 2 windows, at positions in b.bin
    model, _, _ = load_for_inference(tmp_path / "one", require_tokenizer=False, warn=lambda _m: None)
    ids = np.asarray(read_token_file(b)[0], dtype=np.int64)
    x = torch.from_numpy(ids[windows[:, None] + np.arange(33)])
    with torch.no_grad():
        direct = F.cross_entropy(model(x[:, :-1]).flatten(0, 1).float(), x[:, 1:].flatten()).item()
    assert by[b] == pytest.approx(direct, rel=1e-5)
    r = run_trainer([*TINY_MODEL, "--run-dir", str(tmp_path / "dp2"), *flags], nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    two = metrics(tmp_path / "dp2")[-1]
    assert two["val_loss_by_source"] == pytest.approx(by, rel=1e-5)
    assert two["val_loss"] == pytest.approx(last["val_loss"], rel=1e-5)


def test_per_set_values_become_one_scalar_each(tmp_path):
    """metrics.jsonl's per-set dicts reach TensorBoard (and W&B) as one scalar per set, named by file name (the
    whole path where two sets share a name)."""
    pytest.importorskip("tensorboard")
    import torch
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from moekit.train.monitor import Monitor, source_scalars

    assert source_scalars({"tokens_by_source": {"x/a.bin": 5, "y/a.bin": 7}}) == {
        "tokens_by_source/x/a.bin": 5, "tokens_by_source/y/a.bin": 7}
    m = Monitor(str(tmp_path), torch.device("cpu"), 2, 0, 100, True, "off")
    for step in (1, 2):
        m.step({"step": step, "loss": 1.0, "aux_loss": 0.0, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 1.0,
                "mem_gb": 0.1, "tokens_by_source": {"d/a.bin": 10 * step, "d/b.bin": 3 * step},
                **({"val_loss_by_source": {"d/a.bin": 2.5, "d/b.bin": 4.0}} if step == 2 else {})})
    m.close()
    ea = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0})
    ea.Reload()
    assert [e.value for e in ea.Scalars("tokens_by_source/a.bin")] == [10, 20]
    assert [(e.step, e.value) for e in ea.Scalars("val_loss_by_source/b.bin")] == [(2, 4.0)]


def test_the_loss_figure_draws_each_sets_validation_curve():
    pytest.importorskip("matplotlib")
    from moekit.train import loadplots

    metrics = [{"step": s, "loss": 3.0 / s, "val_loss": 2.0 / s,
                "val_loss_by_source": {"data/web.bin": 2.2 / s, "data/code.bin": 1.5 / s}} for s in (2, 4)]
    fig = loadplots.fig_loss([loadplots.Series("run", None, metrics)])
    lines = {ln.get_label(): ln for ln in fig.axes[1].get_lines()}
    assert set(lines) == {"run", "run: web.bin", "run: code.bin"}
    assert list(lines["run: code.bin"].get_ydata()) == pytest.approx([0.75, 0.375])
    assert lines["run: web.bin"].get_linestyle() != lines["run"].get_linestyle()


def test_moekit_eval_reports_each_sets_loss_as_the_trainer_does(blend_sets, tmp_path):
    """moekit-eval on a blend run, with the trainer's windows (--batches E/B --batch-size B): the loss per set equals
    the run's val_loss_by_source at the checkpoint's step, and the sets' tokens add up to the whole."""
    from moekit.train.evaluate import main as evaluate

    a, b = str(blend_sets / "a.bin"), str(blend_sets / "b.bin")
    assert run(tmp_path / "run", "--data.blend", f"{a}:3,{b}:1", "--steps", "2", "--checkpoint.every", "2",
               "--log.progress", "off") == 0
    want = metrics(tmp_path / "run")[-1]["val_loss_by_source"]
    out = tmp_path / "eval.json"
    assert evaluate([str(tmp_path / "run"), "--batches", "2", "--batch-size", "4", "--out", str(out), "--quiet"]) == 0
    got = json.loads(out.read_text())
    assert {k: v["loss"] for k, v in got["by_source"].items()} == pytest.approx(want, rel=1e-5)
    assert sum(v["tokens"] for v in got["by_source"].values()) == got["tokens"] == 8 * 32
