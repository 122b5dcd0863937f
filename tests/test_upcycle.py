"""Dense-to-MoE upcycling (models/upcycle.py, train/upcycle.py, moekit-train --init-from-dense).

The done-criterion: an upcycled model at step 0 gives the dense model's logits (fp32, ~1e-5) on fresh random
tokens, for every granularity, router score and activation; and the construction is what makes it so (random
router rows with g > 1 move the output). The dense models use init_std 0.1 so that the FFNs move the logits
by O(1): a wrong expert, weight or scale shows up far above the tolerance.
"""
from __future__ import annotations

import json

import pytest
import torch

from moekit.models.config import ModelConfig
from moekit.models.transformer import build_model
from moekit.models.upcycle import check_upcycle_config, dense_mismatches, upcycle, upcycle_into, upcycled_config
from moekit.moe import MoELayer
from tests.tiny import TINY_MODEL

DENSE = dict(num_experts=0, vocab_size=256, hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2,
             ffn_hidden_size=64, max_seq_len=32, init_std=0.1)


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


def dense_model(seed: int = 3, **fields) -> torch.nn.Module:
    return build_model(ModelConfig(**{**DENSE, **fields}), seed=seed).eval()


def tokens(cfg: ModelConfig, batch: int = 3, seq: int = 24) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (batch, seq))  # fresh each call: no fixed generator


