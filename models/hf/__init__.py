"""HuggingFace safetensors import and export.

    load_hf(path)              any supported model_type (mixtral, qwen2_moe, qwen3_moe, deepseek_v3) -> Transformer
    load_mixtral(path)         the same, insisting on model_type "mixtral"
    save_mixtral(model, path)  a folder MixtralForCausalLM.from_pretrained loads with the same logits
    config_from_hf(path)       the ModelConfig an import builds, without reading any weights
    load_hf_into(model, path)  fill a model built elsewhere (train.py --init-from-hf), checking its config

A folder is config.json plus model.safetensors, or shards plus model.safetensors.index.json, as
``save_pretrained`` writes it. Experts may be stored per expert (``block_sparse_moe.experts.N.w1/w2/w3``,
what transformers 5 writes to disk) or fused (``mlp.experts.gate_up_proj / down_proj``, its in-memory
layout); both load. Loading is strict: every checkpoint tensor is consumed, every model tensor filled,
shapes and counts must match config.json, and each problem is a ValueError naming the key, the shapes
and the fix (models/hf/weights.py). Features moekit's model lacks fail up front (models/hf/families.py).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from moekit.models.config import ModelConfig
from moekit.models.hf.families import (
    MIXTRAL, UnsupportedCheckpoint, check_mixtral_exportable, family, mixtral_hf_config,
)
from moekit.models.hf.io import DTYPE_NAMES, CONFIG_FILE, CheckpointReader, read_config, write_safetensors
from moekit.models.hf.weights import check_counts, detect_layout, export_tensors, load_into, model_rules
from moekit.models.transformer import Transformer

SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
LAYOUTS = ("per_expert", "fused")

__all__ = ["load_hf", "load_hf_into", "load_mixtral", "save_mixtral", "config_from_hf", "check_mixtral_exportable",
           "UnsupportedCheckpoint"]


def config_from_hf(path: str | Path) -> ModelConfig:
    """The moekit ModelConfig for a HuggingFace folder's config.json (raises for unsupported features)."""
    hf = read_config(path)
    return family(hf, path).to_config(hf)


def load_hf(path: str | Path, *, dtype: torch.dtype | str = torch.float32,
            device: str | torch.device = "cpu") -> Transformer:
    """Build a moekit Transformer from a HuggingFace folder, dispatching on config.json's model_type.

    dtype: parameter dtype of the returned model; "auto" keeps the checkpoint's (it must be uniform).
    Returns the model in eval mode, as ``from_pretrained`` does.
    """
    config = config_from_hf(path)
    with torch.device("meta"):
        model = Transformer(config)
    model.to_empty(device=device)
    reader = load_hf_into(model, path, check_config=False)
    return model.to(_resolve_dtype(dtype, reader)).eval()


def load_hf_into(model: Transformer, path: str | Path, *, check_config: bool = True) -> CheckpointReader:
    """Fill an already built ``model`` (e.g. train.py's, on its device) from a HuggingFace folder in place.

    The model's config may differ from the import's only in fields that do not change the forward math
    (capacity, loss coefficients, bias update rate, backend, max_seq_len, ...): anything else is a
    ValueError naming the fields, so fine-tuning never starts from silently mismatched weights.
    """
    hf = read_config(path)
    fam = family(hf, path)
    if check_config:
        _check_same_math(model.config, fam.to_config(hf), path)
    reader = CheckpointReader(path)
    keys = set(reader.infos)
    layouts = [detect_layout(keys, i, fam.naming) for i in range(model.config.num_layers)]
    blocks, fused = [b for b, _ in layouts], [f for _, f in layouts]
    check_counts(reader, model, fam.naming, blocks, fused, fam.layers_field)
    _check_lm_head(reader, model.config)
    tied_extra = {"lm_head.weight"} if model.config.tie_embeddings and "lm_head.weight" in keys else set()
    load_into(model, reader, model_rules(model, fam.naming, blocks, fused), tied_extra)
    if tied_extra:
        _check_tied_copy(reader, model)
    _zero_non_persistent_buffers(model)
    return reader


def load_mixtral(path: str | Path, **kwargs) -> Transformer:
    """``load_hf`` for a Mixtral folder (DESIGN.md contract); other model types are a ValueError."""
    model_type = read_config(path).get("model_type")
    if model_type != "mixtral":
        raise ValueError(f"{path}/config.json has model_type={model_type!r}, not 'mixtral'; use models.hf.load_hf "
                         f"for other families")
    return load_hf(path, **kwargs)


