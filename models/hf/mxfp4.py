"""MXFP4 (OCP Microscaling FP4) expert weights, as OpenAI's gpt-oss checkpoints store them.

openai/gpt-oss-20b and -120b keep everything in bf16 except the MoE experts' two weight tensors, which are stored
as 4-bit E2M1 values with one power-of-two scale per 32 consecutive inputs:

    config.json   "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [...]}
    tensors       <layer>.mlp.experts.gate_up_proj_blocks  uint8 [E, out, G, 16]
                  <layer>.mlp.experts.gate_up_proj_scales  uint8 [E, out, G]          (same for down_proj)
    value         HF's dequantized layout [E, in, out], in = G * 32 (the [E, out, in] decode, transposed)

One output row ``o`` of expert ``e`` holds G blocks; block ``g`` covers inputs g*32 .. g*32+31:

    blocks[e, o, g, :]   16 bytes, 2 FP4 codes each, low nibble first
        byte j      bit  7   6   5   4   3   2   1   0
                        [ s | e   e | m ] [ s | e   e | m ]
                          input g*32+2j+1   input g*32+2j
    scales[e, o, g]      1 byte E8M0: the block's shared factor 2^(byte - 127); byte 255 is NaN

    E2M1 code s|ee|m:  ee = 0 -> 0.5 * m,  else (1 + m/2) * 2^(ee - 1), negated when s = 1
                       codes 0..7 = 0, 0.5, 1, 1.5, 2, 3, 4, 6; 8..15 = the same negated (8 is -0.0)

So weight[e, g*32 + k, o] = E2M1(code k of blocks[e, o, g]) * 2^(scales[e, o, g] - 127).

Every such product has at most two significant bits and an exponent in [-128, 129], so it is exact in float32
and bfloat16 (whose exponent range is float32's) whenever it is finite; ``dequantize_mxfp4`` computes it exactly,
bit for bit what transformers' ``convert_moe_packed_tensors`` gives, -0.0 included. float16 output rounds the way
any cast to float16 does (exponents below -24 flush to zero). Bytes 253 and 254 can overflow even float32
(6 * 2^127 > its max): a weight that would be inf, like one whose scale is NaN, is a ValueError naming the tensor
rather than a model that silently produces NaNs.

``quantize_mxfp4`` is the inverse, for test fixtures and export. Its exponent rule is the one that makes every
block fit: the smallest e with amax <= 6 * 2^e (what triton_kernels' MXFP4 downcast calls rounding the scale
up). OCP's reference rule, e = floor(log2(amax)) - 2, puts amax in [4, 8) * 2^e and so clips a block whose
amax / 2^e lands in (6, 8) to 6 * 2^e, an error of up to a quarter of amax; the fitting rule never clips, so
every value ends within half an E2M1 step of where it was (the step at its block's scale).
"""
from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import Tensor

MXFP4_SUFFIXES = ("_blocks", "_scales")
MXFP4_EXPERTS = ("experts.gate_up_proj", "experts.down_proj")  # gpt-oss's MXFP4 tensors (their biases stay bf16)
MXFP4_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": [  # as the gpt-oss release's config.json
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
BLOCK = 32  # values per shared exponent (OCP MX block size)
SCALE_BIAS = 127  # E8M0: value = 2^(byte - 127)
SCALE_NAN = 255  # E8M0's only special value
E_MIN, E_MAX = -SCALE_BIAS, 254 - SCALE_BIAS  # exponents the bytes 0..254 encode
FP4_MAX = 6.0
DEFAULT_CHUNK = 1 << 23  # decoded values per step of dequantize_mxfp4 (~100 MB of float32 temporaries)
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def _e2m1(code: int) -> float:
    """The value of a 4-bit E2M1 code, decoded from its fields (sign bit 3, exponent bits 2..1 bias 1, mantissa
    bit 0), so the table below is derived from the format rather than typed in."""
    sign = -1.0 if code & 0b1000 else 1.0
    exp, man = (code >> 1) & 0b11, code & 1
    mag = 0.5 * man if exp == 0 else (1.0 + 0.5 * man) * 2.0 ** (exp - 1)
    return sign * mag


E2M1_VALUES = tuple(_e2m1(c) for c in range(16))  # 0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, ... -6
# Round-to-nearest boundaries between consecutive magnitudes (codes c-1 and c), and whether a value exactly on
# the boundary goes up to code c: ties go to the even code (even mantissa bit), as IEEE round-half-even does.
_MIDPOINTS = tuple((E2M1_VALUES[c - 1] + E2M1_VALUES[c]) / 2 for c in range(1, 8))
_TIE_UP = tuple(c % 2 == 0 for c in range(1, 8))


