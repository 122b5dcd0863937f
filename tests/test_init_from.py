"""--train.init_from: a fresh run that starts from a moekit run's weights (fine-tuning after pretraining): the
weights come back under any layout and placement, the optimizer, schedule and data order start afresh."""
from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import torch

from moekit.train.loop import main as train_main
from moekit.train.modelfiles import load_moekit
from tests.dist_utils import run_trainer
from tests.helpers import one_stderr_line
from tests.tiny import TINY_MODEL

SOURCE = [*TINY_MODEL, "--preset", "deepseek-tiny", "--model.num_layers", "3", "--log.progress", "off"]
# the fine-tuning run names no preset: the architecture is the checkpoint's (moekit.train.modelsource)
TUNE = [a for i, a in enumerate(TINY_MODEL) if not (a.startswith("--model.") or TINY_MODEL[i - 1].startswith("--model."))]
TUNE += ["--log.progress", "off"]


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def weights(ckpt: Path) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in load_moekit(ckpt).state_dict().items()}


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("init_from") / "pretrain"
    assert train_main([*SOURCE, "--steps", "3", "--train.seed", str(random.randrange(1 << 20)),
                       "--checkpoint.every", "3", "--run-dir", str(run)]) == 0
    return run


def test_a_fresh_run_starts_from_the_weights_alone(source, tmp_path, capsys):
    tuned = tmp_path / "tuned"
    capsys.readouterr()
    assert train_main([*TUNE, "--train.init_from", str(source), "--steps", "2", "--train.warmup_steps", "2",
                       "--train.freeze", "layers.1.*,embed.*", "--checkpoint.every", "2",
                       "--model.aux_loss_coeff", "0",  # a training-only field may change
                       "--run-dir", str(tuned)]) == 0
    out = capsys.readouterr().out
    ckpt = source / "checkpoints" / "step_000003"
    assert f"weights from {ckpt} (step 3 of its run)" in out and "model architecture from --train.init_from" in out
    assert json.loads((tuned / "config.json").read_text())["model"]["name"] == "deepseek-tiny"
    before, after = weights(ckpt), weights(tuned / "checkpoints" / "step_000002")
    frozen = [n for n in before if n.startswith(("layers.1.", "embed.")) and not n.endswith("pending_load")]
    assert len(frozen) >= 5 and all(torch.equal(after[n], before[n]) for n in frozen)  # incl. the router's bias
    assert not torch.equal(after["layers.2.attn.wq.weight"], before["layers.2.attn.wq.weight"])  # the rest trains
    m = rows(tuned)
    assert [r["step"] for r in m] == [1, 2]  # a fresh count, a fresh warmup: lr / 2 at its first step
    assert m[0]["lr"] == pytest.approx(0.5 * json.loads((tuned / "config.json").read_text())["train"]["lr"])
    # from the pretrained weights the first loss is far below a fresh model's (~ln 256 = 5.5 on bytes)
    assert m[0]["loss"] < rows(source)[0]["loss"] - 0.01


@pytest.mark.parametrize("kind", ["run", "model-file"])
def test_the_weights_come_back_under_expert_parallelism_with_replicas(source, tmp_path, kind):
    """ep2 with two redundant expert slots (replicas filled from their expert's logical row) and a rebalance after
    every step; everything frozen but the final norm: every expert row, replica or not, is the source's. From the
    run's DCP checkpoint, or from a moekit model file of it (each rank reads the tensors whole, keeps its share)."""
    from moekit.train.modelfiles import save_moekit

    origin = source
    if kind == "model-file":
        origin = tmp_path / "model.safetensors"
        save_moekit(load_moekit(source / "checkpoints" / "step_000003"), origin)
    r = run_trainer([*TUNE, "--train.init_from", str(origin), "--steps", "2", "--ep", "2",
                     "--layout.expert_replicas", "2", "--layout.rebalance_every", "1", "--train.trainable", "norm.weight",
                     "--checkpoint.every", "2", "--run-dir", str(tmp_path / "ep2")], 2,
                    env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    before = weights(source / "checkpoints" / "step_000003")
    after = weights(tmp_path / "ep2" / "checkpoints" / "step_000002")
    experts = [n for n in before if ".experts." in n]
    assert experts and all(torch.equal(after[n], before[n]) for n in experts)
    frozen = [n for n in before if n != "norm.weight" and not n.endswith("pending_load")]
    assert all(torch.equal(after[n], before[n]) for n in frozen)
    assert ("the model file" in r.stdout) == (kind == "model-file")
    assert not torch.equal(after["norm.weight"], before["norm.weight"])


@pytest.mark.parametrize("flags, words", [
    (lambda src, tmp: ["--train.init_from", str(tmp / "nope")], ["--train.init_from", "not a directory"]),
    (lambda src, tmp: ["--train.init_from", str(tmp)], ["not a moekit run directory or checkpoint"]),
    (lambda src, tmp: ["--train.init_from", str(src), "--init-from-hf", str(tmp)],
     ["--init-from-hf", "--train.init_from", "choose one"]),
    (lambda src, tmp: ["--train.init_from", str(src), "--preset", "mixtral-tiny"],
     ["computes other math than the checkpoint's", "(this run) vs"]),
    (lambda src, tmp: ["--train.init_from", str(src), "--model.mtp_layers", "1"],
     ["0 multi-token-prediction depth(s), this run 1"]),
    (lambda src, tmp: ["--run-dir", str(tmp / "other"),
                       "--train.init_from", str(tmp / "other" / "checkpoints" / "step_000001")],
     ["lies inside --run-dir"]),
    (lambda src, tmp: ["--train.init_from", str(tmp / "junk.safetensors")],
     ["--train.init_from", "junk.safetensors", "unreadable safetensors file"]),
], ids=["missing", "empty-dir", "two-sources", "other-model", "other-mtp", "inside-run-dir", "junk-file"])
def test_bad_sources_are_one_line(source, tmp_path, capsys, flags, words):
    (tmp_path / "other" / "checkpoints" / "step_000001").mkdir(parents=True)
    (tmp_path / "junk.safetensors").write_bytes(b"not safetensors at all")
    capsys.readouterr()
    assert train_main([*TUNE, "--steps", "1", "--run-dir", str(tmp_path / "run"), *flags(source, tmp_path)]) == 2
    one_stderr_line(capsys, *words)


def test_an_hf_folder_is_pointed_to_init_from_hf(tmp_path, capsys):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({"model_type": "mixtral"}))
    assert train_main([*TUNE, "--steps", "1", "--run-dir", str(tmp_path / "run"), "--preset", "mixtral-tiny",
                       "--train.init_from", str(tmp_path / "hf")]) == 2
    one_stderr_line(capsys, "not a moekit run directory or checkpoint", "--init-from-hf")