def save_mixtral(model: Transformer, path: str | Path, *, dtype: torch.dtype | None = None,
                 max_shard_size: int | str = "5GB", layout: str = "per_expert") -> Path:
    """Write ``model`` as a HuggingFace Mixtral folder; returns the folder.

    dtype: tensor dtype on disk (default: the model's). max_shard_size: bytes or "5GB"-style; larger
    models are sharded with an index, as save_pretrained does. layout: "per_expert" writes
    ``block_sparse_moe.experts.N.w1/w2/w3`` (what save_pretrained writes), "fused" writes
    ``mlp.experts.gate_up_proj / down_proj``; transformers loads both.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is invalid; choose one of {list(LAYOUTS)}")
    if dtype is not None and dtype not in DTYPE_NAMES.values():
        raise ValueError(f"dtype={dtype} is not supported; use one of {list(DTYPE_NAMES)}")
    check_mixtral_exportable(model)
    L = model.config.num_layers
    block = MIXTRAL.moe_blocks[layout == "fused"]  # fused tensors live under "mlp", as in transformers' modules
    rules = model_rules(model, MIXTRAL, [block] * L, [layout == "fused"] * L)
    tensors = export_tensors(model, rules, dtype)
    out_dtype = dtype or next(model.parameters()).dtype
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    name = {v: k for k, v in DTYPE_NAMES.items()}[out_dtype]
    (folder / CONFIG_FILE).write_text(json.dumps(mixtral_hf_config(model.config, name), indent=2) + "\n")
    write_safetensors(tensors, folder, max_shard_size)
    return folder


# Fields that shape the forward pass of a loaded model; the rest (capacity_factor, aux/z-loss coefficients,
# expert_backend, max_seq_len, init_std, name, router options the import does not set) are the trainer's.
MATH_FIELDS = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "attn_head_dim", "rope_theta",
               "norm_eps", "tie_embeddings", "activation", "num_experts", "moe_ffn_hidden_size", "ffn_hidden_size",
               "shared_ffn_hidden_size", "shared_expert_gate", "top_k", "router")


def _check_same_math(have: ModelConfig, want: ModelConfig, path) -> None:
    dense_used = any(not want.is_moe_layer(i) for i in range(want.num_layers))
    fields = [f for f in MATH_FIELDS if f != "ffn_hidden_size" or dense_used]  # unused when every layer is MoE
    diffs = [f"{f}={getattr(have, f, None)!r} (model) vs {getattr(want, f, None)!r} (checkpoint)" for f in fields
             if getattr(have, f, None) != getattr(want, f, None)]  # getattr: fields this ModelConfig may lack
    layers = [have.is_moe_layer(i) for i in range(have.num_layers)]
    if layers != [want.is_moe_layer(i) for i in range(want.num_layers)]:
        diffs.append(f"MoE layers first_dense_layers={have.first_dense_layers}, moe_every={have.moe_every} (model) vs "
                     f"{want.first_dense_layers}, {want.moe_every} (checkpoint)")
    diffs += [f"router_options[{k!r}]={have.router_options.get(k)!r} (model) vs {v!r} (checkpoint)"
              for k, v in want.router_options.items() if have.router_options.get(k) != v]
    if diffs:
        raise ValueError(f"{path}: the model was built for different math than this checkpoint: " + "; ".join(diffs)
                         + ". Build the model from models.hf.config_from_hf(path), overriding only training fields")


def _check_lm_head(reader: CheckpointReader, config: ModelConfig) -> None:
    if not config.tie_embeddings and "lm_head.weight" not in reader.infos:
        raise ValueError(f"{reader.folder}/config.json has tie_word_embeddings=false but the checkpoint has no "
                         f"lm_head.weight; set tie_word_embeddings to true if the output layer shares "
                         f"model.embed_tokens.weight, or add the missing tensor")


def _check_tied_copy(reader: CheckpointReader, model: Transformer) -> None:
    """A tied checkpoint may still store lm_head.weight; it must then be the embedding itself."""
    head = reader.get("lm_head.weight").to(model.embed.weight.dtype)
    if head.shape != model.embed.weight.shape or not torch.equal(head, model.embed.weight.cpu()):
        raise ValueError(f"{reader.folder}/config.json has tie_word_embeddings=true but lm_head.weight "
                         f"{list(head.shape)} differs from model.embed_tokens.weight "
                         f"{list(model.embed.weight.shape)}; set tie_word_embeddings to false")


def _zero_non_persistent_buffers(model: Transformer) -> None:
    """to_empty() leaves buffers uninitialised; those not in the checkpoint (pending load counts) start at 0."""
    persistent = set(model.state_dict())
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name not in persistent:
                buf.zero_()


def _resolve_dtype(dtype: torch.dtype | str, reader: CheckpointReader) -> torch.dtype:
    if dtype != "auto":
        if dtype not in DTYPE_NAMES.values():
            raise ValueError(f"dtype={dtype!r} is not supported; use torch.float32, torch.bfloat16, torch.float16 "
                             f"or 'auto'")
        return dtype
    found = reader.dtypes()
    if len(found) != 1 or next(iter(found)) not in SAFETENSORS_DTYPES:
        raise ValueError(f"dtype='auto' needs one floating dtype in the checkpoint, found {sorted(found)}; "
                         f"pass dtype=torch.float32 or torch.bfloat16")
    return SAFETENSORS_DTYPES[next(iter(found))]
