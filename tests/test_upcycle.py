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
from moekit.models.upcycle import check_upcycle_config, dense_mismatches, upcycle, upcycled_config
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


UPCYCLE_LAYOUTS = {  # 4 gloo ranks: (layout degrees, an expert placement over the EP ranks or None)
    "fsdp4-ep2-placed": (dict(fsdp=4, ep=2), ((5, 0, 1, 7, 2), (3, 4, 5, 6, 0))),  # 2 replicas, slots out of order
    "tp2-fsdp2-ep2": (dict(tp=2, fsdp=2, ep=2), None),
    "pp2-fsdp2-ep2": (dict(pp=2, fsdp=2, ep=2), None),
}


def _upcycle_rank(rank, world, folder):
    from moekit.comm.placement import Placement
    from moekit.comm.topology import Layout, Topology
    from moekit.models.hf.sharded import placed_rows, shard_box
    from moekit.models.parallelize import parallelize
    from moekit.models.pipeline import build_pipeline
    from moekit.models.transformer import Transformer, meta_device
    from moekit.models.upcycle import upcycle_into
    from moekit.moe.load import moe_layers

    dense = torch.load(f"{folder}/dense.pt", weights_only=False)
    config = torch.load(f"{folder}/config.pt", weights_only=False)
    want = torch.load(f"{folder}/want.pt")
    for case, (degrees, slots) in UPCYCLE_LAYOUTS.items():
        topo = Topology(Layout(**degrees), rank, world).build()
        with meta_device():
            model = Transformer(config)
        if topo.layout.pp > 1:
            model = build_pipeline(model, topo, device="cpu").model
        placements = slots and {name: Placement(slots, config.num_experts) for name, _ in moe_layers(model)}
        parallelize(model, topo, expert_placement=placements)
        model.to_empty(device="cpu")
        with torch.no_grad():  # what to_empty left must not survive: every tensor is written
            for t in model.state_dict().values():
                (t.to_local() if hasattr(t, "to_local") else t).fill_(float("nan"))
        upcycle_into(model, dense, 2, seed=4)
        rows = placed_rows(model)
        assert bool(rows) == bool(slots), case
        for name, t in model.state_dict().items():
            index = tuple(slice(r.start, r.stop) for r in shard_box(t, name))
            if name in rows:
                index = (rows[name],) + index[1:]
            local = t.to_local() if hasattr(t, "to_local") else t
            assert torch.equal(local, want[name][index]), (case, rank, name)


def test_upcycling_a_parallelised_model_fills_each_ranks_share(tmp_path):
    """Built on the meta device, parallelised (FSDP over EP with a placement: replicas, slots out of order; TP x
    FSDP x EP; a pipeline's stages), moved with to_empty (filled with NaN) and upcycled rank by rank: every local
    tensor is its part of the one-process upcycled model, bit for bit (granularity 2, a shared expert, a dense
    layer)."""
    dense = dense_model(num_layers=4)
    config = upcycled_config(dense.config, 8, 4, 2, first_dense_layers=1, shared_ffn_hidden_size=16)
    torch.save(dense, tmp_path / "dense.pt")
    torch.save(config, tmp_path / "config.pt")
    torch.save(upcycle(dense, config, 2, seed=4).state_dict(), tmp_path / "want.pt")
    from tests.dist_utils import run_ranks

    run_ranks(_upcycle_rank, 4, str(tmp_path))


@pytest.mark.parametrize("fields", [{}, dict(tie_embeddings=True, activation="gelu")])
def test_dense_model_too_big_for_the_node_is_refused_before_reading(tmp_path, monkeypatch, fields):
    """Each rank holds the dense model whole in host memory while it upcycles: the ranks of a node needing more
    than the machine has is one line naming the sizes and the fix, before the path is read. The size counts the
    dense model the MoE config implies (the dry run's init: line uses the same count)."""
    from moekit.train import UserError, plan
    from moekit.train.upcycle import dense_param_count, read_dense

    dense = dense_model(**fields)
    cfg = upcycled_config(dense.config, 4, 2, 2, shared_ffn_hidden_size=16)
    each = 4 * dense_param_count(cfg, 2)
    assert each == 4 * sum(p.numel() for p in dense.parameters())
    monkeypatch.setattr(plan, "device_memory", lambda device: 3 * each)
    with pytest.raises(UserError, match=r"host memory \(fp32\) while it upcycles, 0\.0 GiB, and the 4 ranks of a node "
                                        r"need 0\.0 GiB of this machine's 0\.0 GiB; start fewer ranks per node "
                                        r"\(torchrun --nproc-per-node\)"):
        read_dense(cfg, str(tmp_path / "missing"), 2, ranks_per_node=4)
    with pytest.raises(UserError, match="missing: no such file or directory"):  # 3 fit: the path is read next
        read_dense(cfg, str(tmp_path / "missing"), 2, ranks_per_node=3)