def is_mxfp4(hf_config: dict) -> bool:
    """Whether config.json says the checkpoint's experts are MXFP4 (gpt-oss), so the loader must pair each
    ``_blocks`` tensor with its ``_scales`` and dequantize instead of reading the tensors as they are."""
    quant = hf_config.get("quantization_config")
    return isinstance(quant, dict) and str(quant.get("quant_method", "")).lower() == "mxfp4"


def mxfp4_pairs(keys: Iterable[str]) -> dict[str, tuple[str, str]]:
    """{dequantized name: (blocks key, scales key)} for the MXFP4 tensors among ``keys``; other keys are ignored.

    A blocks entry without its scales (or the reverse) cannot be decoded, and most likely means a truncated
    download or a shard index that misses a file, so it is a ValueError naming the key rather than a tensor
    that goes missing later with a vaguer message."""
    blocks_sfx, scales_sfx = MXFP4_SUFFIXES
    found: dict[str, dict[str, str]] = {}
    for key in keys:
        for sfx in MXFP4_SUFFIXES:
            if key.endswith(sfx) and len(key) > len(sfx):
                found.setdefault(key[:-len(sfx)], {})[sfx] = key
    unpaired = []
    for base, parts in sorted(found.items()):
        for have, lack in ((blocks_sfx, scales_sfx), (scales_sfx, blocks_sfx)):
            if have in parts and lack not in parts:
                unpaired.append(f"{parts[have]!r} has no {base + lack!r}")
    if unpaired:
        raise ValueError(f"MXFP4 tensors come in pairs (<name>_blocks uint8 [E, out, G, 16] with <name>_scales "
                         f"uint8 [E, out, G]), but {'; '.join(unpaired)}; the checkpoint is incomplete: "
                         f"re-download it, or check that model.safetensors.index.json lists every shard")
    return {base: (parts[blocks_sfx], parts[scales_sfx]) for base, parts in sorted(found.items())}


def _check_packed(blocks: Tensor, scales: Tensor, dtype: torch.dtype, what: str) -> None:
    """Every shape / dtype problem up front, before any memory is allocated for the output."""
    if not isinstance(blocks, Tensor) or not isinstance(scales, Tensor):
        raise ValueError(f"{what}: blocks and scales must be tensors, got {type(blocks).__name__} and "
                         f"{type(scales).__name__}")
    if blocks.dtype != torch.uint8:
        raise ValueError(f"{what}_blocks has dtype {blocks.dtype}; MXFP4 blocks are uint8 bytes holding two FP4 "
                         f"codes each (read the safetensors entry as stored, without casting)")
    if scales.dtype != torch.uint8:
        raise ValueError(f"{what}_scales has dtype {scales.dtype}; MXFP4 scales are uint8 E8M0 exponents (read the "
                         f"safetensors entry as stored, without casting)")
    if blocks.dim() != 4 or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(f"{what}_blocks has shape {tuple(blocks.shape)}; expected [experts, out, groups, "
                         f"{BLOCK // 2}] (16 bytes = 32 FP4 values per block)")
    if tuple(scales.shape) != tuple(blocks.shape[:-1]):
        raise ValueError(f"{what}_scales has shape {tuple(scales.shape)} but {what}_blocks "
                         f"{tuple(blocks.shape)} needs {tuple(blocks.shape[:-1])}: one scale per 16-byte block; "
                         f"the two entries do not belong together")
    if blocks.device != scales.device:
        raise ValueError(f"{what}: blocks on {blocks.device} but scales on {scales.device}; move both to one device")
    if dtype not in OUT_DTYPES:
        raise ValueError(f"{what}: dtype={dtype} is not a float type MXFP4 decodes to; use one of "
                         f"{[str(d) for d in OUT_DTYPES]}")


