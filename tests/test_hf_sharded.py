"""Shard-wise HuggingFace load and export (models/hf/sharded.py) at ep / tp / fsdp over real gloo ranks.

Each layout builds its model on the meta device, parallelises it, materialises only its shards
(``to_empty``) and loads the checkpoint with ``load_hf_sharded``. It must equal the one-process ``load_hf``:
every parameter gathered, and the logits. Each rank must read exactly the bytes it holds (counted by a
wrapper around safetensors' ``safe_open``, independently of the loader's own count), and under EP only its
own experts' keys. ``save_hf_sharded`` of the parallel model must write exactly what ``save_hf`` writes
for the one-process model (same keys, tensors, config.json), each key once in the index. A checkpoint
that does not match fails on every rank with the same message, also when only one rank can see why.
Under an expert placement (replicas, experts out of order) each slot holds its logical expert's rows, and
MTP depths the folder lacks start from the seed: both equal the whole model initialised, then loaded.
"""
from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from moekit.comm.placement import Placement
from moekit.comm.topology import Layout, Topology
from moekit.models.config import ModelConfig
from moekit.models.hf import config_from_hf, load_hf, load_hf_into, save_hf
from moekit.models.hf import sharded, sharded_export
from moekit.models.hf.families import FAMILIES
from moekit.models.hf.weights import model_rules, weave
from moekit.models.init import init_weights
from moekit.models.parallelize import parallelize
from moekit.models.transformer import Transformer, build_model
from moekit.moe.load import moe_layers
from tests.dist_utils import run_ranks

VOCAB = 64
BASE = dict(name="t", vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, max_seq_len=64,
            num_experts=4, moe_ffn_hidden_size=24, ffn_hidden_size=40, top_k=2, init_std=0.1,
            router_options={"normalize": True})
MLA = dict(attention="mla", kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, q_lora_rank=12)
# family -> model config overrides: what each checkpoint exercises
MODELS = {
    "mixtral": {},
    "qwen2_moe": dict(num_layers=3, first_dense_layers=1, shared_ffn_hidden_size=16, shared_expert_gate=True,
                      attention_bias=True, router_options={"normalize": False}),
    "deepseek_v3": dict(**MLA, num_layers=3, first_dense_layers=1, shared_ffn_hidden_size=24, num_heads=4,
                        num_kv_heads=4, router_options={"score": "sigmoid", "normalize": True, "expert_bias": True,
                                                        "scaling": 1.5}, aux_loss_coeff=0.0),
    "qwen3_moe": dict(qk_norm="head", router_options={"normalize": False}),
    "glm4_moe": dict(num_layers=3, first_dense_layers=1, shared_ffn_hidden_size=24, attention_bias=True, qk_norm="head",
                     partial_rotary_factor=0.5, router_options={"score": "sigmoid", "normalize": True,
                                                                 "expert_bias": True, "scaling": 2.5},
                     aux_loss_coeff=0.0),
    "olmoe": dict(qk_norm="full", qkv_clip=0.4, router_options={"normalize": False}),
    "qwen2": dict(num_experts=0, attention_bias=True),
    # q/k norm over the projection, half of each head rotated, sigmoid with the selection bias in the block
    "minimax_m2": dict(qk_norm="full", partial_rotary_factor=0.5, aux_loss_coeff=0.0,
                       router_options={"score": "sigmoid", "normalize": True, "expert_bias": True}),
    # RoPE on adjacent pairs, a dense first layer, 2 shared experts, the selection bias stored as [1, E]
    "ernie4_5_moe": dict(num_layers=3, first_dense_layers=1, shared_ffn_hidden_size=48, rope_pairs="adjacent",
                         tie_embeddings=True, router_options={"normalize": True, "expert_bias": True}),
    # Gated DeltaNet (its conv [C, 1, k] and 1-d dt_bias / A_log sharded by FSDP) and a gated attention layer,
    # zero-centered norms, a gated shared expert
    "qwen3_5_moe_text": dict(linear_attention="gated_deltanet", full_attention_every=2, linear_num_key_heads=2,
                             linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=4,
                             attention_output_gate=True, norm_zero_centered=True, qk_norm="head",
                             partial_rotary_factor=0.5, shared_ffn_hidden_size=16, shared_expert_gate=True),
    # Qwen3-Next: Qwen3.5's layers stored with q, k, v, z fused per key-head group (in_proj_qkvz; 2 value heads per
    # key head, so the interleave matters) and b, a likewise (in_proj_ba); a dense first (linear) layer
    "qwen3_next": dict(linear_attention="gated_deltanet", full_attention_every=2, linear_num_key_heads=2,
                       linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=4,
                       attention_output_gate=True, norm_zero_centered=True, qk_norm="head", partial_rotary_factor=0.5,
                       shared_ffn_hidden_size=16, shared_expert_gate=True, num_layers=3, first_dense_layers=1,
                       router_options={"normalize": False}),
    # Llama 4: fused experts stored [E, in, out] (no transpose), MoE on every other layer between dense MLPs, a shared
    # expert, NoPE / chunked layers, the weightless q / k norm, top-1 weighting the experts' input
    "llama4_text": dict(num_layers=4, moe_every=2, shared_ffn_hidden_size=24, rope_pairs="adjacent", qk_norm="unit",
                        nope_every=2, attention_chunk=4, attn_temperature_floor=3, top_k=1,
                        router_weight_on_input=True, router_options={"score": "sigmoid", "normalize": False}),
    # sinks, q/k/v/o biases, a window on every other layer, gate and expert biases, interleaved gate / up columns
    "gpt_oss": dict(attention_bias=True, attention_out_bias=True, attention_sinks=True, sliding_window=5,
                    full_attention_every=2, activation="swiglu_oai", moe_ffn_bias=True, moe_ffn_hidden_size=32,
                    ffn_hidden_size=32, router_options={"normalize": True, "gate_bias": True}),
}