def test_load_dense_reads_runs_checkpoints_and_files(tmp_path):
    from moekit.train import checkpoint
    from moekit.train.modelfiles import load_moekit, save_moekit
    from moekit.train.loop import main
    from moekit.train.upcycle import load_dense

    run = tmp_path / "dense_run"  # a dense moekit-train run
    assert main([*TINY_MODEL, "--model.num_experts", "0", "--run-dir", str(run), "--steps", "1"]) == 0
    step = checkpoint.list_checkpoints(run)[-1]
    a, b = load_dense(run), load_dense(step)
    for k, v in load_moekit(step).state_dict().items():
        assert torch.equal(a.state_dict()[k], v) and torch.equal(b.state_dict()[k], v)
    moe = build_model(ModelConfig(**{**DENSE, "num_experts": 4, "moe_ffn_hidden_size": 64}))
    save_moekit(moe, tmp_path / "moe.pt")
    with pytest.raises(ValueError, match="not a dense model \\(num_experts=4\\)"):
        load_dense(tmp_path / "moe.pt")
    (tmp_path / "empty").mkdir()
    for bad, expected in ((tmp_path / "nope", "no such file or directory"), (tmp_path / "empty", "no config.json"),
                          (tmp_path / "x.txt", "unknown file type"),
                          (tmp_path / "empty.pt", r"empty.pt: unreadable \(truncated, or not a file torch.save wrote")):
        bad.touch() if bad.suffix else None
        with pytest.raises(ValueError, match=expected):
            load_dense(bad)


BAD_FLAGS = [
    (["--upcycle-granularity", "2"], "--upcycle-granularity 2 needs --init-from-dense"),
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

    old = {"train": {"init_from_dense": "a", "upcycle_granularity": 2, "lr": 1e-3}}
    new = {"train": {"init_from_dense": "b", "upcycle_granularity": 4, "lr": 1e-3}}
    assert sorted(k for k, *_ in resume.compare(old, new).kept) == ["train.init_from_dense",
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
    from moekit.train.upcycle import load_dense

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
    dense = load_dense(tmp_path / family)
    moe = upcycle(dense, upcycled_config(dense.config, 8, 4, 2, router_options={"score": "sigmoid"}), 2, seed=3).eval()
    x = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        want = ref(x).logits.float()
        torch.testing.assert_close(moe(x), want, rtol=1e-5, atol=1e-5)


def test_a_bf16_folder_is_held_in_bf16_and_upcycles_to_the_same_weights(tmp_path):
    """read_dense keeps an HF folder's bf16 (half the host memory of each rank's copy); the upcycled model is bit
    for bit the one from the folder's float32 copy, with a router scaling whose g / scaling rounds in bf16."""
    from moekit.models.hf import load_hf, save_hf
    from moekit.train.upcycle import held_dtype, read_dense

    save_hf(dense_model(), tmp_path / "dense", family="llama", dtype=torch.bfloat16)
    assert held_dtype(tmp_path / "dense") == torch.bfloat16 and held_dtype(tmp_path / "missing") == torch.float32
    fp32 = load_hf(tmp_path / "dense")
    cfg = upcycled_config(fp32.config, 8, 4, 2, router_options={"scaling": 1.5}, shared_ffn_hidden_size=16)
    dense = read_dense(cfg, str(tmp_path / "dense"), 2)
    assert {p.dtype for p in dense.parameters()} == {torch.bfloat16}
    got, want = upcycle(dense, cfg, 2, seed=6).state_dict(), upcycle(fp32, cfg, 2, seed=6).state_dict()
    assert all(got[k].dtype == torch.float32 and torch.equal(got[k], want[k]) for k in want)