def assert_same_logits(dense, moe) -> None:
    x = tokens(dense.config)
    with torch.no_grad():
        want, got = dense(x), moe.eval()(x)
    assert want.abs().max() > 1.0  # the check has something to see
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------------
# The construction
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
@pytest.mark.parametrize("g,experts,top_k", [(1, 4, 2), (1, 4, 1), (2, 8, 2), (2, 4, 4), (4, 8, 4)])
def test_upcycled_model_gives_the_dense_logits(activation, score, g, experts, top_k):
    dense = dense_model(activation=activation)
    cfg = upcycled_config(dense.config, experts, top_k, g, router_options={"score": score})
    assert cfg.moe_ffn_hidden_size == 64 // g and cfg.num_moe_layers == 3
    moe = upcycle(dense, cfg, g, seed=7)
    assert_same_logits(dense, moe)
    ffn = moe.layers[0].ffn
    rows = ffn.router.weight.view(experts // g, g, -1)
    assert torch.equal(rows, rows[:, :1].expand_as(rows))  # identical within a copy ...
    assert not torch.equal(rows[0, 0], rows[-1, 0]) or experts == g  # ... random between copies


@pytest.mark.parametrize("fields", [
    # DeepSeek-like: sigmoid, group-limited, aux-loss-free bias, scaling 2.5, shared expert, first layer dense
    dict(first_dense_layers=1, shared_ffn_hidden_size=48,
         router_options={"score": "sigmoid", "num_groups": 2, "group_top_k": 1, "bias_update_rate": 1e-3,
                         "scaling": 2.5}),
    # Switch-like layer pattern with Qwen2-MoE's gated shared expert, softmax
    dict(moe_every=2, shared_ffn_hidden_size=16, shared_expert_gate=True),
])
def test_layer_patterns_shared_experts_groups_and_scaling_keep_the_logits(fields):
    dense = dense_model()
    cfg = upcycled_config(dense.config, 8, 4, 2, **fields)
    moe = upcycle(dense, cfg, 2, seed=1)
    assert [isinstance(b.ffn, MoELayer) for b in moe.layers] == [cfg.is_moe_layer(i) for i in range(3)]
    assert_same_logits(dense, moe)
    for b in moe.layers:
        if isinstance(b.ffn, MoELayer):
            assert b.ffn.shared_expert.w_out.weight.abs().sum() == 0  # zero output: starts silent
            assert b.ffn.shared_expert.w_up.weight.std() > 0  # but its input projections are drawn


def test_gpt_oss_style_biases_start_at_zero_and_keep_the_logits():
    """An MoE with a gate bias and expert biases (gpt-oss's, moe_ffn_bias / gate_bias) upcycles from a bias-free
    dense MLP with those biases zero, whatever init left in them, and the dense logits."""
    dense = dense_model()
    cfg = upcycled_config(dense.config, 8, 4, 2, moe_ffn_bias=True,
                          router_options={"normalize": True, "gate_bias": True})
    target = build_model(cfg, seed=3)
    with torch.no_grad():
        for b in target.layers:
            for t in (b.ffn.router.bias, b.ffn.experts.b_in, b.ffn.experts.b_out):
                t.normal_()  # a stale value the upcycle must overwrite
    moe = upcycle_into(target, dense, 2, seed=1)
    assert_same_logits(dense, moe)
    for b in moe.layers:
        assert all(t.abs().sum() == 0 for t in (b.ffn.router.bias, b.ffn.experts.b_in, b.ffn.experts.b_out))


def test_random_router_rows_would_change_the_output():
    """With g > 1 the identical router rows within a copy are what makes it exact; with g = 1 any rows are."""
    dense = dense_model()
    x = tokens(dense.config)
    with torch.no_grad():
        want = dense(x)
        for g, experts in ((2, 8), (1, 4)):
            moe = upcycle(dense, upcycled_config(dense.config, experts, 2 * g, g), g).eval()
            torch.testing.assert_close(moe(x), want, rtol=1e-5, atol=1e-5)
            for b in moe.layers:
                b.ffn.router.weight.normal_(0.0, 0.1)  # distinct rows: a token may take shards of different copies
            err = (moe(x) - want).abs().max().item()
            assert (err > 0.05) if g > 1 else (err < 1e-5), (g, err)


def test_router_seed_and_experts_are_the_dense_mlp():
    dense = dense_model()
    cfg = upcycled_config(dense.config, 4, 2, 2)
    a, b, c = (upcycle(dense, cfg, 2, seed=s) for s in (0, 0, 1))
    assert torch.equal(a.layers[1].ffn.router.weight, b.layers[1].ffn.router.weight)
    assert not torch.equal(a.layers[1].ffn.router.weight, c.layers[1].ffn.router.weight)
    mlp, experts = dense.layers[1].ffn, a.layers[1].ffn.experts
    # expert e = shard e % 2: [gate | up] columns of the shard's units, output rows scaled by g = 2
    torch.testing.assert_close(experts.w_in[3], torch.cat([mlp.w_gate.weight[32:].t(), mlp.w_up.weight[32:].t()], 1))
    torch.testing.assert_close(experts.w_out[2], 2 * mlp.w_out.weight[:, :32].t())
    assert torch.equal(a.embed.weight, dense.embed.weight) and torch.equal(a.layers[2].attn.wq.weight,
                                                                           dense.layers[2].attn.wq.weight)


@pytest.mark.parametrize("activation,g,drop", [("swiglu", 2, 0.5), ("gelu", 1, 0.25), ("swiglu", 1, 1.0)])
def test_drop_upcycling_reinitialises_a_share_of_each_experts_units(activation, g, drop):
    """Drop-upcycling: each expert re-initialises floor(drop * f) of its f hidden units, a random set per expert:
    those units' gate / up columns of w_in and row of w_out (scaled by g, as the kept rows), drawn with the dense
    tensor's mean and std; everything else is the plain upcycle's, bit for bit."""
    dense = dense_model(activation=activation, num_layers=2)
    cfg = upcycled_config(dense.config, 8, 2 * g, g)
    plain, dropped = upcycle(dense, cfg, g, seed=5), upcycle(dense, cfg, g, seed=5, drop=drop)
    a, b = plain.state_dict(), dropped.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a if ".experts." not in k)
    f, gated = cfg.moe_ffn_hidden_size, activation == "swiglu"
    for i in range(2):
        mlp = dense.layers[i].ffn
        w_in, w_out = (b[f"layers.{i}.ffn.experts.{n}"] for n in ("w_in", "w_out"))
        changed = a[f"layers.{i}.ffn.experts.w_in"] != w_in  # [E, H, gate | up]
        sets = []
        for e in range(8):
            units = changed[e].any(dim=0).nonzero().flatten()
            if gated:  # the same units of the gate and of the up projection
                assert torch.equal(units[units < f], units[units >= f] - f)
                units = units[units < f]
            out_units = (a[f"layers.{i}.ffn.experts.w_out"][e] != w_out[e]).any(dim=1).nonzero().flatten()
            assert torch.equal(units, out_units) and len(units) == int(drop * f), (e, units, out_units)
            sets.append(tuple(units.tolist()))
        assert len(set(sets)) > 1 or drop == 1.0  # drawn per expert
        # the re-initialised values, pooled over the experts, follow the dense tensors' statistics
        pools = {"w_up": [], "w_out": [], "w_gate": []}
        for e, units in enumerate(sets):
            idx = list(units)
            pools["w_out"].append(w_out[e][idx] / g)
            pools["w_up"].append(w_in[e][:, [u + (f if gated else 0) for u in idx]])
            if gated:
                pools["w_gate"].append(w_in[e][:, idx])
        for name, parts in pools.items():
            if not parts:
                continue
            got, ref = torch.cat([p.flatten() for p in parts]).double(), getattr(mlp, name).weight.double()
            n = got.numel()
            assert abs(got.mean() - ref.mean()) < 5 * ref.std() / n**0.5, (name, got.mean(), ref.mean())
            assert abs(got.std() / ref.std() - 1) < 0.1, (name, got.std(), ref.std())
    x = tokens(dense.config)
    with torch.no_grad():  # no longer the dense function: that is the trade
        assert (dropped.eval()(x) - dense(x)).abs().max() > 1e-2
    with pytest.raises(ValueError, match=r"drop=1.5 is invalid; it must be a fraction in \[0, 1\]"):
        upcycle(dense, cfg, g, drop=1.5)


