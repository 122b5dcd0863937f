"""HuggingFace safetensors import and export.

    load_hf(path)              a folder of any supported model_type -> Transformer (families.FAMILIES):
                               mixtral, qwen2_moe, qwen3_moe, olmoe, deepseek_v3 / v2, glm4_moe(_lite), dots1,
                               minimax_m2, ernie4_5_moe, gpt_oss; dense llama, qwen2, qwen3
    save_hf(model, path)       a folder transformers loads with the same logits, as the family the model came
                               from or the nearest one that reproduces it (export.choose_family), with the
                               tokenizer files when there is a tokenizer to carry
    load_mixtral / save_mixtral  the same, insisting on / writing Mixtral
    config_from_hf(path)       the ModelConfig an import builds, without reading any weights
    load_hf_into(model, path)  fill a model built elsewhere (train.py --init-from-hf), checking its config
    check_hf_exportable(model) the family save_hf would write, or a ValueError naming why none fits
    load_hf_sharded(model, path) / save_hf_sharded(model, path)
                               the same for an already parallelised model (TP / EP / FSDP shards): each rank
                               reads only its slices, and writes its own files (models/hf/sharded.py)

A folder is config.json plus model.safetensors, or shards plus model.safetensors.index.json, as
``save_pretrained`` writes it. Experts may be stored per expert (``block_sparse_moe.experts.N.w1/w2/w3``,
``mlp.experts.N.gate_proj/...``, what transformers 5 writes to disk) or fused (``mlp.experts.gate_up_proj /
down_proj``, its in-memory layout); both load. Loading is strict: every checkpoint tensor is consumed
(DeepSeek-V3's multi-token-prediction layers are skipped with a warning), every model tensor filled,
shapes and counts must match config.json, and each problem is a ValueError naming the key, the shapes
and the fix (models/hf/weights.py). Features moekit's model lacks fail up front, all listed
(``UnsupportedCheckpoint``, models/hf/families.py).

An imported model remembers its family twice: ``model.hf_family`` (and ``model.hf_source``, the folder),
and its config's name ``hf:<model_type>``, which survives moekit checkpoints and moekit-convert files.
"""
from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from moekit.models.config import ModelConfig
from moekit.models.hf import fp8
from moekit.models.hf.fp8 import quantizable, quantize_tensors
from moekit.models.hf.mxfp4 import MXFP4_CONFIG, MXFP4_EXPERTS, dequantize_mxfp4, quantize_mxfp4
from moekit.models.hf.export import choose_family, copy_tokenizer, export_problems, hf_config, zero_fill
from moekit.models.hf.families import (FAMILIES, MTP_COPIES, MTP_FAMILIES, Family, UnsupportedCheckpoint, family,
                                      mtp_layers_present, skipped_keys)
from moekit.models.hf.io import DTYPE_NAMES, CONFIG_FILE, CheckpointReader, read_config, write_safetensors
from moekit.models.hf.weights import (Rule, _one, check_counts, detect_layout, export_tensors, layer_prefix,
                                      load_into, model_rules)
from moekit.models.lora import fold_lora
from moekit.models.transformer import Transformer, meta_device

SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
LAYOUTS = ("per_expert", "fused")

__all__ = ["load_hf", "load_hf_into", "load_mixtral", "save_hf", "save_mixtral", "config_from_hf",
           "check_hf_exportable", "check_mixtral_exportable", "export_problems", "UnsupportedCheckpoint", "FAMILIES",
           "load_hf_sharded", "save_hf_sharded"]



def config_from_hf(path: str | Path) -> ModelConfig:
    """The moekit ModelConfig for a HuggingFace folder's config.json (raises for unsupported features)."""
    hf = read_config(path)
    config = family(hf, path).to_config(hf)
    if config.mtp_layers:  # the multi-token-prediction layers the folder holds (a config-only folder: as it says)
        try:
            keys = CheckpointReader(path, fp8.scheme(hf)).infos
        except ValueError:  # no weights here (a config alone), or unreadable ones, which the load itself reports
            return config
        config.mtp_layers = mtp_layers_present(hf, keys, config.num_layers)
    return config