def tiny(family: str, **over) -> ModelConfig:
    return ModelConfig(**{**BASE, **MODELS[family], **over}).validate()


def make_checkpoint(folder: Path, family: str, seed: int = 1, layout: str = "per_expert", **over) -> Path:
    model = build_model(tiny(family, **over), seed=seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # nonzero selection / gate / expert / attention biases and sinks, so loading them is checked
        for layer in model.layers:
            router, experts = getattr(layer.ffn, "router", None), getattr(layer.ffn, "experts", None)
            parts = ((router, "expert_bias"), (router, "bias"), (experts, "b_in"), (experts, "b_out"),
                     (layer.attn, "sinks"), (layer.attn.wo, "bias"))
            for bias in (getattr(m, name, None) for m, name in parts):
                if bias is not None:
                    bias.copy_(torch.randn(bias.shape, generator=gen))
    return save_hf(model, folder, family=family, layout=layout)


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(7))


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, sharded.DTensor) else t


# ---------------------------------------------------------------------------------------------------
# Inside the ranks
# ---------------------------------------------------------------------------------------------------


class CountingOpen:
    """Stands in for safetensors.safe_open in the loader: counts the bytes of every slice taken, per key."""

    def __init__(self):
        self.read: dict[str, int] = {}
        self.whole: list[str] = []  # keys read whole with get_tensor (the sharded loader must not)

    def __call__(self, path, framework="pt", **kw):
        handle, log = safe_open(path, framework=framework, **kw), self

        class Slice:
            def __init__(self, key):
                self.key, self.inner = key, handle.get_slice(key)

            def __getitem__(self, index):
                part = self.inner[index]
                log.read[self.key] = log.read.get(self.key, 0) + part.numel() * part.element_size()
                return part

        class Handle:
            def get_slice(self, key):
                return Slice(key)

            def get_tensor(self, key):
                log.whole.append(key)
                return handle.get_tensor(key)

        return Handle()


def parallel_model(ckpt: Path, topo: Topology) -> Transformer:
    """The big-checkpoint path: meta build, parallelise, materialise this rank's shards only."""
    with torch.device("meta"):
        model = Transformer(config_from_hf(ckpt))
    parallelize(model, topo)
    return model.to_empty(device="cpu")


def counted_load(model: Transformer, ckpt: Path, **kwargs) -> tuple[CountingOpen, dict[str, int]]:
    """load_hf_sharded with safe_open counting every slice read: (the count, the loader's own report)."""
    counting = CountingOpen()
    real_open, sharded.safe_open = sharded.safe_open, counting
    try:
        reported = sharded.load_hf_sharded(model, ckpt, **kwargs)
    finally:
        sharded.safe_open = real_open
    return counting, reported