def test_expert_similarity_tells_copies_from_drop_upcycled_and_random_experts():
    """moekit-eval's expert similarity: 1 for plain upcycling's copies (g = 1), lower with drop-upcycling, ~0 for
    randomly initialised experts; the sampled estimate is within a few 1 / sqrt(samples) of the exact value."""
    from moekit.train.evaluation import expert_similarity

    dense = dense_model(num_layers=1)
    cfg = upcycled_config(dense.config, 8, 2, 1)
    plain, dropped = upcycle(dense, cfg, 1, seed=2), upcycle(dense, cfg, 1, seed=2, drop=0.5)
    fresh = build_model(cfg, seed=int(torch.randint(0, 2**31, ())))
    sims = {k: expert_similarity(m.layers[0].ffn) for k, m in (("plain", plain), ("drop", dropped), ("fresh", fresh))}
    assert sims["plain"] == pytest.approx(1.0, abs=1e-6)
    assert 0.2 < sims["drop"] < 0.9 and abs(sims["fresh"]) < 0.05, sims
    exact = expert_similarity(dropped.layers[0].ffn)
    sampled = expert_similarity(dropped.layers[0].ffn, max_features=1024)  # of 4096 weights per expert
    assert abs(sampled - exact) < 4 / 1024**0.5, (sampled, exact)
    one = upcycle(dense, upcycled_config(dense.config, 1, 1, 1), 1)
    assert expert_similarity(one.layers[0].ffn) is None


# ---------------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("args,kwargs,expected", [
    ((8, 2, 3), {}, "granularity 3 does not divide the dense model's ffn_hidden_size=64"),
    ((6, 4, 4), {}, "granularity 4 does not divide model.num_experts=6"),
    ((8, 2, 4), {}, "model.top_k=2 is not a multiple of granularity 4"),
    ((8, 2, 0), {}, "granularity=0 is invalid"),
    ((8, 2, 1), {"router_options": {"normalize": False}}, "set model.router_options.normalize = true"),
    ((8, 1, 1), {"router": "switch"}, "only with the 'topk' router"),
    ((8, 4, 2), {"router_options": {"num_groups": 8, "group_top_k": 4}}, "straddle groups"),
    ((8, 2, 1), {"router_options": {"force_expert": 0}}, "force_expert=0"),
    ((8, 2, 1), {"hidden_size": 64}, "hidden_size is copied from the dense model"),
    ((8, 2, 1), {"moe_ffn_hidden_size": 16}, "choose the expert width with granularity"),
])
def test_bad_upcycle_configs_are_refused(args, kwargs, expected):
    with pytest.raises(ValueError, match=None) as info:
        upcycled_config(ModelConfig(**DENSE), *args, **kwargs)
    assert expected in str(info.value), str(info.value)


def test_mismatched_configs_and_sources_are_refused():
    dense = dense_model()
    moe_cfg = ModelConfig(**{**DENSE, "num_experts": 4, "top_k": 2, "moe_ffn_hidden_size": 32, "hidden_size": 64,
                             "router_options": {"normalize": True}})
    assert dense_mismatches(dense.config, moe_cfg, 2) == [("hidden_size", 32, 64)]
    with pytest.raises(ValueError, match=r"model.hidden_size=64 \(dense: 32\)"):
        upcycle(dense, moe_cfg, 2)
    moe_cfg.hidden_size = 32
    assert dense_mismatches(dense.config, moe_cfg, 1) == [("moe_ffn_hidden_size", 64, 32)]
    with pytest.raises(ValueError, match="not dense: it has num_experts=4"):
        upcycle(build_model(moe_cfg), moe_cfg, 2)
    moe_cfg.first_dense_layers = 3  # no MoE layer left
    with pytest.raises(ValueError, match="has no MoE layer"):
        check_upcycle_config(moe_cfg)


def test_capacity_is_allowed_with_a_warning():
    with pytest.warns(UserWarning, match="capacity_factor=1.5: tokens whose slots overflow"):
        cfg = upcycled_config(ModelConfig(**DENSE), 4, 2, 2, capacity_factor=1.5)
    assert check_upcycle_config(cfg, 2)  # the note is returned for the trainer to print


# ---------------------------------------------------------------------------------------------------
# Sources and moekit-train --init-from-dense
# ---------------------------------------------------------------------------------------------------


def _first_batch_loss(model, seq_len: int = 32, batch: int = 4) -> float:
    """The loss of ``model`` on the trainer's first batch (seed 0, embedded corpus), as test_train does."""
    from moekit.train.data import Sampler, gather, split_windows
    from moekit.train.tokens import embedded_corpus

    split = split_windows(embedded_corpus()[0], seq_len, 0.05)
    x, y = gather(split.tokens, Sampler(split.train_starts, 0).next(batch), seq_len)
    with torch.no_grad():
        return torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).item()