def load_hf(path: str | Path, *, dtype: torch.dtype | str = torch.float32,
            device: str | torch.device = "cpu", buffers_fp32: bool = False) -> Transformer:
    """Build a moekit Transformer from a HuggingFace folder, dispatching on config.json's model_type.

    dtype: parameter dtype of the returned model; "auto": config.json's ``dtype`` (``torch_dtype``), as
    ``from_pretrained(dtype="auto")`` reads it, else the checkpoint's (it must then be uniform). The parameters
    are allocated in that dtype and filled there (a bf16 model never exists in fp32 first: half the peak
    memory), with the rounding a load in fp32 and a cast would give. Buffers (a router's expert_bias) take the
    dtype too, or stay float32 with ``buffers_fp32`` (routing computes in float32: moekit.train.inference).
    Returns the model in eval mode, as ``from_pretrained`` does.
    """
    config = config_from_hf(path)
    target = _resolve_dtype(dtype, path)
    with meta_device():
        model = Transformer(config)
    for p in model.parameters():  # on the meta device: no memory yet
        p.data = p.data.to(target)
    model.to_empty(device=device)
    load_hf_into(model, path, check_config=False)
    return (model if buffers_fp32 else model.to(target)).eval()


def load_hf_into(model: Transformer, path: str | Path, *, check_config: bool = True) -> CheckpointReader:
    """Fill an already built ``model`` (e.g. train.py's, on its device) from a HuggingFace folder in place.

    The model's config may differ from the import's only in fields that do not change the forward math
    (capacity, loss coefficients, bias update rate, backend, max_seq_len, name, ...): anything else is a
    ValueError naming the fields, so fine-tuning never starts from silently mismatched weights.
    """
    spec = plan_load(model, path, check_config)
    load_into(model, spec.reader, spec.rules, spec.allowed_extra)
    if spec.tied_copy:
        _check_tied_copy(spec.reader, model)
    state = model.state_dict()
    for key, main in spec.mtp_copies:
        copy = spec.reader.get(key)
        if copy.shape != state[main].shape or not torch.equal(copy.to(state[main].dtype), state[main].cpu()):
            raise ValueError(mtp_copy_differs(spec.reader.folder, key, main))
    _zero_non_persistent_buffers(model)
    model.hf_family, model.hf_source = spec.family.model_type, Path(path)
    return spec.reader


@dataclass
class LoadSpec:
    """What loading ``path`` into a model takes, checked from config.json and the file headers (no data read)."""

    family: Family
    reader: CheckpointReader
    rules: list[Rule]  # one per model tensor (models/hf/weights.py)
    allowed_extra: set[str]  # keys no rule consumes on purpose: skipped MTP layers, a tied lm_head copy, empty tensors
    tied_copy: bool  # the checkpoint stores lm_head.weight for a tied model: it must equal the embedding
    # (checkpoint key, model tensor) of each loaded MTP layer's copies of the embedding and the head: the depths
    # share the main tensors (models.mtp), so the copies must equal them
    mtp_copies: tuple[tuple[str, str], ...] = ()