def check_load(ckpt: Path, topo: Topology, where: str) -> Transformer:
    ref = load_hf(ckpt)
    model = parallel_model(ckpt, topo)
    counting, reported = counted_load(model, ckpt)
    want = ref.state_dict()
    held = 0
    for name, t in model.state_dict().items():
        box = sharded.shard_box(t, name)
        local = sharded._local(t)
        assert torch.equal(local, want[name][tuple(slice(r.start, r.stop) for r in box)]), f"{where}: {name} local"
        assert torch.equal(full(t), want[name]), f"{where}: {name}"
        held += local.numel() * 4  # the checkpoint is fp32
    # this rank read exactly what it holds: every byte once, nothing read whole
    assert counting.whole == [] and counting.read == reported, where
    assert sum(counting.read.values()) == held, f"{where}: read {sum(counting.read.values())} B, holds {held} B"
    per_expert = not any(k.endswith("experts.gate_up_proj") for k in counting.read)
    for i, layer in enumerate(model.layers):
        if layer.is_moe and per_expert:  # under EP: only the keys of this rank's experts were opened
            lo, hi = getattr(layer.ffn.dispatcher, "expert_range", (0, layer.ffn.num_experts))
            pattern = rf"model\.layers\.{i}\.\w+\.experts\.(\d+)\."
            experts = {int(m.group(1)) for k in counting.read if (m := re.match(pattern, k))}
            assert experts == set(range(lo, hi)), f"{where}: layer {i} read {sorted(experts)}, has {lo}..{hi - 1}"
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(tokens()), ref(tokens()), rtol=1e-5, atol=1e-5, msg=lambda m: f"{where}: {m}")
    return model


def whole_then_loaded(ckpt: Path, mtp_layers: int | None, seed: int) -> Transformer:
    """The reference for a placed / deeper load: the whole model initialised from ``seed``, then load_hf_into."""
    config = config_from_hf(ckpt)
    if mtp_layers is not None:
        config = dataclasses.replace(config, mtp_layers=mtp_layers)
    ref = Transformer(config)
    init_weights(ref, seed)
    load_hf_into(ref, ckpt)
    return ref


def check_placed_load(ckpt: Path, topo: Topology, where: str, slots, mtp_layers: int | None = None,
                      seed: int = 5) -> Transformer:
    """Experts under a placement (``slots``: every MoE layer's table) and ``mtp_layers`` depths, more than the
    folder holds: every local tensor equals the whole model initialised from ``seed`` and then loaded
    (load_hf_into), each slot its logical expert's rows; the rank reads exactly the bytes it holds of what the
    folder has, and only the keys of the experts its slots name; the logits equal the one-process model's."""
    ref = whole_then_loaded(ckpt, mtp_layers, seed)
    config = ref.config
    with torch.device("meta"):
        model = Transformer(config)
    placement = Placement(slots, config.num_experts)
    parallelize(model, topo, expert_placement={name: placement for name, _ in moe_layers(model)})
    model.to_empty(device="cpu")
    counting, reported = counted_load(model, ckpt, init_seed=seed)
    want, rows = ref.state_dict(), sharded.placed_rows(model)
    mine = list(slots[topo.members("ep").index(topo.rank)])  # this rank's slots
    assert rows and all(r == mine for r in rows.values()), (where, rows)
    held = 0
    for name, t in model.state_dict().items():
        index = tuple(slice(r.start, r.stop) for r in sharded.shard_box(t, name))
        if name in rows:  # physical slots: each holds its logical expert's rows
            index = (rows[name],) + index[1:]
        local = sharded._local(t)
        assert torch.equal(local, want[name][index]), f"{where}: {name}"
        fresh = mtp_layers is not None and name.startswith(tuple(f"mtp.{d}." for d in range(1, mtp_layers)))
        held += 0 if fresh else local.numel() * 4
    assert counting.whole == [] and counting.read == reported, where
    # a loaded MTP layer's copies of the embedding and the head: read (to check them) as the main rows held
    L, state = config.num_layers, model.state_dict()
    copy_key = rf"model\.layers\.{L}\.(embed_tokens|shared_head\.head)\."
    copies = {k: v for k, v in counting.read.items() if re.match(copy_key, k)}
    assert copies == {k: sharded._local(state[main]).numel() * 4 for k, main in
                      ((f"model.layers.{L}.embed_tokens.weight", "embed.weight"),
                       (f"model.layers.{L}.shared_head.head.weight", "lm_head.weight"))
                      if mtp_layers and sharded._local(state[main]).numel()}, (where, copies)
    read = sum(counting.read.values()) - sum(copies.values())
    assert read == held, f"{where}: read {read} B, holds {held} B"
    per_expert = not any(k.endswith("experts.gate_up_proj") for k in counting.read)
    for i, layer in enumerate(model.layers):
        if layer.is_moe and per_expert:  # only the experts this rank's slots hold were opened
            pattern = rf"model\.layers\.{i}\.\w+\.experts\.(\d+)\."
            experts = {int(m.group(1)) for k in counting.read if (m := re.match(pattern, k))}
            assert experts == set(mine), f"{where}: layer {i} read experts {sorted(experts)}"
    model.eval()
    ref.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(tokens()), ref(tokens()), rtol=1e-5, atol=1e-5, msg=lambda m: f"{where}: {m}")
    return model


