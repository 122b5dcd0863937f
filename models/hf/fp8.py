"""Block-wise float8 HuggingFace checkpoints, dequantized as they are read.

DeepSeek-V3 / R1 / V3.1 and the Qwen3 "-FP8" releases store every large linear weight in float8 with one
scale per block of ``weight_block_size`` elements; embeddings, norms, routers and lm_head stay in bf16/fp32:

    config.json   "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                                          "activation_scheme": "dynamic"}
    tensors       <module>.weight            float8_e4m3fn  [..., rows, cols]
                  <module>.weight_scale_inv  float32        [..., ceil(rows / 128), ceil(cols / 128)]
    value         weight[i, j] * weight_scale_inv[i // 128, j // 128]          (edge blocks are partial)

moekit keeps its weights in bf16 / fp32, so ``CheckpointReader`` returns each such weight dequantized to
float32 (the value above, as DeepSeek's fp8_cast_bf16 script computes it, without first writing a 1.3 TB bf16
copy of the model). A slice read (``load_hf_sharded``) reads the fp8 bytes of its slice and only the scale
blocks that cover it. Which tensors are quantized comes from the files: a float8 tensor with a
``weight_scale_inv`` beside it; ``modules_to_not_convert`` needs no handling.

Activations: "dynamic" (every release above) computes activation scales on the fly in fp8 inference kernels,
so a dequantized model loses nothing; "static" checkpoints carry calibrated input scales and are refused, as
are other quantization methods (GPTQ, AWQ, bitsandbytes, compressed-tensors...).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:
    from moekit.models.hf.io import TensorInfo

SCALE_SUFFIX = "_scale_inv"
FP8_NAMES = ("F8_E4M3", "F8_E5M2")  # safetensors dtype names of float8 weights
SCALE_NAMES = ("F32", "BF16", "F16", "F8_E8M0")  # of their scales (F8_E8M0: DeepSeek-V3.1's ue8m0 scales)
# fmt names the float8 encoding only (the tensors' own dtype decides the decode): DeepSeek writes "e4m3", MiniMax-M2
# torch's dtype name "float8_e4m3fn"
FORMATS = (None, "e4m3", "e5m2", "float8_e4m3fn", "float8_e5m2")
SCALE_FORMATS = (None, "float", "ue8m0")
DEFAULT_BLOCK = (128, 128)  # transformers' FineGrainedFP8Config default
NEEDS = ("moekit reads block-wise float8 checkpoints (quant_method 'fp8' with weight_block_size, dynamic "
         "activations) and float ones; dequantize this one to bf16 first, or use a bf16 release of the model")


@dataclass(frozen=True)
class BlockFp8:
    """How a checkpoint's float8 weights are scaled: one scale per ``block`` (rows, cols) of the last two dims."""

    block: tuple[int, int] = DEFAULT_BLOCK


def config_problems(quant: Any) -> list[str]:
    """One line per part of a ``quantization_config`` moekit cannot read (none for block-wise fp8)."""
    if not quant:
        return []
    if not isinstance(quant, dict):
        return [f"quantization_config={quant!r} is not an object; {NEEDS}"]
    method = quant.get("quant_method")
    if method == "mxfp4":  # gpt-oss's expert weights: read and dequantized by models/hf/mxfp4.py
        return []
    if method != "fp8":
        return [f"quantized weights (quantization_config, quant_method={method!r}): {NEEDS}"]
    problems = []
    if quant.get("fmt") not in FORMATS:
        problems.append(f"quantization_config fmt={quant['fmt']!r} (moekit reads {[f for f in FORMATS if f]})")
    if quant.get("scale_fmt") not in SCALE_FORMATS:
        problems.append(f"quantization_config scale_fmt={quant['scale_fmt']!r} (moekit reads "
                        f"{[f for f in SCALE_FORMATS if f]})")
    if quant.get("activation_scheme", "dynamic") != "dynamic":
        problems.append(f"quantization_config activation_scheme={quant['activation_scheme']!r}: calibrated "
                        f"activation scales (moekit reads 'dynamic', where a dequantized model loses nothing); {NEEDS}")
    block = quant.get("weight_block_size", list(DEFAULT_BLOCK))
    if not _is_block(block):
        problems.append(f"quantization_config weight_block_size={block!r} (moekit reads two positive integers, "
                        f"the rows and columns of one scale's block, e.g. [128, 128]; per-tensor or per-channel "
                        f"fp8 checkpoints: {NEEDS})")
    return problems


