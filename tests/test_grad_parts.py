"""The gradient norm by part (moekit.train.grad_parts, metrics.jsonl grad_norm_by_part): every parameter of every
preset in its part, the parts' norms against a float64 sum over the parameters named in each, the trainer's rows
(their squares add up to grad_norm). Layouts (TP x FSDP x EP, pipelines, replicated experts) are compared with one
process in tests/test_train_distributed.py and tests/test_placement.py."""
from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from moekit.comm.topology import Layout
from moekit.models.config import PRESETS, preset
from moekit.models.transformer import Transformer, build_model, meta_device
from moekit.train.distributed import Dist
from moekit.train.grad_parts import PARTS, part_of, present, tag
from moekit.train.loop import main as train_main
from tests.tiny import TINY_MODEL

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


@pytest.mark.parametrize("name", sorted(n for n in PRESETS if n.endswith("-tiny")))
def test_every_parameter_of_every_tiny_preset_has_its_part(name):
    cfg = preset(name)
    if cfg.num_moe_layers and not cfg.mtp_layers:
        cfg = dataclasses.replace(cfg, mtp_layers=1)
    with meta_device():
        model = Transformer(cfg)
    parts = {n: part_of(n) for n, _ in model.named_parameters()}
    assert "other" not in parts.values(), [n for n, p in parts.items() if p == "other"]
    for n, part in parts.items():
        if n.startswith("mtp."):
            assert part == "mtp", n
        elif n in ("embed.weight", "lm_head.weight"):
            assert part == "embedding", n
        elif n.rsplit(".", 2)[-2].endswith("norm"):
            assert part == "norms", n
        elif ".ffn.router." in n:
            assert part == "router", n
        elif ".ffn.experts." in n:
            assert part == "experts", n
    assert {"router", "experts", "attention", "norms", "embedding", "mtp"} <= set(present(model))
    # the names the parallel recipe's wrappers add do not change a part
    assert part_of("layers.3._orig_mod.ffn._checkpoint_wrapped_module.router.weight") == "router"


def test_the_parts_norms_are_the_named_parameters_norms():
    """Random gradients on deepseek-tiny (routers, routed and shared experts, dense MLP, MTP): each part's norm from
    Dist.clip_grad_norm (one process) against a float64 sum over the parameters whose names put them in it; the
    total and the clipping are torch's, as without parts."""
    cfg = dataclasses.replace(preset("deepseek-tiny"), mtp_layers=1, first_dense_layers=1)
    model = build_model(cfg, seed=0)
    tag(model)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * torch.rand(()) * 3
    want = {part: math.sqrt(sum(p.grad.double().square().sum().item() for n, p in model.named_parameters()
                                if part_of(n) == part)) for part in PARTS}
    dist = Dist.setup(Layout(), cfg.num_experts, torch.device("cpu"), None, 60.0)
    twin = build_model(cfg, seed=0)
    for p, q in zip(model.parameters(), twin.parameters()):
        q.grad = p.grad.clone()
    total, by_part = dist.clip_grad_norm(list(model.parameters()), 1.0, len(PARTS))
    assert by_part.shape == (len(PARTS),)
    for part, value in zip(PARTS, by_part.tolist()):
        assert value == pytest.approx(want[part], rel=1e-5), part
    assert {p for p in PARTS if want[p] > 0} >= {"router", "experts", "shared_experts", "mlp", "mtp"}
    plain = dist.clip_grad_norm(list(twin.parameters()), 1.0)  # without parts: the same total, the same clipping
    assert torch.equal(total, plain)
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), twin.parameters()))
    assert math.sqrt(sum(v * v for v in by_part.tolist())) == pytest.approx(total.item(), rel=1e-5)


def test_the_trainer_writes_each_steps_parts(tmp_path):
    run = tmp_path / "run"
    assert train_main([*TINY_MODEL, "--preset", "deepseek-tiny", "--steps", "3", "--run-dir", str(run),
                       "--checkpoint.every", "0"]) == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        parts = r["grad_norm_by_part"]
        assert list(parts) == [p for p in PARTS if p in parts] and {"router", "experts", "attention"} <= set(parts)
        assert math.sqrt(sum(v * v for v in parts.values())) == pytest.approx(r["grad_norm"], rel=1e-5)
    from moekit.train import heatmap  # the report draws them: every part of the run, and its router's

    out = tmp_path / "r.html"
    assert heatmap.main([str(run), "--html", str(out)]) == 0
    page = out.read_text()
    section = page[page.index('id="gradients"'):]
    assert "Gradient norm by part" in section[:300] and "<img" in section[:2000]