def test_train_init_from_dense_starts_from_the_dense_loss(tmp_path, capsys):
    pytest.importorskip("safetensors")
    from moekit.train.modelfiles import save_moekit
    from moekit.train.loop import main

    # the trainer's TINY model (hidden 32, 2 layers, heads 2/1, ffn 64), dense
    dense = build_model(ModelConfig(num_experts=0, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                                    ffn_hidden_size=64, max_seq_len=32, init_std=0.1), seed=5).eval()
    path = save_moekit(dense, tmp_path / "dense.safetensors")
    run = tmp_path / "run"
    flags = [*TINY_MODEL, "--run-dir", str(run), "--steps", "1", "--checkpoint.every", "0", "--init-from-dense",
             str(path), "--upcycle-granularity", "2", "--model.top_k", "4"]  # 8 experts of 32 = 4 copies x 2 shards
    assert main(flags) == 0, capsys.readouterr().err
    first = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert first["loss"] == pytest.approx(_first_batch_loss(dense), rel=1e-6)
    assert "upcycled from the dense model" in capsys.readouterr().out
    saved = json.loads((run / "config.json").read_text())["train"]
    assert saved["init_from_dense"] == str(path) and saved["upcycle_granularity"] == 2
    # under torchrun (ep2, two replicated experts) each rank upcycles its share, never the whole MoE model: the
    # same first loss, the dense model's
    from tests.test_train_distributed import run as torchrun

    r = torchrun([*flags[:flags.index("--run-dir")], "--run-dir", str(tmp_path / "ep2"), "--steps", "1",
                  "--checkpoint.every", "0", "--init-from-dense", str(path), "--upcycle-granularity", "2",
                  "--model.top_k", "4", "--ep", "2", "--layout.expert_replicas", "2"], nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    first = json.loads((tmp_path / "ep2" / "metrics.jsonl").read_text().splitlines()[0])
    assert first["loss"] == pytest.approx(_first_batch_loss(dense), rel=1e-5)


def test_train_upcycle_drop_starts_from_the_drop_upcycled_model(tmp_path, capsys):
    """--upcycle-drop 0.5: the run starts from upcycle(..., drop=0.5) of the dense model (its first loss), not from
    the dense model's loss, and says so."""
    from moekit.train.loop import main
    from moekit.train.modelfiles import save_moekit

    dense = build_model(ModelConfig(num_experts=0, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                                    ffn_hidden_size=64, max_seq_len=32, init_std=0.1), seed=5).eval()
    path = save_moekit(dense, tmp_path / "dense.safetensors")
    run = tmp_path / "run"
    assert main([*TINY_MODEL, "--run-dir", str(run), "--steps", "1", "--checkpoint.every", "0", "--init-from-dense",
                 str(path), "--upcycle-granularity", "2", "--model.top_k", "4", "--upcycle-drop", "0.5"]) == 0
    assert "(granularity 2; drop-upcycling: 0.5 of each expert's units re-initialised)" in capsys.readouterr().out
    first = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])["loss"]
    config = ModelConfig.from_dict(json.loads((run / "config.json").read_text())["model"])
    want = _first_batch_loss(upcycle(dense, config, 2, seed=0, drop=0.5).eval())
    assert first == pytest.approx(want, rel=1e-6) and abs(first - _first_batch_loss(dense)) > 1e-3


UPCYCLE_LAYOUTS = {  # 4 gloo ranks: (layout degrees, an expert placement over the EP ranks or None)
    "fsdp4-ep2-placed": (dict(fsdp=4, ep=2), ((5, 0, 1, 7, 2), (3, 4, 5, 6, 0))),  # 2 replicas, slots out of order
    "tp2-fsdp2-ep2": (dict(tp=2, fsdp=2, ep=2), None),
    "pp2-fsdp2-ep2": (dict(pp=2, fsdp=2, ep=2), None),
}
DENSE_SOURCES = ("module", "hf", "safetensors", "pt", "checkpoint")


def _write_sources(dense, folder) -> None:
    """The dense model as each source upcycling reads: the module (pickled), an HF folder, moekit files, a DCP
    checkpoint directory (meta.json + DCP files, as moekit-train writes)."""
    import torch.distributed.checkpoint as dcp

    from moekit.models.hf import save_hf
    from moekit.train.modelfiles import save_moekit

    torch.save(dense, folder / "module.pt")
    save_hf(dense, folder / "hf", family="llama")
    save_moekit(dense, folder / "dense.safetensors")
    save_moekit(dense, folder / "dense.pt")
    dcp.save({"model": dense.state_dict()}, checkpoint_id=str(folder / "step_1"), no_dist=True)
    (folder / "step_1" / "meta.json").write_text(json.dumps({"model": dense.config.to_dict()}))