def _layouts(rank, world, cases, tmp, placed=()):
    for degrees, ckpt, exports in cases:
        topo = Topology(Layout(**degrees), rank, world).build()
        where = f"{degrees} {Path(ckpt).name} rank {rank}"
        model = check_load(Path(ckpt), topo, where)
        for out, kwargs in exports:
            sharded.save_hf_sharded(model, out, max_shard_size=6000, **kwargs)
    for degrees, ckpt, slots, mtp_layers, out in placed:
        topo = Topology(Layout(**degrees), rank, world).build()
        model = check_placed_load(Path(ckpt), topo, f"{degrees} placed {Path(ckpt).name} rank {rank}", slots,
                                  mtp_layers)
        sharded.save_hf_sharded(model, out, max_shard_size=6000)  # each expert once, from one of its copies
    if world == 2:
        _failures(rank, tmp)


def _same_error_everywhere(fn, *args, error=ValueError, **kwargs) -> str:
    """fn must raise ``error`` on this rank; returns the message after checking every rank got the same one."""
    with pytest.raises(error) as info:
        fn(*args, **kwargs)
    messages = [None] * dist.get_world_size()
    dist.all_gather_object(messages, str(info.value))
    assert len(set(messages)) == 1, messages
    return messages[0]


def _failures(rank, tmp):
    tmp = Path(tmp)
    topo = Topology(Layout(fsdp=2), rank, 2).build()
    model = parallel_model(tmp / "mixtral", topo)
    # every rank sees the problem (from the headers, before any data is read)
    msg = _same_error_everywhere(sharded.load_hf_sharded, model, tmp / "bad-shape")
    assert "experts.3.w2.weight has shape [32, 25]" in msg and "(on rank" not in msg, msg
    # only rank 1 sees it: its folder is missing (a file system the ranks do not share)
    msg = _same_error_everywhere(sharded.load_hf_sharded, model, tmp / ("mixtral" if rank == 0 else "missing"))
    assert "missing: no such directory" in msg and msg.endswith("(on rank 1 of 2)"), msg
    # only rank 1 reads the rows where the stored lm_head differs from the tied embedding
    tied = parallel_model(tmp / "tied", topo)
    msg = _same_error_everywhere(sharded.load_hf_sharded, tied, tmp / "tied")
    assert "lm_head.weight differs from model.embed_tokens.weight" in msg and msg.endswith("(on rank 1 of 2)"), msg
    # export: rank 1's disk fails mid-way; it keeps sending its parts, so nobody hangs, and all raise
    sharded.load_hf_sharded(model, tmp / "mixtral")
    if rank == 1:
        def full_disk(self, key, tensor):
            raise OSError(28, "No space left on device")
        sharded_export._StreamWriter.write = full_disk
    msg = _same_error_everywhere(sharded.save_hf_sharded, model, tmp / "export-fails", max_shard_size=6000,
                                 error=OSError)
    assert "No space left on device" in msg and msg.endswith("(on rank 1 of 2)"), msg
    assert not (tmp / "export-fails" / "model.safetensors.index.json").exists()


# ---------------------------------------------------------------------------------------------------
# The tests
# ---------------------------------------------------------------------------------------------------


