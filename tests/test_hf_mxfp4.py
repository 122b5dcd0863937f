"""MXFP4 expert weights (models/hf/mxfp4.py), the format of OpenAI's gpt-oss checkpoints.

Checked against two independent decoders: transformers' own ``convert_moe_packed_tensors`` (bit for bit, bf16 and
float32, every chunking of moekit's loop), and a per-element Python decoder here that reads each code's sign,
exponent and mantissa bits as integers (no table). Then quantize -> dequantize: representable weights come back
bit for bit, random ones land on the nearest E2M1 value at their block's scale (elementwise), with the smallest
exponent that fits the block. Bad input is a ValueError that names the tensor or value.
Inputs are fresh each run (MOEKIT_TEST_SEED, printed in pytest's header, replays them).
"""
from __future__ import annotations

import math

import pytest
import torch

from moekit.models.hf import mxfp4
from moekit.models.hf.mxfp4 import dequantize_mxfp4, is_mxfp4, mxfp4_pairs, quantize_mxfp4
from tests.helpers import gen

GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # E2M1 magnitudes, written out for the checks below
INT_VIEW = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32,
            torch.float64: torch.int64}


def packed(g: torch.Generator, shape: tuple[int, int, int], lo: int = 110, hi: int = 140):
    """Random blocks [E, out, G, 16] (every byte value) and scales [E, out, G] in [lo, hi]."""
    blocks = torch.randint(0, 256, (*shape, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(lo, hi + 1, shape, generator=g, dtype=torch.uint8)
    return blocks, scales


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality, so -0.0 vs 0.0 (and any rounding) counts as a difference."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.view(INT_VIEW[a.dtype]), b.view(INT_VIEW[b.dtype]))


def fp4_by_bits(code: int) -> float:
    """A code's value from its bit fields as integers: the magnitude counted in halves, then halved."""
    sign, exp, man = code >> 3, (code >> 1) & 3, code & 1
    halves = man if exp == 0 else (2 + man) << (exp - 1)
    return math.copysign(halves / 2, -1.0 if sign else 1.0)


# --- against transformers ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape,chunk", [((3, 5, 4), mxfp4.DEFAULT_CHUNK), ((3, 5, 4), 1), ((3, 5, 4), 300),
                                         ((4, 2, 3), 200), ((1, 7, 1), 64), ((2, 1, 2), 5)])
def test_matches_transformers(dtype, shape, chunk):
    conv = pytest.importorskip("transformers.integrations.mxfp4")
    blocks, scales = packed(gen("tf", dtype, shape, chunk), shape)
    want = conv.convert_moe_packed_tensors(blocks.clone(), scales.clone(), dtype=dtype)
    got = dequantize_mxfp4(blocks, scales, dtype, name="w", chunk_values=chunk)
    E, out, G = shape
    assert got.shape == (E, G * 32, out) and got.is_contiguous()
    assert same_bits(got, want)


def test_matches_transformers_whole_exponent_range():
    """Every scale byte float32 holds without overflow (0..252: 2^-127 .. 2^125), subnormal results included."""
    conv = pytest.importorskip("transformers.integrations.mxfp4")
    for dtype in (torch.float32, torch.bfloat16):
        blocks, scales = packed(gen("tf-range", dtype), (2, 253, 2), lo=0, hi=252)
        scales[0, :, 0] = torch.arange(253, dtype=torch.uint8)  # each byte once, the rest at random
        want = conv.convert_moe_packed_tensors(blocks.clone(), scales.clone(), dtype=dtype)
        assert same_bits(dequantize_mxfp4(blocks, scales, dtype, chunk_values=100), want)


# --- against a per-element decoder ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_matches_per_element_reference(dtype):
    E, out, G = 2, 3, 2
    blocks, scales = packed(gen("ref", dtype), (E, out, G), lo=0, hi=250)
    blocks[0, 0, 0] = torch.arange(0, 256, 16, dtype=torch.uint8) + torch.arange(16, dtype=torch.uint8)  # all codes
    got = dequantize_mxfp4(blocks, scales, dtype, chunk_values=7)
    assert got.shape == (E, G * 32, out) and got.dtype == dtype
    for e in range(E):
        for o in range(out):
            for g in range(G):
                factor = math.ldexp(1.0, int(scales[e, o, g]) - 127)
                for j in range(16):
                    byte = int(blocks[e, o, g, j])
                    for nib, code in enumerate((byte & 0xF, byte >> 4)):
                        want = fp4_by_bits(code) * factor  # exact in double: 2 significant bits
                        have = float(got[e, g * 32 + 2 * j + nib, o])
                        where = (e, o, g, j, nib, code, int(scales[e, o, g]))
                        assert have == want and math.copysign(1, have) == math.copysign(1, want), (where, have, want)


def test_code_table_is_the_e2m1_format():
    assert [fp4_by_bits(c) for c in range(8)] == list(GRID)
    assert all(same_bits(torch.tensor(mxfp4.E2M1_VALUES[c]), torch.tensor(fp4_by_bits(c))) for c in range(16))
    conv = pytest.importorskip("transformers.integrations.mxfp4")
    assert [fp4_by_bits(c) for c in range(16)] == conv.FP4_VALUES