def _open_source(kind: str, folder):
    from moekit.train.upcycle import open_dense

    if kind == "module":
        return torch.load(f"{folder}/module.pt", weights_only=False)
    return open_dense(f"{folder}/" + {"hf": "hf", "safetensors": "dense.safetensors", "pt": "dense.pt",
                                      "checkpoint": "step_1"}[kind])


def _bytes_needed(model, g: int) -> dict[str, int]:
    """The bytes of each dense tensor (fp32) a rank must read to fill what it holds, counted from its boxes: every
    local tensor copied from the dense model its own box; each expert tensor, for each distinct shard e % g of its
    rows, the matching block of the dense MLP's units (w_in's gate / up columns, w_out's rows) at its hidden box."""
    from moekit.models.hf.sharded import placed_rows, shard_box
    from moekit.models.upcycle import _is_ffn

    need: dict[str, int] = {}
    rows = placed_rows(model)
    for name, t in model.state_dict().items():
        box = shard_box(t, name)
        if 0 in [len(r) for r in box]:
            continue
        parts = name.split(".")
        if not _is_ffn(name) or parts[3] in ("w_gate", "w_up", "w_out"):  # copied as it is
            need[name] = t.to_local().numel() if hasattr(t, "to_local") else t.numel()
        elif parts[3] == "experts":
            ffn, f = ".".join(parts[:3]), t.shape[-1] // 2 if parts[4] == "w_in" else t.shape[1]
            shards = len({e % g for e in rows.get(name, box[0])})
            if parts[4] == "w_in":  # [E, H, gate | up]
                for j, proj in enumerate(("w_gate", "w_up")):
                    cols = len(range(max(box[2].start, j * f), min(box[2].stop, (j + 1) * f)))
                    need[f"{ffn}.{proj}.weight"] = need.get(f"{ffn}.{proj}.weight", 0) + shards * cols * len(box[1])
            else:  # [E, f, H]
                need[f"{ffn}.w_out.weight"] = need.get(f"{ffn}.w_out.weight", 0) + shards * len(box[1]) * len(box[2])
    return {k: 4 * n for k, n in need.items() if n}


def _upcycle_rank(rank, world, folder):
    from moekit.comm.placement import Placement
    from moekit.comm.topology import Layout, Topology
    from moekit.models.hf.sharded import placed_rows, shard_box
    from moekit.models.parallelize import parallelize
    from moekit.models.pipeline import build_pipeline
    from moekit.models.transformer import Transformer, meta_device
    from moekit.models.upcycle import upcycle_into
    from moekit.moe.load import moe_layers

    config = torch.load(f"{folder}/config.pt", weights_only=False)
    want, want_drop = torch.load(f"{folder}/want.pt"), torch.load(f"{folder}/want_drop.pt")
    whole_folder = sum(f.stat().st_size for f in (folder / "hf").glob("*.safetensors"))
    for case, (degrees, slots) in UPCYCLE_LAYOUTS.items():
        topo = Topology(Layout(**degrees), rank, world).build()
        with meta_device():
            model = Transformer(config)
        if topo.layout.pp > 1:
            model = build_pipeline(model, topo, device="cpu").model
        placements = slots and {name: Placement(slots, config.num_experts) for name, _ in moe_layers(model)}
        parallelize(model, topo, expert_placement=placements)
        model.to_empty(device="cpu")
        rows = placed_rows(model)
        assert bool(rows) == bool(slots), case
        for kind in DENSE_SOURCES:
            with torch.no_grad():  # what to_empty or the last source left must not survive: every tensor is written
                for t in model.state_dict().values():
                    (t.to_local() if hasattr(t, "to_local") else t).fill_(float("nan"))
            source = _open_source(kind, folder)
            upcycle_into(model, source, 2, seed=4)
            for name, t in model.state_dict().items():
                index = tuple(slice(r.start, r.stop) for r in shard_box(t, name))
                if name in rows:
                    index = (rows[name],) + index[1:]
                local = t.to_local() if hasattr(t, "to_local") else t
                assert torch.equal(local, want[name][index]), (case, kind, rank, name)
            if kind == "hf":  # only the bytes its shards are made of: HF key by HF key
                hf_key = {name: rule.sources[0] for name, rule in source._rules.items()}
                assert source.bytes_read == {hf_key[k]: n for k, n in _bytes_needed(model, 2).items()}, (case, rank)
                assert sum(source.bytes_read.values()) < whole_folder / (2 if case.startswith("fsdp4") else 1), case
        # drop-upcycling: the re-initialised units are drawn per logical expert, so every layout gets the same
        upcycle_into(model, _open_source("safetensors", folder), 2, seed=4, drop=0.5)
        for name, t in model.state_dict().items():
            index = tuple(slice(r.start, r.stop) for r in shard_box(t, name))
            if name in rows:
                index = (rows[name],) + index[1:]
            local = t.to_local() if hasattr(t, "to_local") else t
            assert torch.equal(local, want_drop[name][index]), (case, "drop", rank, name)


