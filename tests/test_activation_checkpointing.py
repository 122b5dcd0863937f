"""Activation checkpointing: same losses and expert-load records, less saved activation memory."""
import json
import sys
from pathlib import Path

import pytest
import torch

from moekit.models.config import PRESETS
from moekit.models.parallelize import apply_activation_checkpointing
from moekit.models.transformer import build_model
from tests.test_train_distributed import TINY, losses, run

ROOT = Path(__file__).resolve().parents[1]
from moekit.train.loop import main
from moekit.train.records import load_rows


def saved_bytes(model, tokens) -> int:
    """Bytes autograd keeps for backward during one forward (the activation memory)."""
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens).float().square().mean().backward()
    return total


def test_checkpointing_saves_activation_memory_and_keeps_gradients():
    import dataclasses

    cfg = dataclasses.replace(PRESETS["mixtral-tiny"], num_layers=2)
    tokens = torch.randint(0, cfg.vocab_size, (2, 64))
    sizes, grads = {}, {}
    for mode in ("none", "ffn", "full"):
        model = build_model(cfg, seed=1)
        apply_activation_checkpointing(model, mode)
        model.train()
        sizes[mode] = saved_bytes(model, tokens)
        grads[mode] = [p.grad.clone() for p in model.parameters()]
    assert sizes["full"] < sizes["ffn"] < sizes["none"], sizes
    for mode in ("ffn", "full"):
        for a, b in zip(grads[mode], grads["none"]):
            torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="'some'"):
        apply_activation_checkpointing(build_model(cfg), "some")


def _records(run_dir: Path):
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    load = load_rows(run_dir)
    return [(m["loss"], m["grad_norm"]) for m in metrics], load


def test_same_losses_and_load_records_with_and_without_checkpointing(tmp_path):
    """Recomputed forwards are not counted twice: the expert-load records are identical."""
    out = {}
    for mode in ("none", "full", "ffn"):
        d = tmp_path / mode
        assert main([*TINY, "--steps", "3", "--run-dir", str(d), "--checkpoint.every", "0",
                     "--train.activation_checkpointing", mode]) == 0
        out[mode] = _records(d)
    assert out["full"] == out["none"] and out["ffn"] == out["none"]


def test_checkpointing_under_expert_parallelism_matches_one_process(tmp_path):
    single = tmp_path / "single"
    assert main([*TINY, "--steps", "3", "--run-dir", str(single), "--checkpoint.every", "0"]) == 0
    r = run(["--ep", "2", "--steps", "3", "--run-dir", str(tmp_path / "ep"), "--checkpoint.every", "0",
             "--train.activation_checkpointing", "full", *TINY], nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    assert losses(tmp_path / "ep") == pytest.approx(losses(single), rel=1e-5, abs=1e-6)