def plan_load(model: Transformer, path: str | Path, check_config: bool = True) -> LoadSpec:
    """The checks every HF load makes before reading data (the config's math, layer and expert counts, the
    output layer) and the rules it fills the model by; load_hf_into and load_hf_sharded both start here.
    Missing / extra keys and shapes are then checked against the rules (weights.check_keys)."""
    hf = read_config(path)
    fam = family(hf, path)
    if check_config:
        check_same_math(model.config, fam.to_config(hf), path)
    reader = CheckpointReader(path, fp8.scheme(hf), fam.reader_rename())
    if fam.split is not None:  # fused tensors read as the ones the rules map (Qwen3-Next)
        fam.split(hf, reader)
    keys = set(reader.infos)
    skipped = skipped_keys(hf, keys, model.config.num_layers, path, model.config.mtp_layers)
    # models.mtp: the checkpoint's MTP layers follow the main ones and fill the model's first depths; depths it
    # lacks keep their initialisation (families.skipped_keys leaves out the layers the model has no depth for)
    mtp = getattr(model, "mtp", None) or ()  # (a pipeline rank without the last stage has none)
    depths = min(len(mtp), mtp_layers_present(hf, keys, model.config.num_layers))
    L = model.config.num_layers
    layouts = [detect_layout(keys, i, fam.naming, layer_prefix(fam.naming, L, i)) for i in range(L + depths)]
    blocks, fused = [b for b, _ in layouts], [f for _, f in layouts]
    check_counts(reader, model, fam.naming, blocks, fused, fam.layers_field, skipped, depths)
    _check_lm_head(reader, model.config)
    tied = model.config.tie_embeddings and "lm_head.weight" in keys
    rules = model_rules(model, fam.naming, blocks, fused, depths)
    # tensors without elements hold nothing to load: transformers saves n_shared_experts=0 as [0, H] shared experts
    empty = {k for k, info in reader.infos.items() if 0 in info.shape}
    head = "embed.weight" if model.config.tie_embeddings else "lm_head.weight"
    stored_copies = depths if fam.naming.mtp == "deepseek" else 0  # Qwen's MTP layer shares the main ones
    copies = tuple((f"model.layers.{L + j}.{copy}", main) for j in range(stored_copies)
                   for copy, main in zip(MTP_COPIES, ("embed.weight", head)) if f"model.layers.{L + j}.{copy}" in keys)
    return LoadSpec(fam, reader, rules, ({"lm_head.weight"} if tied else set()) | skipped | empty, tied, copies)


def load_mixtral(path: str | Path, **kwargs) -> Transformer:
    """``load_hf`` for a Mixtral folder (DESIGN.md contract); other model types are a ValueError."""
    model_type = read_config(path).get("model_type")
    if model_type != "mixtral":
        raise ValueError(f"{path}/config.json has model_type={model_type!r}, not 'mixtral'; use models.hf.load_hf "
                         f"for other families")
    return load_hf(path, **kwargs)


def check_hf_exportable(model: Transformer, family: str | None = None) -> str:
    """The family ``save_hf(model, ..., family=family)`` writes; a ValueError naming every reason if none."""
    return choose_family(model, family)


def check_mixtral_exportable(model: Transformer) -> None:
    """Raise naming the parts of ``model`` whose math transformers' Mixtral cannot express."""
    problems = export_problems(model, "mixtral")
    if problems:
        raise ValueError("Mixtral cannot reproduce this model: " + "; ".join(problems))