def test_upcycling_a_parallelised_model_fills_each_ranks_share(tmp_path):
    """Built on the meta device, parallelised (FSDP over EP with a placement: replicas, slots out of order; TP x
    FSDP x EP; a pipeline's stages), moved with to_empty (filled with NaN) and upcycled rank by rank from each
    source (the module; an HF folder, moekit .safetensors / .pt files and a checkpoint, all read by slices):
    every local tensor is its part of the one-process upcycled model, bit for bit (granularity 2, a shared
    expert, a dense layer). From the HF folder each rank reads exactly the bytes its shards are made of. With
    drop-upcycling too (each expert's re-initialised units drawn from its logical id: replicas alike)."""
    dense = dense_model(num_layers=4)
    config = upcycled_config(dense.config, 8, 4, 2, first_dense_layers=1, shared_ffn_hidden_size=16)
    _write_sources(dense, tmp_path)
    torch.save(config, tmp_path / "config.pt")
    torch.save(upcycle(dense, config, 2, seed=4).state_dict(), tmp_path / "want.pt")
    torch.save(upcycle(dense, config, 2, seed=4, drop=0.5).state_dict(), tmp_path / "want_drop.pt")
    from tests.dist_utils import run_ranks

    run_ranks(_upcycle_rank, 4, tmp_path)


def _failing_rank(rank, world, folder):
    from moekit.comm.topology import Layout, Topology
    from moekit.models.parallelize import parallelize
    from moekit.models.transformer import Transformer, meta_device
    from moekit.train import UserError
    from moekit.train.upcycle import init_from_dense, open_dense

    config = torch.load(f"{folder}/config.pt", weights_only=False)
    topo = Topology(Layout(fsdp=2, ep=2), rank, world).build()
    with meta_device():
        model = Transformer(config)
    parallelize(model, topo)
    model.to_empty(device="cpu")
    source = open_dense(f"{folder}/dense.safetensors")
    if rank == 1:  # a damaged tensor only this rank reads
        read = source.read
        source.read = lambda name, box: (_ for _ in ()).throw(ValueError(f"{name} damaged")) \
            if name.endswith("ffn.w_out.weight") else read(name, box)
    with pytest.raises(UserError) as info:
        init_from_dense(model, source, "dense.safetensors", 2, seed=0)
    assert "--init-from-dense dense.safetensors: layers.0.ffn.w_out.weight damaged (on rank 1 of 2)" in str(info.value), str(info.value)


def test_a_read_failing_on_one_rank_fails_every_rank(tmp_path):
    """Ranks read different slices, so a damaged part may fail one rank only: every rank raises the same UserError
    naming it (none goes on to wait in a collective)."""
    from moekit.train.modelfiles import save_moekit

    dense = dense_model()
    save_moekit(dense, tmp_path / "dense.safetensors")
    torch.save(upcycled_config(dense.config, 4, 2, 2), tmp_path / "config.pt")
    from tests.dist_utils import run_ranks

    run_ranks(_failing_rank, 2, tmp_path)