def check_export(out: Path, ref_model: Transformer, tmp: Path, **kwargs) -> None:
    """The sharded export equals save_hf's of the one-process model: keys, tensors, config; each key once."""
    one = save_hf(ref_model, tmp / f"{out.name}-one-process", **kwargs)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert sorted(set(index["weight_map"].values())) == files and len(files) > 2, files
    seen = []
    for name in files:
        with safe_open(str(out / name), framework="pt") as f:
            seen += list(f.keys())
            assert all(index["weight_map"][k] == name for k in f.keys())
    assert len(seen) == len(set(seen)) and set(seen) == set(index["weight_map"])
    ours, theirs = {}, {}
    for p in files:
        ours.update(load_file(out / p))
    for p in one.glob("*.safetensors"):
        theirs.update(load_file(p))
    assert ours.keys() == theirs.keys()
    for k in ours:
        same = ours[k].dtype == theirs[k].dtype and torch.equal(ours[k], theirs[k])
        assert same, f"{out.name}: {k} differs from save_hf's"
    assert json.loads((out / "config.json").read_text()) == json.loads((one / "config.json").read_text())
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in ours.values())
    reloaded, ref = load_hf(out).state_dict(), load_hf(one).state_dict()
    assert all(torch.equal(reloaded[k], ref[k]) for k in ref)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("ckpts")
    make_checkpoint(tmp / "mixtral", "mixtral")
    make_checkpoint(tmp / "mixtral-fused", "mixtral", layout="fused")
    make_checkpoint(tmp / "qwen2_moe", "qwen2_moe")
    make_checkpoint(tmp / "deepseek_v3", "deepseek_v3")
    make_checkpoint(tmp / "glm4_moe", "glm4_moe")
    make_checkpoint(tmp / "gpt_oss", "gpt_oss")
    make_checkpoint(tmp / "minimax_m2", "minimax_m2")
    make_checkpoint(tmp / "olmoe", "olmoe")
    make_checkpoint(tmp / "ernie4_5_moe", "ernie4_5_moe")
    make_checkpoint(tmp / "qwen3_5_moe_text", "qwen3_5_moe_text")
    make_checkpoint(tmp / "qwen3_next", "qwen3_next")
    make_checkpoint(tmp / "llama4_text", "llama4_text")
    make_checkpoint(tmp / "deepseek_v3-mtp", "deepseek_v3", mtp_layers=1)
    bad = Path(shutil.copytree(tmp / "mixtral", tmp / "bad-shape"))
    tensors = load_file(bad / "model.safetensors")
    tensors["model.layers.1.block_sparse_moe.experts.3.w2.weight"] = torch.zeros(32, 25)
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    tied = make_checkpoint(tmp / "tied", "mixtral", tie_embeddings=True)
    tensors = load_file(tied / "model.safetensors")
    head = tensors["model.embed_tokens.weight"].clone()
    head[-1, 0] += 1.0  # a row rank 1 holds under fsdp2
    save_file({**tensors, "lm_head.weight": head}, tied / "model.safetensors", metadata={"format": "pt"})
    return tmp


