"""models.init: values that depend on (seed, name, position) only, so each rank fills just what it holds.

References are computed another way: the whole tensor drawn at once and sliced, and the one-process model built
by build_model, against shards filled on real gloo ranks after the model was parallelised on the meta device.
"""
from __future__ import annotations

import dataclasses
import random
from types import SimpleNamespace

import pytest
import torch

from moekit.models import init as init_mod
from moekit.models.config import PRESETS
from moekit.models.init import canonical_name, normal_values, tile_shape
from moekit.models.transformer import Transformer, build_model, meta_device
from tests.dist_utils import run_ranks


@pytest.fixture
def small_tiles(monkeypatch):
    monkeypatch.setattr(init_mod, "TILE", 64)  # many tiles per tensor even at test sizes


def whole(name, shape, std=1.0, seed=5):
    return normal_values(seed, name, shape, tuple(range(n) for n in shape), std)


@pytest.mark.parametrize("shape", [(7,), (300,), (5, 9), (40, 33), (3, 6, 10), (4, 37, 5)])
def test_any_box_is_the_slice_of_the_whole(small_tiles, shape):
    full = whole("w", shape)
    rng = random.Random(len(shape) * 100 + shape[0])
    for _ in range(20):
        box = []
        for n in shape:
            a = rng.randrange(n)
            box.append(range(a, rng.randrange(a + 1, n + 1)))
        got = normal_values(5, "w", shape, tuple(box), 1.0)
        assert torch.equal(got, full[tuple(slice(r.start, r.stop) for r in box)]), box
    rows = [rng.randrange(shape[0]) for _ in range(6)]  # an expert placement: any rows, repeated too
    got = normal_values(5, "w", shape, (range(6), *(range(n) for n in shape[1:])), 1.0, rows)
    assert torch.equal(got, full[rows])


def test_values_depend_on_seed_name_and_std_only(small_tiles):
    a = whole("layers.0.attn.wq.weight", (40, 33))
    assert torch.equal(a, whole("layers.0.attn.wq.weight", (40, 33)))
    assert not torch.equal(a, whole("layers.1.attn.wq.weight", (40, 33)))
    assert not torch.equal(a, whole("layers.0.attn.wq.weight", (40, 33), seed=6))
    torch.testing.assert_close(whole("x", (40, 33), std=0.02), whole("x", (40, 33)) * 0.02)
    tiles = {tuple(t.flatten()[:3].tolist()) for t in a.split(tile_shape((40, 33))[0])}
    assert len(tiles) > 1  # the tiles are distinct draws, not one draw repeated
    assert abs(float(whole("big", (1000, 100)).std()) - 1) < 0.01
    assert canonical_name("layers.0._orig_mod.attn._checkpoint_wrapped_module.wq.weight") == "layers.0.attn.wq.weight"


def test_model_init_is_order_and_device_free():
    """build_model fills every parameter and buffer; adding MTP depths leaves the main weights as they were; a
    placement's logical rows give each slot its expert's values."""
    cfg = PRESETS["deepseek-tiny"]
    model = build_model(cfg, seed=3)
    more = build_model(dataclasses.replace(cfg, mtp_layers=2), seed=3)
    assert all(torch.equal(v, more.state_dict()[k]) for k, v in model.state_dict().items())
    assert all(torch.isfinite(v).all() for v in model.state_dict().values())
    layer = model.layers[1].ffn  # a stand-in dispatcher: slot i holds logical expert rows[i]
    rows = [3, 1, 1, 0] + list(range(4, layer.num_experts))
    placed = build_model(cfg, seed=3)
    placed.layers[1].ffn.dispatcher = SimpleNamespace(placement=object(), local_expert_ids=rows)
    placed.init_weights(3)
    assert torch.equal(placed.layers[1].ffn.experts.w_in, layer.experts.w_in[rows])


CASES = {  # (layout degrees, model overrides) on 4 ranks
    "tp2-fsdp2-ep2": (dict(tp=2, fsdp=2, ep=2), dict(attention="mla", kv_lora_rank=16, q_lora_rank=24,
                                                       qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)),
    "pp2-fsdp2-ep2": (dict(pp=2, fsdp=2, ep=2), dict(tie_embeddings=True, mtp_layers=1)),
}


def _sharded_rank(rank, world):
    from moekit.comm.topology import Layout, Topology
    from moekit.models.init import init_weights
    from moekit.models.parallelize import parallelize
    from moekit.models.pipeline import build_pipeline

    for case, (degrees, over) in CASES.items():
        cfg = dataclasses.replace(PRESETS["deepseek-tiny"], num_layers=2, **over)
        topo = Topology(Layout(**degrees), rank, world).build()
        with meta_device():
            model = Transformer(cfg)
        if topo.layout.pp > 1:
            model = build_pipeline(model, topo, device="cpu").model
        parallelize(model, topo)
        model.to_empty(device="cpu")
        init_weights(model, seed=11)
        ref = build_model(cfg, seed=11).state_dict()
        for name, value in model.state_dict().items():
            full = value.full_tensor() if hasattr(value, "full_tensor") else value
            assert torch.equal(full, ref[name]), (case, name)


def test_sharded_init_equals_one_process():
    """Parallelised on the meta device, moved with to_empty and filled rank by rank: every tensor, gathered, is
    the one-process model's (MLA under TP, FSDP over EP's experts; a pipeline's tied head and MTP depth, whose
    embedding replica on the last stage needs no copy)."""
    run_ranks(_sharded_rank, 4)