# --- quantize -> dequantize ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_representable_weights_round_trip_exactly(dtype):
    g = gen("exact", dtype)
    blocks, scales = packed(g, (3, 4, 3), lo=1, hi=250)
    scales[1, 1] = 0  # the smallest exponent
    blocks[2, 0, 1] = 0  # an all-zero block
    blocks[2, 3, 0] = 0x88  # an all -0.0 block
    w = dequantize_mxfp4(blocks, scales, dtype)
    qb, qs = quantize_mxfp4(w)
    assert qb.dtype == qs.dtype == torch.uint8 and qb.shape == blocks.shape and qs.shape == scales.shape
    assert same_bits(dequantize_mxfp4(qb, qs, dtype), w)
    # Whenever a block's largest code is 4 or 6 (its exponent is then the smallest that fits), the bytes match too.
    mags = torch.stack([blocks & 7, (blocks >> 4) & 7], -1).amax(dim=(-1, -2))
    pinned = mags >= 6
    assert torch.equal(qb[pinned], blocks[pinned]) and torch.equal(qs[pinned], scales[pinned])
    assert int(qs[2, 0, 1]) == 0 and int(qs[2, 3, 0]) == 0  # zero blocks: byte 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_random_weights_land_on_the_nearest_grid_value(dtype):
    g = gen("random", dtype)
    E, width, out = 4, 96, 6
    magnitude = torch.tensor([1.0, 1e-3, 1e20, 1e-36]).view(E, 1, 1)  # 1e-36: blocks at the bottom of E8M0's range
    w = (torch.randn(E, width, out, generator=g) * magnitude).to(dtype)
    w[0, :32, 0] = 0  # an all-zero block
    blocks, scales = quantize_mxfp4(w)
    back = dequantize_mxfp4(blocks, scales, torch.float64)
    x = w.double().transpose(1, 2).reshape(E, out, width // 32, 32)  # [E, out, G, 32], as the blocks are
    y = back.transpose(1, 2).reshape(x.shape)
    e = scales.double().sub(127).unsqueeze(-1)  # each block's exponent
    unit = torch.exp2(e)
    amax = x.abs().amax(-1, keepdim=True)
    # The exponent is the smallest that fits the block (or E8M0's floor, -127).
    assert bool((amax <= 6 * unit).all())
    assert bool(((amax > 3 * unit) | (e == -127)).all())
    # Elementwise: the error is the distance to the nearest grid value at that scale, at most half a step.
    scaled = x.abs() / unit
    grid = torch.tensor(GRID, dtype=torch.float64)
    nearest = (scaled.unsqueeze(-1) - grid).abs().amin(-1)
    err = (y - x).abs() / unit
    assert torch.equal(err, nearest), (err - nearest).abs().max()
    half_step = torch.where(scaled < 2, 0.25, torch.where(scaled < 4, 0.5, 1.0))
    assert bool((err <= half_step).all())
    assert bool((torch.signbit(y) == torch.signbit(x)).all())


def test_ties_round_to_the_even_code():
    mids = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    want_codes = [0, 2, 2, 4, 4, 6, 6]
    col = torch.zeros(1, 32, 1)
    col[0, 0, 0] = 6.0  # pins the exponent at 0 (scale byte 127)
    for k, m in enumerate(mids):
        col[0, 1 + 2 * k, 0] = m
        col[0, 2 + 2 * k, 0] = -m
    for factor in (1.0, 2.0 ** -100, 2.0 ** 100):
        blocks, scales = quantize_mxfp4(col * factor)
        assert int(scales[0, 0, 0]) == 127 + round(math.log2(factor))
        codes = torch.stack([blocks[0, 0, 0] & 0xF, blocks[0, 0, 0] >> 4], -1).flatten().tolist()
        assert codes[0] == 7
        assert codes[1:15:2] == want_codes and codes[2:16:2] == [c | 8 for c in want_codes]


def test_exponent_fits_rather_than_clips():
    """amax = 7 * 2^k: OCP's floor rule would give e = k and clip it to 6 * 2^k; the fitting one gives k + 1."""
    w = torch.zeros(1, 32, 1)
    w[0, 0, 0] = 7.0
    blocks, scales = quantize_mxfp4(w)
    assert int(scales[0, 0, 0]) == 128
    assert float(dequantize_mxfp4(blocks, scales, torch.float32)[0, 0, 0]) == 8.0  # 4 * 2^1, error 1 <= step 2 / 2


# --- checkpoint helpers --------------------------------------------------------------------------------------


def test_is_mxfp4():
    assert is_mxfp4({"quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": []}})
    assert not is_mxfp4({"quantization_config": {"quant_method": "fp8"}})
    assert not is_mxfp4({"model_type": "gpt_oss"})
    assert not is_mxfp4({"quantization_config": None})