def test_two_ranks_ep_tp_fsdp(checkpoints, tmp_path):
    """ep2 (per-expert Mixtral), tp2 (Qwen2-MoE: biases, gated shared expert, a dense layer; GLM-4-MoE: partial
    RoPE heads, per-head q/k norm, sigmoid routing), fsdp2 (fused
    Mixtral layout read in slices along H; exported per expert, each expert tensor assembled from both
    ranks); then the failures."""
    c = checkpoints
    cases = [
        (dict(fsdp=2, ep=2), c / "mixtral", [(tmp_path / "ep2", {}),
                                             (tmp_path / "ep2-as-qwen2", {"family": "qwen2_moe"})]),
        (dict(tp=2), c / "qwen2_moe", [(tmp_path / "tp2", {})]),
        (dict(tp=2), c / "glm4_moe", [(tmp_path / "tp2-glm", {})]),  # heads with partial RoPE split over TP
        (dict(fsdp=2), c / "mixtral-fused", [(tmp_path / "fsdp2", {})]),
        (dict(fsdp=2, ep=2), c / "gpt_oss", [(tmp_path / "gpt-oss-ep2", {}),  # interleaved gate / up, biases
                                             (tmp_path / "gpt-oss-ep2-mxfp4", {"mxfp4": True})]),
        (dict(tp=2), c / "gpt_oss", [(tmp_path / "gpt-oss-tp2", {})]),  # sinks sharded with the heads
        (dict(fsdp=2, ep=2), c / "minimax_m2", [(tmp_path / "minimax-ep2", {})]),  # selection bias in the block
        (dict(tp=2), c / "olmoe", [(tmp_path / "olmoe-tp2", {})]),  # q/k norm over the projection, sharded
        (dict(fsdp=2, ep=2), c / "ernie4_5_moe", [(tmp_path / "ernie-ep2", {})]),  # the [1, E] bias read by slices
        (dict(fsdp=2, ep=2), c / "qwen3_5_moe_text", [(tmp_path / "qwen3.5-ep2", {})]),  # linear layers by slices
        (dict(tp=2), c / "qwen3_5_moe_text", [(tmp_path / "qwen3.5-tp2", {})]),  # Gated DeltaNet heads over TP
        (dict(fsdp=2, ep=2), c / "llama4_text", [(tmp_path / "llama4-ep2", {})]),  # [E, in, out] experts by slices
    ]
    # an expert placement: replicas (experts 0 and 3 twice), slots out of order, runs of consecutive experts
    slots = ((2, 3, 0), (3, 0, 1))
    placed = [(dict(dp=2, ep=2), str(c / "mixtral"), slots, None, str(tmp_path / "placed")),
              (dict(fsdp=2, ep=2), str(c / "mixtral-fused"), slots, None, str(tmp_path / "placed-fused"))]
    run_ranks(_layouts, 2, [(d, str(p), [(str(o), k) for o, k in e]) for d, p, e in cases], str(c), placed)
    check_export(tmp_path / "placed", load_hf(c / "mixtral"), tmp_path)
    check_export(tmp_path / "placed-fused", load_hf(c / "mixtral-fused"), tmp_path)
    check_export(tmp_path / "ep2", load_hf(c / "mixtral"), tmp_path)
    # each file is one rank's: under ep2 no file holds experts of both EP ranks (0-1 on rank 0, 2-3 on rank 1)
    for p in (tmp_path / "ep2").glob("*.safetensors"):
        with safe_open(str(p), framework="pt") as f:
            ranks = {int(m.group(1)) // 2 for k in f.keys() if (m := re.search(r"\.experts\.(\d+)\.", k))}
        assert len(ranks) <= 1, (p.name, ranks)
    # as a family that always has a shared expert: the missing one is written as zeros (save_hf's zero_fill)
    check_export(tmp_path / "ep2-as-qwen2", load_hf(c / "mixtral"), tmp_path, family="qwen2_moe")
    check_export(tmp_path / "tp2", load_hf(c / "qwen2_moe"), tmp_path)
    check_export(tmp_path / "tp2-glm", load_hf(c / "glm4_moe"), tmp_path)
    check_export(tmp_path / "fsdp2", load_hf(c / "mixtral-fused"), tmp_path)
    check_export(tmp_path / "gpt-oss-ep2", load_hf(c / "gpt_oss"), tmp_path)
    check_export(tmp_path / "gpt-oss-ep2-mxfp4", load_hf(c / "gpt_oss"), tmp_path, mxfp4=True)  # the release format
    check_export(tmp_path / "gpt-oss-tp2", load_hf(c / "gpt_oss"), tmp_path)
    check_export(tmp_path / "minimax-ep2", load_hf(c / "minimax_m2"), tmp_path)
    check_export(tmp_path / "olmoe-tp2", load_hf(c / "olmoe"), tmp_path)
    check_export(tmp_path / "ernie-ep2", load_hf(c / "ernie4_5_moe"), tmp_path)
    check_export(tmp_path / "qwen3.5-ep2", load_hf(c / "qwen3_5_moe_text"), tmp_path)
    check_export(tmp_path / "qwen3.5-tp2", load_hf(c / "qwen3_5_moe_text"), tmp_path)
    check_export(tmp_path / "llama4-ep2", load_hf(c / "llama4_text"), tmp_path)


def test_four_ranks_combined(checkpoints, tmp_path):
    """fsdp2 x tp2 x ep2, DeepSeek-V3: MLA heads over TP, FSDP over TP (_StridedShard), experts over EP,
    the selection bias, a shared expert and a dense first layer."""
    c = checkpoints
    cases = [(dict(fsdp=2, tp=2, ep=2), c / "deepseek_v3", [(tmp_path / "fsdp2-tp2-ep2", {"layout": "fused"})])]
    # placed experts under FSDP (experts Shard(1) over "edp"), and a second MTP depth the folder lacks (from the seed)
    placed = [(dict(fsdp=2, tp=2, ep=2), str(c / "deepseek_v3-mtp"), ((3, 1, 2), (0, 1, 2)), 2,
               str(tmp_path / "placed-mtp"))]
    run_ranks(_layouts, 4, [(d, str(p), [(str(o), k) for o, k in e]) for d, p, e in cases], str(c), placed)
    check_export(tmp_path / "placed-mtp", whole_then_loaded(c / "deepseek_v3-mtp", 2, 5), tmp_path)
    check_export(tmp_path / "fsdp2-tp2-ep2", load_hf(c / "deepseek_v3"), tmp_path, layout="fused")


def _export_layouts(rank, world, cases):
    for degrees, ckpt, out, kwargs in cases:
        topo = Topology(Layout(**degrees), rank, world).build()
        # the load checked as every other family's: each rank reads exactly the bytes it holds, which for a
        # fused tensor means the runs of its parts' rows, not the span from the first to the last
        model = check_load(Path(ckpt), topo, f"{degrees} rank {rank}")
        sharded.save_hf_sharded(model, out, max_shard_size=6000, **kwargs)


def test_qwen3_next_fused_tensors(checkpoints, tmp_path):
    """Qwen3-Next's in_proj_qkvz / in_proj_ba, each fused from several moekit tensors split over the ranks: under
    fsdp2 x ep2, fsdp2, tp2 and dp2 x fsdp2 x ep2 the owner of each linear layer's group receives the parts of in_proj_qkv / z / b / a, fuses
    them and writes what save_hf writes, byte for byte; the export loads back as the same model."""
    ckpt = checkpoints / "qwen3_next"
    fp8 = {"dtype": torch.bfloat16, "fp8": True, "fp8_block": (8, 8)}  # the fused tensors quantized, as save_hf's
    cases = [(dict(fsdp=2, ep=2), str(ckpt), str(tmp_path / "next-fsdp2-ep2"), {}),
             (dict(fsdp=2, ep=2), str(ckpt), str(tmp_path / "next-fsdp2-ep2-fp8"), fp8),
             (dict(fsdp=2), str(ckpt), str(tmp_path / "next-fsdp2"), {}),
             (dict(tp=2), str(ckpt), str(tmp_path / "next-tp2"), {})]  # z, b, a sharded over TP, qkv replicated
    run_ranks(_export_layouts, 2, cases)
    four = [(dict(dp=2, fsdp=2, ep=2), str(ckpt), str(tmp_path / "next-dp2-fsdp2-ep2"), {})]  # replicas: one sends
    run_ranks(_export_layouts, 4, four)
    ref = load_hf(ckpt)
    for _, _, out, kwargs in cases + four:
        check_export(Path(out), ref, tmp_path, **kwargs)
        index = json.loads((Path(out) / "model.safetensors.index.json").read_text())["weight_map"]
        fused = {k for k in index if k.endswith(("in_proj_qkvz.weight", "in_proj_ba.weight"))}
        assert len(fused) == 4 and not any(k.endswith("in_proj_qkv.weight") for k in index), sorted(fused)
        if not kwargs:  # the export loads back as the model itself
            assert all(torch.equal(a, ref.state_dict()[k]) for k, a in load_hf(out).state_dict().items())


@pytest.mark.parametrize("family,layout", [("mixtral", "per_expert"), ("mixtral", "fused"), ("qwen2_moe", "per_expert"),
                                           ("deepseek_v3", "fused"), ("qwen3_moe", "per_expert"), ("olmoe", "fused"),
                                           ("glm4_moe", "per_expert"), ("gpt_oss", "fused"), ("minimax_m2", "per_expert"),
                                           ("ernie4_5_moe", "per_expert"), ("qwen2", "per_expert")])
def test_rule_layouts_agree_with_split(family, layout):
    """Every rule's slice layout (Rule.layout: identity or per-expert pieces) picks out exactly what its
    split() writes, for a random tensor: the sharded paths and the whole-tensor paths cannot disagree."""
    model = build_model(tiny(family), seed=2)
    naming, L = FAMILIES[family].naming, model.config.num_layers
    rules = model_rules(model, naming, [naming.moe_blocks[-1 if layout == "fused" else 0]] * L, [layout == "fused"] * L)
    gen = torch.Generator().manual_seed(0)
    for r in rules:
        shape = tuple(model.state_dict()[r.target].shape)
        t = torch.randn(shape, generator=gen)
        spots = r.layout(shape)
        assert spots is not None, r.target
        for got, (box, dims), woven in zip(r.split(t), spots, r.weaves()):
            source = sharded._to_source(t[tuple(slice(b.start, b.stop) for b in box)], dims)
            assert torch.equal(source if woven is None else weave(source, *woven), got), r.target
        # and back: every element of the target comes from exactly one source
        cover = torch.zeros(shape)
        for box, dims in spots:
            cover[tuple(slice(b.start, b.stop) for b in box)] += 1
        assert torch.equal(cover, torch.ones(shape)), r.target


@pytest.mark.parametrize("buffers_fp32", [False, True])
def test_load_hf_allocates_the_target_dtype(checkpoints, monkeypatch, buffers_fp32):
    """load_hf(dtype=bf16) fills bf16 parameters directly (no float32 model first): the same values as a float32
    load cast afterwards; buffers (DeepSeek-V3's expert_bias) take the dtype, or stay float32 (inference)."""
    import moekit.models.hf as hf

    seen = []

    def spy(model, path, **kwargs):  # the model as the load receives it
        seen.append({p.dtype for p in model.parameters()})
        return real(model, path, **kwargs)

    real = hf.load_hf_into
    monkeypatch.setattr(hf, "load_hf_into", spy)
    ckpt = checkpoints / "deepseek_v3"
    got = load_hf(ckpt, dtype=torch.bfloat16, buffers_fp32=buffers_fp32)
    assert seen == [{torch.bfloat16}]
    ref = load_hf(ckpt)
    buffers = {k for k, _ in ref.named_buffers() if k in ref.state_dict()}
    assert "layers.1.ffn.router.expert_bias" in buffers
    for k, v in ref.state_dict().items():
        want = v if (buffers_fp32 and k in buffers) else v.to(torch.bfloat16)
        assert got.state_dict()[k].dtype == want.dtype and torch.equal(got.state_dict()[k], want), k


def test_one_process_without_distributed(checkpoints, tmp_path):
    """No process group: the same calls load and export a whole model, reading each byte once."""
    ref = load_hf(checkpoints / "qwen2_moe")
    model = build_model(config_from_hf(checkpoints / "qwen2_moe"), seed=9)
    read = sharded.load_hf_sharded(model, checkpoints / "qwen2_moe")
    assert sum(read.values()) == sum(t.numel() * 4 for t in model.state_dict().values())
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), ref.state_dict().values()))
    sharded.save_hf_sharded(model, tmp_path / "out", max_shard_size=5000)
    check_export(tmp_path / "out", ref, tmp_path)
    with pytest.raises(ValueError, match="experts.3.w2.weight has shape"):
        sharded.load_hf_sharded(build_model(config_from_hf(checkpoints / "mixtral")), checkpoints / "bad-shape")
    # an MTP depth the folder lacks: the seed to start it from, or a clear error (never uninitialised memory)
    ckpt = checkpoints / "deepseek_v3-mtp"
    deeper = dataclasses.replace(config_from_hf(ckpt), mtp_layers=2)
    with pytest.raises(ValueError, match=r"tensor\(s\) are not in .*deepseek_v3-mtp \(mtp\.1\..*pass init_seed"):
        sharded.load_hf_sharded(build_model(deeper), ckpt)
    ref = Transformer(deeper)
    init_weights(ref, 3)
    load_hf_into(ref, ckpt)
    with torch.device("meta"):
        model = Transformer(deeper)
    model.to_empty(device="cpu")
    sharded.load_hf_sharded(model, ckpt, init_seed=3)
    assert all(torch.equal(a, ref.state_dict()[k]) for k, a in model.state_dict().items())