def test_open_dense_reads_runs_checkpoints_and_files(tmp_path):
    """open_dense of a run directory (its newest checkpoint), a checkpoint, .safetensors and .pt files: every
    tensor reads as load_moekit's, any box of it; bad paths and MoE models are one clear ValueError."""
    from moekit.train import checkpoint
    from moekit.train.modelfiles import load_moekit, save_moekit
    from moekit.train.loop import main
    from moekit.train.upcycle import dense_config, open_dense

    run = tmp_path / "dense_run"  # a dense moekit-train run
    assert main([*TINY_MODEL, "--model.num_experts", "0", "--run-dir", str(run), "--steps", "1"]) == 0
    step = checkpoint.list_checkpoints(run)[-1]
    model = load_moekit(step)
    # its run directory holds a config.json too (the run's, not HuggingFace's): the trainer takes the architecture
    # from its newest checkpoint and upcycles it
    assert dense_config(run) == model.config
    assert main([*TINY_MODEL, "--run-dir", str(tmp_path / "up"), "--steps", "1", "--init-from-dense", str(run),
                 "--upcycle-granularity", "2"]) == 0
    sources = [open_dense(run), open_dense(step), open_dense(save_moekit(model, tmp_path / "m.safetensors")),
               open_dense(save_moekit(model, tmp_path / "m.pt"))]
    for k, v in model.state_dict().items():
        box = tuple(range(n // 3, n) for n in v.shape)  # a box off the origin
        for source in sources:
            assert source.shapes[k] == tuple(v.shape) and source.config == model.config
            assert torch.equal(source.read(k, box), v[tuple(slice(r.start, r.stop) for r in box)]), k
    moe = build_model(ModelConfig(**{**DENSE, "num_experts": 4, "moe_ffn_hidden_size": 64}))
    save_moekit(moe, tmp_path / "moe.pt")
    with pytest.raises(ValueError, match="not a dense model \\(num_experts=4\\)"):
        open_dense(tmp_path / "moe.pt")
    (tmp_path / "empty").mkdir()
    for bad, expected in ((tmp_path / "nope", "no such file or directory"), (tmp_path / "empty", "no config.json"),
                          (tmp_path / "x.txt", "unknown file type"),
                          (tmp_path / "empty.pt", r"empty.pt: unreadable \(truncated, or not a file torch.save wrote")):
        bad.touch() if bad.suffix else None
        with pytest.raises(ValueError, match=expected):
            open_dense(bad)


def test_a_file_whose_tensors_do_not_match_its_config_is_refused_when_opened(tmp_path):
    from safetensors.torch import save_file

    from moekit.train.modelfiles import CONFIG_KEY
    from moekit.train.upcycle import open_dense

    dense = dense_model()
    state = {k: v.contiguous() for k, v in dense.state_dict().items()}
    state["layers.1.ffn.w_up.weight"] = state["layers.1.ffn.w_up.weight"][:32].contiguous()
    save_file(state, tmp_path / "bad.safetensors", {"format": "pt", CONFIG_KEY: json.dumps(dense.config.to_dict())})
    with pytest.raises(ValueError, match=r"bad.safetensors: tensor shapes do not match its config: "
                                         r"layers.1.ffn.w_up.weight \[32, 32\] \(config: \[64, 32\]\)"):
        open_dense(tmp_path / "bad.safetensors")


BAD_FLAGS = [
    (["--upcycle-granularity", "2"], "--upcycle-granularity 2 needs --init-from-dense"),
    (["--upcycle-drop", "0.5"], "--upcycle-drop 0.5 needs --init-from-dense"),
    (["--init-from-dense", "{dense}", "--upcycle-drop", "1.5"], "--upcycle-drop=1.5 is invalid; it must be a fraction"),
    (["--init-from-dense", "{dense}", "--upcycle-drop", "nan"], "--upcycle-drop=nan is invalid"),
    (["--init-from-dense", "{dense}", "--init-from-hf", "{tmp}"], "choose one"),
    (["--init-from-dense", "{tmp}/missing"], "no such file or directory"),
    (["--init-from-dense", "{dense}", "--upcycle-granularity", "0"], "--upcycle-granularity=0 is invalid"),
    (["--init-from-dense", "{dense}", "--upcycle-granularity", "2", "--model.top_k", "3"],
     "model.top_k=3 is not a multiple of granularity 2"),
    (["--init-from-dense", "{dense}", "--model.hidden_size", "64"],  # sizes: named with the flags that fix them
     "use --model.hidden_size 32 --model.moe_ffn_hidden_size 64"),
    (["--init-from-dense", "{moe}"], "not a dense model (num_experts=8)"),
    (["--init-from-dense", "{truncated}"], "truncated.pt: unreadable (truncated, or not a file torch.save wrote"),
    (["--init-from-dense", "{garbage}"], "garbage.pt: unreadable (truncated, or not a file torch.save wrote"),
]


@pytest.mark.parametrize("argv,expected", BAD_FLAGS, ids=[" ".join(a) for a, _ in BAD_FLAGS])
def test_bad_init_from_dense_flags(tmp_path, capsys, argv, expected):
    pytest.importorskip("safetensors")
    from moekit.train.modelfiles import save_moekit
    from moekit.train.loop import main

    small = dict(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, ffn_hidden_size=64, max_seq_len=32)
    save_moekit(build_model(ModelConfig(num_experts=0, **small)), tmp_path / "dense.safetensors")
    save_moekit(build_model(ModelConfig(moe_ffn_hidden_size=32, **small)), tmp_path / "moe.safetensors")
    (tmp_path / "truncated.pt").write_bytes(save_moekit(build_model(ModelConfig(num_experts=0, **small)),
                                                        tmp_path / "dense.pt").read_bytes()[:1000])
    (tmp_path / "garbage.pt").write_text("hello\n")
    names = {"dense": tmp_path / "dense.safetensors", "moe": tmp_path / "moe.safetensors", "tmp": tmp_path,
             "truncated": tmp_path / "truncated.pt", "garbage": tmp_path / "garbage.pt"}
    argv = [a.format(**names) for a in argv]
    rc = main([*TINY_MODEL, "--run-dir", str(tmp_path / "run"), "--steps", "1", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and expected in err[0], err
    assert not (tmp_path / "run").exists()


def test_resume_keeps_the_checkpoint_weights_not_the_dense_ones():
    from moekit.train import resume

    old = {"train": {"init_from_dense": "a", "upcycle_granularity": 2, "upcycle_drop": 0.0, "lr": 1e-3}}
    new = {"train": {"init_from_dense": "b", "upcycle_granularity": 4, "upcycle_drop": 0.5, "lr": 1e-3}}
    assert sorted(k for k, *_ in resume.compare(old, new).kept) == ["train.init_from_dense", "train.upcycle_drop",
                                                                     "train.upcycle_granularity"]


# ---------------------------------------------------------------------------------------------------
# HuggingFace dense folders
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_hf_dense_folder_upcycles_to_transformers_logits(tmp_path, family):
    """A Llama (tied embeddings), Qwen2 (q/k/v biases) or Qwen3 (q/k norms) folder, upcycled at granularity 2 with
    sigmoid routing, gives transformers' dense logits."""
    transformers = pytest.importorskip("transformers")
    from moekit.models.hf import config_from_hf
    from moekit.train.upcycle import open_dense

    config_cls, model_cls, extra = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {"tie_word_embeddings": True}),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {"head_dim": 16}),
    }[family]
    hf_cfg = config_cls(**{**dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                  rms_norm_eps=1e-6, tie_word_embeddings=False, initializer_range=0.1), **extra})
    ref = model_cls(hf_cfg).eval()
    with torch.no_grad():  # biases and norm weights away from their 0 / 1 init, so that copying them matters
        for name, p in ref.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
    ref.save_pretrained(tmp_path / family)
    assert config_from_hf(tmp_path / family).num_experts == 0
    dense = open_dense(tmp_path / family)  # read by slices (the tied Llama: lm_head's copy checked on the way)
    moe = upcycle(dense, upcycled_config(dense.config, 8, 4, 2, router_options={"score": "sigmoid"}), 2, seed=3).eval()
    x = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        want = ref(x).logits.float()
        torch.testing.assert_close(moe(x), want, rtol=1e-5, atol=1e-5)