def _chunks(experts: int, rows: int, per_row: int, budget: int):
    """(e0, e1, r0, r1) slices of [experts, rows] covering about ``budget`` values each: whole experts at a time
    when one expert fits, else row ranges of one expert, so temporaries stay O(budget) whatever the shape."""
    rows_per = max(1, budget // max(1, per_row))
    if rows_per >= rows:
        step = max(1, rows_per // max(1, rows))
        for e0 in range(0, experts, step):
            yield e0, min(e0 + step, experts), 0, rows
    else:
        for e0 in range(experts):
            for r0 in range(0, rows, rows_per):
                yield e0, e0 + 1, r0, min(r0 + rows_per, rows)


def dequantize_mxfp4(blocks: Tensor, scales: Tensor, dtype: torch.dtype = torch.bfloat16, *, name: str = "",
                     chunk_values: int = DEFAULT_CHUNK) -> Tensor:
    """MXFP4 ``blocks`` [E, out, G, 16] and ``scales`` [E, out, G] -> the weight [E, in = G*32, out] in ``dtype``.

    The result is HF's dequantized layout, equal bit for bit to transformers' ``convert_moe_packed_tensors``. It
    is written straight into its final [E, in, out] place ``chunk_values`` values at a time, so the peak is the
    output plus one chunk's temporaries, instead of an [E, out, in] copy plus its transpose plus int64 indices
    for every code. ``name`` (e.g. ``model.layers.3.mlp.experts.down_proj``) is what the errors quote: a scale
    byte of 255 (E8M0 NaN) or a value that overflows ``dtype`` is a ValueError, never a silent NaN/inf weight.
    """
    what = name or "mxfp4 tensor"
    _check_packed(blocks, scales, dtype, what)
    if isinstance(chunk_values, bool) or not isinstance(chunk_values, int) or chunk_values < 1:
        raise ValueError(f"chunk_values={chunk_values!r}; it must be a positive int (values decoded per step)")
    experts, rows, groups, _ = blocks.shape
    width = groups * BLOCK
    if scales.numel() and bool((scales == SCALE_NAN).any()):
        bad = (scales == SCALE_NAN).nonzero()
        e, o, g = (int(i) for i in bad[0])
        raise ValueError(f"{what}_scales holds {len(bad)} NaN exponent(s) (E8M0 byte {SCALE_NAN}), the first at "
                         f"[{e}, {o}, {g}] (expert {e}, output row {o}, inputs {g * BLOCK}..{g * BLOCK + BLOCK - 1}); "
                         f"these weights would load as NaN: the checkpoint is corrupt, re-download it")

    work = torch.float64 if dtype == torch.float64 else torch.float32
    dev = blocks.device
    # byte -> its two values (low nibble first); exponent byte -> 2^(byte - 127). Both from exact Python floats.
    pair_table = torch.tensor([[E2M1_VALUES[b & 0xF], E2M1_VALUES[b >> 4]] for b in range(256)], dtype=work,
                              device=dev)
    pow_table = torch.tensor([math.ldexp(1.0, b - SCALE_BIAS) for b in range(SCALE_NAN)], dtype=work, device=dev)
    # Exponents above this may overflow dtype (6 * 2^e > its max); only then does a chunk get checked for inf.
    safe_e = math.floor(math.log2(torch.finfo(dtype).max / FP4_MAX))
    check_inf = scales.numel() > 0 and int(scales.max()) - SCALE_BIAS > safe_e

    out = torch.empty(experts, width, rows, dtype=dtype, device=dev)
    for e0, e1, r0, r1 in _chunks(experts, rows, width, chunk_values):
        codes = blocks[e0:e1, r0:r1].to(torch.int32)  # [ne, nr, G, 16]: int32, one chunk only
        vals = pair_table[codes]  # [ne, nr, G, 16, 2]
        del codes
        vals = vals.view(e1 - e0, r1 - r0, groups, BLOCK)
        vals.mul_(pow_table[scales[e0:e1, r0:r1].to(torch.int32)].unsqueeze(-1))  # exact: times a power of two
        dst = out[e0:e1, :, r0:r1]
        dst.copy_(vals.view(e1 - e0, r1 - r0, width).transpose(1, 2))
        del vals
        if check_inf and bool(torch.isinf(dst).any()):
            e, i, o = (int(v) for v in torch.isinf(dst).nonzero()[0])
            e, o, g = e + e0, o + r0, i // BLOCK
            raise ValueError(f"{what}: weight [expert {e}, input {i}, output {o}] overflows {dtype} (scale byte "
                             f"{int(scales[e, o, g])} = 2^{int(scales[e, o, g]) - SCALE_BIAS} times an FP4 value); "
                             f"dequantize to a wider dtype (float32 holds every scale up to byte 252), or the "
                             f"checkpoint is corrupt")
    return out


def quantize_mxfp4(w: Tensor) -> tuple[Tensor, Tensor]:
    """``w`` [E, in, out] (HF's dequantized layout) -> (blocks [E, out, in/32, 16], scales [E, out, in/32]), uint8.

    The inverse of ``dequantize_mxfp4``, for writing test fixtures and MXFP4 exports. Each 32-value block gets the
    smallest exponent e with amax <= 6 * 2^e (clamped to E8M0's [-127, 127]; an all-zero block gets byte 0), so
    no value is clipped (the module docstring compares OCP's floor rule); each value then rounds to the nearest
    E2M1 value at that scale, ties to the even code (the even mantissa bit: 0.25 -> 0, 0.75 -> 1, 2.5 -> 2,
    5 -> 4 in units of 2^e), the sign kept (-0.0 stays -0.0). Representable weights round-trip exactly.
    Works one expert at a time, so the temporaries are a few copies of one expert, not of the whole tensor.
    """
    if not isinstance(w, Tensor) or not w.is_floating_point():
        got = w.dtype if isinstance(w, Tensor) else type(w).__name__
        raise ValueError(f"quantize_mxfp4: w has dtype {got}; it quantizes a float tensor [experts, in, out]")
    if w.dim() != 3:
        raise ValueError(f"quantize_mxfp4: w has shape {tuple(w.shape)}; expected [experts, in, out] (HF's "
                         f"dequantized expert layout); add a leading dim of 1 for a single matrix")
    experts, width, rows = w.shape
    if width % BLOCK:
        raise ValueError(f"quantize_mxfp4: w's in dim is {width} (shape {tuple(w.shape)}), not a multiple of {BLOCK}, "
                         f"the MXFP4 block size; pad the input dim to {math.ceil(width / BLOCK) * BLOCK}")
    if w.numel() and not bool(torch.isfinite(w).all()):
        e, i, o = (int(v) for v in (~torch.isfinite(w)).nonzero()[0])
        raise ValueError(f"quantize_mxfp4: w[{e}, {i}, {o}] = {float(w[e, i, o])}; MXFP4 has no inf or NaN "
                         f"(only the scale byte 255 is NaN), so fix the weight before exporting it")
    groups = width // BLOCK
    work = torch.float64 if w.dtype == torch.float64 else torch.float32
    blocks = torch.empty(experts, rows, groups, BLOCK // 2, dtype=torch.uint8, device=w.device)
    scales = torch.empty(experts, rows, groups, dtype=torch.uint8, device=w.device)
    # 2^-e for every exponent e, exact (2^127 and 2^-127 are both float32 numbers).
    inv_pow = torch.tensor([math.ldexp(1.0, -e) for e in range(E_MIN, E_MAX + 1)], dtype=work, device=w.device)
    for e in range(experts):
        x = w[e].to(work).t().reshape(rows, groups, BLOCK)  # [out, G, 32]: block g of output row o
        amax = x.abs().amax(dim=-1)
        man, exp = torch.frexp(amax)  # amax = man * 2^exp, man in [0.5, 1)
        # 6 * 2^(exp-3) = 0.75 * 2^exp: enough when man <= 0.75, else one more; 6 * 2^(exp-4) < 0.5 * 2^exp never is.
        shared = exp - 3 + (man > 0.75).to(exp.dtype)
        if bool((shared > E_MAX).any()):
            g_o, g_g = (int(v) for v in (shared > E_MAX).nonzero()[0])
            raise ValueError(f"quantize_mxfp4: block [expert {e}, output {g_o}, inputs {g_g * BLOCK}..] has "
                             f"max |w| = {float(amax[g_o, g_g])}, above MXFP4's largest value 6 * 2^{E_MAX}; "
                             f"rescale the weight before exporting it")
        shared = shared.clamp_(min=E_MIN)
        shared[amax == 0] = E_MIN  # all-zero block: byte 0, every code 0
        scaled = x.abs().mul_(inv_pow[(shared - E_MIN).long()].unsqueeze(-1))  # |x| / 2^e, exact, <= 6
        mag = torch.zeros(scaled.shape, dtype=torch.uint8, device=w.device)
        for mid, up in zip(_MIDPOINTS, _TIE_UP):
            mag += (scaled >= mid) if up else (scaled > mid)
        del scaled
        codes = mag | (torch.signbit(x).to(torch.uint8) << 3)
        blocks[e] = codes[..., 0::2] | (codes[..., 1::2] << 4)
        scales[e] = (shared + SCALE_BIAS).to(torch.uint8)
    return blocks, scales