def export_rules(model: Transformer, family: str | None, dtype: torch.dtype | None,
                 layout: str) -> tuple[str, list[Rule], torch.dtype]:
    """(the family written, the rules mapping the model's tensors to its keys, the dtype on disk) for an export;
    save_hf and save_hf_sharded both start here. Bad arguments and unexportable models are ValueErrors."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is invalid; choose one of {list(LAYOUTS)}")
    if dtype is not None and dtype not in DTYPE_NAMES.values():
        raise ValueError(f"dtype={dtype} is not supported; use one of {list(DTYPE_NAMES)}")
    name = choose_family(model, family)
    mtp = getattr(model, "mtp", ())  # a pipeline's stage container has none (MTP runs without pp)
    naming = FAMILIES[name].naming
    depths = len(mtp) if name in MTP_FAMILIES else 0  # models.mtp: DeepSeek-V3's and Qwen's formats store them
    if naming.mtp == "qwen":
        depths = min(depths, 1)  # Qwen's releases hold one MTP layer (vLLM shares its fc among more)
    if len(mtp) > depths:
        warnings.warn(f"{len(mtp) - depths} of the model's {len(mtp)} multi-token-prediction depth(s) are not "
                      f"written: {name} has no place for them (deepseek_v3, glm4_moe and glm4_moe_lite store any "
                      f"number, the Qwen families one); the main model is exported whole and its logits are "
                      f"unaffected", stacklevel=3)
    L = model.config.num_layers + depths
    fused = layout == "fused" or naming.experts_in_out  # Llama 4 stores only its fused [E, in, out] experts
    block = naming.moe_blocks[-1 if fused else 0]  # fused tensors live under "mlp", as in transformers
    rules = model_rules(model, naming, [block] * L, [fused] * L, depths)
    head = "embed.weight" if getattr(model, "lm_head", None) is None else "lm_head.weight"
    for i in range(model.config.num_layers, L if naming.mtp == "deepseek" else 0):  # each MTP layer's copies of
        # the shared tensors, as DeepSeek-V3 released them
        rules += [_one("embed.weight", f"model.layers.{i}.embed_tokens.weight", "vocab_size, hidden_size"),
                  _one(head, f"model.layers.{i}.shared_head.head.weight", "vocab_size, hidden_size")]
    return name, rules, dtype or next(model.parameters()).dtype


def fp8_export_args(fp8_on: bool, fp8_block, dtype: torch.dtype | None,
                    layout: str) -> tuple[tuple[int, int] | None, torch.dtype | None]:
    """(the fp8 block or None, the dtype of the other tensors) of an export; save_hf and save_hf_sharded share it.
    fp8 writes the linear weights as the released fp8 checkpoints do (models/hf/fp8.py), the rest in bf16 unless
    ``dtype`` says otherwise."""
    if not fp8_on:
        return None, dtype
    if layout != "per_expert":
        raise ValueError(f"fp8=True writes per-expert tensors, as the released fp8 checkpoints do; layout={layout!r} "
                         f"is not supported with it: use layout='per_expert'")
    return fp8.check_block(fp8_block), dtype or torch.bfloat16


def save_hf(model: Transformer, path: str | Path, *, family: str | None = None, dtype: torch.dtype | None = None,
            max_shard_size: int | str = "5GB", layout: str = "per_expert",
            tokenizer_from: str | Path | None = None, fp8: bool = False,
            fp8_block: tuple[int, int] = fp8.DEFAULT_BLOCK, mxfp4: bool = False) -> Path:
    """Write ``model`` as a HuggingFace folder that ``AutoModelForCausalLM.from_pretrained`` loads with the
    same logits; returns the folder.

    family: a model_type of ``FAMILIES``; default: the family the model was imported from, else the
    nearest that reproduces it (models/hf/export.py); a family that cannot reproduce it is a ValueError
    naming every reason. dtype: tensor dtype on disk (default: the model's). max_shard_size: bytes or
    "5GB"-style; larger models are sharded with an index, as save_pretrained does. layout: "per_expert"
    writes ``experts.N.<proj>.weight`` (what save_pretrained writes), "fused" writes ``mlp.experts.gate_up_proj
    / down_proj``; transformers loads both. tokenizer_from: a HuggingFace folder or a moekit run directory
    whose tokenizer is written beside the model (default: the folder the model was imported from, if it
    has tokenizer files). fp8: the linear layers' weights in block-wise float8 e4m3 with one float32 scale per
    ``fp8_block`` (DeepSeek-V3's release format, which transformers, vLLM and SGLang read), the other tensors in
    ``dtype`` (default bf16); per-expert layout only. mxfp4 (gpt-oss only): the experts' gate_up_proj / down_proj
    in MXFP4 blocks and scales, as OpenAI released gpt-oss (models/hf/mxfp4.py), the other tensors in ``dtype``
    (default bf16). A model with LoRA adapters (models.lora) is written merged: the adapters are folded into its
    weights in place first (``fold_lora``: the model computes the same, its adapters' B factors become 0).
    """
    block, dtype = fp8_export_args(fp8, fp8_block, mxfp4_export_dtype(mxfp4, fp8, dtype), layout)
    name, rules, out_dtype = export_rules(model, family, dtype, layout)
    check_mxfp4_family(mxfp4, name)
    fold_lora(model)  # LoRA adapters (models.lora) go into the weights: HF checkpoints hold the merged model
    if mxfp4:  # the experts from the model's own precision, quantized once
        tensors = export_tensors(model, rules, None)
        tensors = {k: t if k.endswith(MXFP4_EXPERTS) else t.to(out_dtype) if t.is_floating_point() else t
                   for k, t in tensors.items()}
    elif block is None:
        tensors = export_tensors(model, rules, dtype)
    else:  # the weights to quantize keep the model's precision; the rest are cast
        tensors = {k: t if not t.is_floating_point() or quantizable(k, tuple(t.shape)) else t.to(out_dtype)
                   for k, t in export_tensors(model, rules, None).items()}
    tensors.update(zero_fill(model, name, out_dtype))
    if FAMILIES[name].fuse is not None:  # the family's fused tensors (Qwen3-Next's in_proj_qkvz / in_proj_ba)
        tensors = FAMILIES[name].fuse(hf_config(model, name, "float32"), tensors)
    if block is not None:
        tensors = quantize_tensors(tensors, block)
    if mxfp4:
        tensors = mxfp4_tensors(tensors)
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    source = tokenizer_from if tokenizer_from is not None else _imported_tokenizer(model)
    token_ids = copy_tokenizer(source, folder, model.config.vocab_size, model.config.max_seq_len) if source else {}
    dtype_name = {v: k for k, v in DTYPE_NAMES.items()}[out_dtype]
    config = hf_config(model, name, dtype_name, token_ids, block)
    if mxfp4:
        config["quantization_config"] = MXFP4_CONFIG
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    write_safetensors(tensors, folder, max_shard_size)
    return folder


def mxfp4_export_dtype(mxfp4: bool, fp8_on: bool, dtype: torch.dtype | None) -> torch.dtype | None:
    """The dtype of an export's other tensors (bf16 by default beside MXFP4 experts); fp8 with it is refused.
    save_hf and save_hf_sharded share it, and check_mxfp4_family once the family is known."""
    if mxfp4 and fp8_on:
        raise ValueError("fp8=True and mxfp4=True each quantize the expert weights; choose one")
    return (dtype or torch.bfloat16) if mxfp4 else dtype


def check_mxfp4_family(mxfp4: bool, name: str) -> None:
    if mxfp4 and name != "gpt_oss":
        raise ValueError(f"mxfp4=True writes gpt-oss's MXFP4 experts; this model exports as {name}: drop mxfp4 (or "
                         f"use fp8=True for block-wise float8)")


def mxfp4_tensors(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """Each gpt-oss expert weight X [E, in, out] as X_blocks and X_scales (models/hf/mxfp4.py), in key order."""
    out: dict[str, Tensor] = {}
    for key, t in tensors.items():
        if key.endswith(MXFP4_EXPERTS):
            out[key + "_blocks"], out[key + "_scales"] = quantize_mxfp4(t.float())
        else:
            out[key] = t
    return out


@torch.no_grad()
def mxfp4_reference(model: Transformer, dtype: torch.dtype = torch.bfloat16, family: str | None = None) -> Transformer:
    """A copy of ``model`` holding what ``save_hf(model, mxfp4=True, dtype=dtype)`` stores: the expert weights
    through MXFP4 and back, the other tensors rounded to ``dtype`` (moekit-convert --mxfp4 --verify checks a reload
    against it; against ``model`` it measures what MXFP4 costs)."""
    import copy

    _, rules, _ = export_rules(model, family, dtype, "per_expert")
    ref = copy.deepcopy(model)
    state = ref.state_dict()
    for r in rules:
        target = state[r.target]
        if target.is_floating_point():
            parts = [dequantize_mxfp4(*quantize_mxfp4(part.float()), torch.float32, name=key)
                     if key.endswith(MXFP4_EXPERTS) else part.to(dtype)
                     for key, part in zip(r.sources, r.split(target))]
            target.copy_(r.join(parts))
    return ref


@torch.no_grad()
def fp8_reference(model: Transformer, *, family: str | None = None, dtype: torch.dtype | None = None,
                  fp8_block: tuple[int, int] = fp8.DEFAULT_BLOCK) -> Transformer:
    """A copy of ``model`` holding what ``save_hf(model, fp8=True, ...)`` stores: each quantized weight replaced by
    its dequantized float8 value, the other tensors rounded to the export's dtype. Loading that export must give
    this model's logits (moekit-convert --fp8 --verify checks it); comparing with ``model`` measures what fp8 costs."""
    import copy

    block, dtype = fp8_export_args(True, fp8_block, dtype, "per_expert")
    _, rules, out_dtype = export_rules(model, family, dtype, "per_expert")
    ref = copy.deepcopy(model)
    state = ref.state_dict()
    for r in rules:
        target = state[r.target]
        if not target.is_floating_point():
            continue
        parts = []
        for key, part in zip(r.sources, r.split(target)):
            if quantizable(key, tuple(part.shape)):
                parts.append(fp8.dequantize(*fp8.quantize(part, block), block))
            else:
                parts.append(part.to(out_dtype))
        target.copy_(r.join(parts))
    return ref


def save_mixtral(model: Transformer, path: str | Path, *, dtype: torch.dtype | None = None,
                 max_shard_size: int | str = "5GB", layout: str = "per_expert",
                 tokenizer_from: str | Path | None = None) -> Path:
    """``save_hf(model, path, family="mixtral", ...)``: a folder MixtralForCausalLM loads with the same logits."""
    return save_hf(model, path, family="mixtral", dtype=dtype, max_shard_size=max_shard_size, layout=layout,
                   tokenizer_from=tokenizer_from)


def _imported_tokenizer(model: Transformer) -> Path | None:
    """The folder ``model`` was imported from, when it still holds a tokenizer."""
    source = getattr(model, "hf_source", None)
    if source is not None and any((Path(source) / f).is_file() for f in ("tokenizer.json", "tokenizer.model",
                                                                          "tiktoken.model")):
        return Path(source)
    return None


# Fields that shape the forward pass of a loaded model; the rest (capacity_factor, aux/z-loss coefficients,
# expert_backend, max_seq_len, init_std, name, router options the import does not set) are the trainer's.
MATH_FIELDS = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "attn_head_dim", "rope_theta",
               "rope_scaling", "norm_eps", "tie_embeddings", "activation", "attention", "attention_bias", "qk_norm",
               "qkv_clip", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
               "rope_interleave", "partial_rotary_factor", "num_experts", "moe_ffn_hidden_size", "ffn_hidden_size",
               "shared_ffn_hidden_size", "shared_expert_gate", "top_k", "router", "attention_out_bias",
               "attention_sinks", "sliding_window", "full_attention_every", "moe_ffn_bias", "rope_pairs",
               "attention_output_gate", "norm_zero_centered", "linear_attention", "linear_num_key_heads",
               "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel")


TRAINING_ONLY = ("balance",)  # router options that shape the training loss only, never the logits
MLA_ONLY = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "rope_interleave")
MOE_ONLY = ("moe_ffn_hidden_size", "shared_ffn_hidden_size", "shared_expert_gate", "top_k", "router", "moe_ffn_bias")


def math_differences(have: ModelConfig, want: ModelConfig) -> list[str]:
    """Where ``have`` (the model being built) computes other math than ``want`` (a checkpoint's config): a field of
    MATH_FIELDS the model uses, the MoE layer pattern, a router option other than TRAINING_ONLY. Training-only fields
    (capacity, loss coefficients, the expert backend) may differ."""
    unused = set(MLA_ONLY) if want.attention != "mla" else {"num_kv_heads", "attn_head_dim"}
    if all(want.is_moe_layer(i) for i in range(want.num_layers)):
        unused.add("ffn_hidden_size")  # the dense FFN width is unused when every layer is MoE
    if want.num_experts == 0:
        unused.update(MOE_ONLY)
    fields = [f for f in MATH_FIELDS if f not in unused]
    diffs = [f"{f}={getattr(have, f, None)!r} (model) vs {getattr(want, f, None)!r} (checkpoint)" for f in fields
             if getattr(have, f, None) != getattr(want, f, None)]  # getattr: fields this ModelConfig may lack
    layers = [have.is_moe_layer(i) for i in range(have.num_layers)]
    if layers != [want.is_moe_layer(i) for i in range(want.num_layers)]:
        diffs.append(f"MoE layers first_dense_layers={have.first_dense_layers}, moe_every={have.moe_every} (model) vs "
                     f"{want.first_dense_layers}, {want.moe_every} (checkpoint)")
    diffs += [f"router_options[{k!r}]={have.router_options.get(k)!r} (model) vs {v!r} (checkpoint)"
              for k, v in want.router_options.items() if have.router_options.get(k) != v and k not in TRAINING_ONLY]
    return diffs


def check_same_math(have: ModelConfig, want: ModelConfig, path) -> None:
    """ValueError naming ``path`` and every math_differences."""
    diffs = math_differences(have, want)
    if diffs:
        raise ValueError(f"{path}: the model was built for different math than this checkpoint: " + "; ".join(diffs)
                         + ". Build the model from models.hf.config_from_hf(path), overriding only training fields")


def _check_lm_head(reader: CheckpointReader, config: ModelConfig) -> None:
    if not config.tie_embeddings and "lm_head.weight" not in reader.infos:
        raise ValueError(f"{reader.folder}/config.json has tie_word_embeddings=false but the checkpoint has no "
                         f"lm_head.weight; set tie_word_embeddings to true if the output layer shares "
                         f"model.embed_tokens.weight, or add the missing tensor")


def mtp_copy_differs(folder, key: str, main: str) -> str:
    """The error for an MTP layer's embedding / head copy that is not the main model's tensor."""
    hf = "model.embed_tokens.weight" if main == "embed.weight" else "lm_head.weight"
    return (f"{folder}: {key}, the multi-token-prediction layer's copy of {hf}, differs from it; moekit's MTP depths "
            f"share the main model's embedding and head (DeepSeek-V3 section 2.2), so that layer would not compute "
            f"what it was trained to: load it with --model.mtp_layers 0 (leaves the layer out), or fix the copy")


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


def _resolve_dtype(dtype: torch.dtype | str, path: str | Path) -> torch.dtype:
    """load_hf's ``dtype``: as given, or for "auto" config.json's, else the checkpoint's (its headers read)."""
    if dtype != "auto":
        if dtype not in DTYPE_NAMES.values():
            raise ValueError(f"dtype={dtype!r} is not supported; use torch.float32, torch.bfloat16, torch.float16 "
                             f"or 'auto'")
        return dtype
    hf = read_config(path)
    named = hf.get("dtype", hf.get("torch_dtype"))  # transformers 5 writes "dtype", 4 "torch_dtype"
    if named in DTYPE_NAMES:
        return DTYPE_NAMES[named]
    found = CheckpointReader(path, fp8.scheme(hf)).dtypes()
    if len(found) != 1 or next(iter(found)) not in SAFETENSORS_DTYPES:
        raise ValueError(f"dtype='auto' needs one floating dtype in the checkpoint, found {sorted(found)}; "
                         f"pass dtype=torch.float32 or torch.bfloat16")
    return SAFETENSORS_DTYPES[next(iter(found))]


from moekit.models.hf.sharded import load_hf_sharded, save_hf_sharded  # noqa: E402  (uses the helpers above)