def test_pairs():
    keys = ["model.layers.0.mlp.experts.gate_up_proj_blocks", "model.layers.0.mlp.experts.gate_up_proj_scales",
            "model.layers.0.mlp.experts.gate_up_proj_bias", "model.layers.0.mlp.experts.down_proj_scales",
            "model.layers.0.mlp.experts.down_proj_blocks", "model.embed_tokens.weight"]
    assert mxfp4_pairs(keys) == {
        "model.layers.0.mlp.experts.down_proj": ("model.layers.0.mlp.experts.down_proj_blocks",
                                                 "model.layers.0.mlp.experts.down_proj_scales"),
        "model.layers.0.mlp.experts.gate_up_proj": ("model.layers.0.mlp.experts.gate_up_proj_blocks",
                                                    "model.layers.0.mlp.experts.gate_up_proj_scales")}
    assert mxfp4_pairs(["lm_head.weight"]) == {}
    assert mxfp4.MXFP4_SUFFIXES == ("_blocks", "_scales")


@pytest.mark.parametrize("keys,named", [
    (["a.experts.down_proj_blocks"], "a.experts.down_proj_blocks"),
    (["a.experts.down_proj_scales", "b.weight"], "a.experts.down_proj_scales"),
    (["x_blocks", "x_scales", "y_scales"], "y_scales")])
def test_unpaired_keys_are_named(keys, named):
    with pytest.raises(ValueError, match=named):
        mxfp4_pairs(keys)


# --- bad input -----------------------------------------------------------------------------------------------


def _bad(blocks, scales, match, dtype=torch.bfloat16):
    with pytest.raises(ValueError, match=match):
        dequantize_mxfp4(blocks, scales, dtype, name="model.layers.1.mlp.experts.down_proj")


def test_bad_packed_inputs_are_named():
    blocks, scales = packed(gen("bad"), (2, 3, 2))
    nm = r"model\.layers\.1\.mlp\.experts\.down_proj"
    _bad(blocks.to(torch.int16), scales, nm + r"_blocks has dtype torch\.int16")
    _bad(blocks.view(torch.int8), scales, nm + r"_blocks has dtype torch\.int8")
    _bad(blocks, scales.float(), nm + r"_scales has dtype torch\.float32")
    _bad(blocks[..., :8], scales, nm + r"_blocks has shape \(2, 3, 2, 8\)")
    _bad(blocks.reshape(6, 2, 16), scales, nm + r"_blocks has shape \(6, 2, 16\)")
    _bad(blocks, scales[:, :2], nm + r"_scales has shape \(2, 2, 2\) .* needs \(2, 3, 2\)")
    _bad(blocks, scales, r"dtype=torch\.int32", dtype=torch.int32)
    with pytest.raises(ValueError, match="chunk_values=0"):
        dequantize_mxfp4(blocks, scales, chunk_values=0)


def test_nan_exponent_is_refused():
    blocks, scales = packed(gen("nan"), (2, 3, 2))
    scales[1, 2, 1] = 255
    _bad(blocks, scales, r"down_proj_scales holds 1 NaN exponent.*\[1, 2, 1\].*inputs 32\.\.63")
    with pytest.raises(ValueError, match=r"mxfp4 tensor_scales holds 1 NaN"):
        dequantize_mxfp4(blocks, scales)


def test_overflow_is_refused_not_inf():
    blocks = torch.zeros(1, 2, 1, 16, dtype=torch.uint8)
    scales = torch.full((1, 2, 1), 127, dtype=torch.uint8)
    blocks[0, 1, 0, 3] = 0x70  # code 7 (6.0) at input 7 of output row 1
    scales[0, 1, 0] = 254  # 6 * 2^127 > float32 / bfloat16 max
    for dtype in (torch.bfloat16, torch.float32):
        _bad(blocks, scales, r"down_proj: weight \[expert 0, input 7, output 1\] overflows", dtype)
    assert float(dequantize_mxfp4(blocks, scales, torch.float64)[0, 7, 1]) == 6 * 2.0 ** 127
    blocks[0, 1, 0, 3] = 0x30  # 1.5 * 2^127 fits float32
    assert float(dequantize_mxfp4(blocks, scales, torch.float32)[0, 7, 1]) == 1.5 * 2.0 ** 127


def test_bad_quantize_inputs_are_named():
    with pytest.raises(ValueError, match=r"in dim is 48 .*multiple of 32.*pad the input dim to 64"):
        quantize_mxfp4(torch.zeros(2, 48, 3))
    with pytest.raises(ValueError, match=r"shape \(48, 3\)"):
        quantize_mxfp4(torch.zeros(48, 3))
    with pytest.raises(ValueError, match=r"dtype torch\.int64"):
        quantize_mxfp4(torch.zeros(1, 32, 3, dtype=torch.long))
    w = torch.zeros(1, 32, 3)
    w[0, 5, 2] = float("nan")
    with pytest.raises(ValueError, match=r"w\[0, 5, 2\] = nan"):
        quantize_mxfp4(w)
    w = torch.zeros(1, 32, 3, dtype=torch.float64)
    w[0, 0, 1] = 2e39  # > 6 * 2^127 = 1.02e39
    with pytest.raises(ValueError, match=r"output 1, inputs 0\.\..*2e\+39"):
        quantize_mxfp4(w)