def _is_block(block: Any) -> bool:
    """Two positive ints: the rows and columns one scale covers."""
    return (isinstance(block, (list, tuple)) and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block))


def scheme(hf: dict) -> BlockFp8 | None:
    """The float8 scheme of a config.json, None for a float checkpoint; a ValueError when it cannot be read."""
    quant = hf.get("quantization_config")
    problems = config_problems(quant)
    if problems:
        raise ValueError("; ".join(problems))
    return BlockFp8(tuple(quant.get("weight_block_size", DEFAULT_BLOCK))) if quant else None


def grid(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """The scale tensor's shape for a weight of ``shape``."""
    return (*shape[:-2], math.ceil(shape[-2] / block[0]), math.ceil(shape[-1] / block[1]))


def pair_scales(infos: dict[str, TensorInfo], fp8: BlockFp8 | None, folder) -> dict[str, TensorInfo]:
    """Take every ``<key>_scale_inv`` out of ``infos`` (the model consumes the weights, not their scales) and
    return {weight key: its scale's info}, after checking each float8 weight has a scale of the right grid
    and each scale a float8 weight. All problems in one ValueError."""
    fp8_keys = [k for k, i in infos.items() if i.dtype in FP8_NAMES]
    scale_keys = [k for k in infos if k.endswith(SCALE_SUFFIX)]
    if not fp8_keys and not scale_keys:
        return {}
    if fp8 is None:
        raise ValueError(f"checkpoint {folder} holds float8 tensors (e.g. {(fp8_keys or scale_keys)[0]}) but its "
                         f"config.json has no quantization_config; add the quantization_config the model was "
                         f"released with (e.g. {{\"quant_method\": \"fp8\", \"weight_block_size\": [128, 128]}})")
    scales = {k[: -len(SCALE_SUFFIX)]: infos.pop(k) for k in scale_keys}
    problems = []
    unscaled = [k for k in fp8_keys if k not in scales]
    if unscaled:
        problems.append(f"{len(unscaled)} float8 tensor(s) without a {SCALE_SUFFIX} beside them: {unscaled[:3]}")
    for key, scale in scales.items():
        weight = infos.get(key)
        if weight is None or weight.dtype not in FP8_NAMES:
            what = "no such tensor" if weight is None else f"{key} is {weight.dtype}, not float8"
            problems.append(f"{key}{SCALE_SUFFIX} scales a float8 weight, but {what}")
        elif len(weight.shape) < 2:
            problems.append(f"{key} is a float8 tensor of shape {list(weight.shape)}; block scales need 2 dims or more")
        elif scale.shape != grid(weight.shape, fp8.block):
            problems.append(f"{key}{SCALE_SUFFIX} has shape {list(scale.shape)}, but {key} {list(weight.shape)} in "
                            f"blocks of {list(fp8.block)} (config.json weight_block_size) needs "
                            f"{list(grid(weight.shape, fp8.block))}")
        elif scale.dtype not in SCALE_NAMES:
            problems.append(f"{key}{SCALE_SUFFIX} is {scale.dtype}; scales are one of {list(SCALE_NAMES)}")
    if problems:
        raise ValueError(f"checkpoint {folder}: its float8 weights and their scales do not match:\n  "
                         + "\n  ".join(problems[:12]) + "\nRe-download the checkpoint, or fix config.json's "
                         "quantization_config to the one it was released with.")
    return scales


def scale_index(index: tuple[slice, ...], shape: tuple[int, ...], block: tuple[int, int]) -> tuple[slice, ...]:
    """The scale blocks that cover ``index`` (unit-step slices, one per dim) of a weight of ``shape``."""
    *lead, rows, cols = (range(*s.indices(n)) for s, n in zip(index, shape))
    return (*(slice(r.start, r.stop) for r in lead),
            slice(rows.start // block[0], math.ceil(rows.stop / block[0]) if len(rows) else rows.start // block[0]),
            slice(cols.start // block[1], math.ceil(cols.stop / block[1]) if len(cols) else cols.start // block[1]))


def check_scales(key: str, scale: Tensor) -> Tensor:
    """``scale`` (read for float8 weight ``key``) when every value is finite and positive, else a ValueError: a NaN
    or infinite scale would load as a model that generates garbage without a word."""
    bad = ~(torch.isfinite(scale.float()) & (scale.float() > 0))
    if bool(bad.any()):
        raise ValueError(f"{key}{SCALE_SUFFIX} holds {int(bad.sum())} scale(s) that are not finite and positive "
                         f"(e.g. {scale.float()[bad][0].item()}); the checkpoint is corrupt: re-download it")
    return scale


def dequantize(weight: Tensor, scale: Tensor, block: tuple[int, int], start: tuple[int, int] = (0, 0)) -> Tensor:
    """float32 values of a float8 ``weight`` slice whose first element is at (row, col) = ``start`` of the whole
    tensor; ``scale`` holds the scale blocks that cover it (``scale_index``), starting at the block of ``start``."""
    r0, c0 = start
    (b0, b1), R = block, weight.shape[-2]
    cols = torch.arange(c0, c0 + weight.shape[-1]) // b1 - c0 // b1
    col_scale = scale.float().index_select(-1, cols)  # [..., row blocks, C]: 1/b0 of the weight's size
    out = weight.float()
    r = 0
    while r < R:  # one scale row per row block, multiplied in place: no full-size scale matrix
        blk = (r0 + r) // b0 - r0 // b0
        end = min(R, (r0 // b0 + blk + 1) * b0 - r0)
        out[..., r:end, :].mul_(col_scale[..., blk:blk + 1, :])
        r = end
    return out


# ---------------------------------------------------------------------------------------------------
# Writing: save_hf(..., fp8=True) / save_hf_sharded / moekit-convert moekit-to-hf --fp8
# ---------------------------------------------------------------------------------------------------

E4M3_MAX = 448.0  # the largest float8_e4m3fn value
SCALE_FLOOR = 1e-12  # the scale of an all-zero block (its values stay 0); keeps w / scale finite
# DeepSeek-V3's MTP layer keeps its projection and its head copy in bf16 (vLLM reads them as plain linears)
NOT_QUANTIZED = ("embed_tokens", "lm_head", "norm", ".gate.weight", "shared_expert_gate.weight", "eh_proj",
                 "shared_head.head")


def quantizable(key: str, shape: tuple[int, ...]) -> bool:
    """What the fp8 releases store in float8: the linear layers' weights (attention, dense MLPs, experts, shared
    experts); not embeddings, norms, routers (``*.gate.weight``), Qwen2-MoE's shared-expert gate or lm_head."""
    return len(shape) == 2 and key.endswith(".weight") and not any(part in key for part in NOT_QUANTIZED)


def quantize(weight: Tensor, block: tuple[int, int]) -> tuple[Tensor, Tensor]:
    """(float8_e4m3fn weight, float32 weight_scale_inv) of a 2-d ``weight``: per block, scale = amax / 448 (at least
    SCALE_FLOOR) and weight / scale rounded to e4m3; dequantize(*quantize(w)) is w to e4m3's precision."""
    rows, cols = weight.shape
    b0, b1 = block
    padded = torch.zeros(math.ceil(rows / b0) * b0, math.ceil(cols / b1) * b1, dtype=torch.float32,
                         device=weight.device)
    padded[:rows, :cols] = weight
    blocks = padded.view(padded.shape[0] // b0, b0, padded.shape[1] // b1, b1)  # scales broadcast: no expanded copy
    scale = (blocks.abs().amax(dim=(1, 3)) / E4M3_MAX).clamp(min=SCALE_FLOOR)
    blocks.div_(scale[:, None, :, None]).clamp_(-E4M3_MAX, E4M3_MAX)
    return padded[:rows, :cols].to(torch.float8_e4m3fn), scale


def quantization_config(block: tuple[int, int]) -> dict[str, Any]:
    """config.json's quantization_config for weights written by ``quantize``."""
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)}


def check_block(block: Any) -> tuple[int, int]:
    """``block`` as (rows, cols) of positive ints, or a ValueError naming it."""
    if not _is_block(block):
        raise ValueError(f"fp8_block={block!r} is invalid; give (rows, cols) of one scale's block, e.g. (128, 128)")
    return int(block[0]), int(block[1])


def quantize_tensors(tensors: dict[str, Tensor], block: tuple[int, int]) -> dict[str, Tensor]:
    """``tensors`` (HF key -> tensor) with every quantizable one replaced by its float8 weight followed by its
    ``weight_scale_inv``."""
    out: dict[str, Tensor] = {}
    for key, t in tensors.items():
        if quantizable(key, tuple(t.shape)):
            out[key], out[key + SCALE_SUFFIX] = quantize(t, block)
        else:
            out[key] = t
    return out