def test_a_bf16_folder_is_read_in_bf16_and_upcycles_to_the_same_weights(tmp_path):
    """read_dense reads an HF folder's bf16 slices as they are stored; the upcycled model is bit for bit the one
    from the folder's float32 copy, with a router scaling whose g / scaling rounds in bf16 (the upcycle computes
    in float32)."""
    from moekit.models.hf import load_hf, save_hf
    from moekit.train.upcycle import read_dense

    save_hf(dense_model(), tmp_path / "dense", family="llama", dtype=torch.bfloat16)
    fp32 = load_hf(tmp_path / "dense")
    cfg = upcycled_config(fp32.config, 8, 4, 2, router_options={"scaling": 1.5}, shared_ffn_hidden_size=16)
    dense = read_dense(cfg, str(tmp_path / "dense"), 2)
    assert {dense.read(k, tuple(range(1) for _ in v)).dtype for k, v in dense.shapes.items()} == {torch.bfloat16}
    got, want = upcycle(dense, cfg, 2, seed=6).state_dict(), upcycle(fp32, cfg, 2, seed=6).state_dict()
    assert all(got[k].dtype == torch.float32 and torch.equal(got[k], want[k]) for k in want)


def test_upcycle_memory_bench_runs_both_peers(tmp_path, capsys):
    """tools/bench/upcycle_memory.py on 2 tiny ranks: a row per rank, both peers filled the same weights."""
    from moekit.bench import upcycle_memory

    out = tmp_path / "u.json"
    assert upcycle_memory.main(["--hidden", "64", "--ffn", "128", "--layers", "2", "--vocab", "300", "--heads", "4",
                                "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["rank"] for r in rows] == [0, 1] and all(r["same"] for r in rows), rows
    assert "sliced anon MiB" in capsys.readouterr().out


def test_a_tied_folder_whose_lm_head_copy_differs_is_refused_when_read(tmp_path):
    """A tied HF folder that also stores lm_head.weight: each slice of the embedding read for upcycling is compared
    with the same slice of the copy (as load_hf_sharded does); equal reads fine, a different copy is a ValueError."""
    from safetensors.torch import load_file, save_file

    from moekit.models.hf import save_hf
    from moekit.train.upcycle import open_dense

    save_hf(dense_model(tie_embeddings=True), tmp_path / "tied", family="llama")
    file = tmp_path / "tied" / "model.safetensors"
    state = load_file(file)
    box = (range(10, 20), range(0, 32))
    for copy, ok in ((state["model.embed_tokens.weight"].clone(), True), (state["model.embed_tokens.weight"] + 1, False)):
        save_file({**state, "lm_head.weight": copy}, file, {"format": "pt"})
        source = open_dense(tmp_path / "tied")
        if ok:
            torch.testing.assert_close(source.read("embed.weight", box), state["model.embed_tokens.weight"][10:20])
            assert source.bytes_read == {"model.embed_tokens.weight": 10 * 32 * 4, "lm_head.weight": 10 * 32 * 4}
        else:
            with pytest.raises(ValueError, match="tie_word_embeddings=true but lm_head.weight differs"):
                source.read("embed.weight", box)
