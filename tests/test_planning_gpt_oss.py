"""The planner (moekit.train.planning) on gpt-oss's pieces: activations from moe.activations' table, the biases and
sinks as parameters, the attention masks and widened copies SDPA keeps, and dry runs of the released sizes.
Measured CPU runs of gpt-oss-tiny against the estimate are in tests/test_dryrun.py."""
import dataclasses

import pytest

from moekit.comm.topology import Layout
from moekit.models.config import preset
from moekit.moe.activations import ACTIVATIONS
from moekit.train.planning import activations as A
from moekit.train.planning import dryrun
from moekit.train.planning.memory import Stage, Workload, estimate_memory, param_tensors


def test_ffn_widths_of_every_activation_in_the_table():
    """What autograd keeps between the FFN projections, in [rows, F] units. Experts: the fused gated functions keep
    [gate | up] and the second GEMM their output (3); dense: SwiGLU keeps gate, up, silu(gate), the product (4);
    swiglu_oai's composite also keeps its clamped gate, the sigmoid, their product and up + 1 (7)."""
    expected = {"swiglu": (3, 4), "swiglu_oai": (3, 7), "gelu": (2, 2), "relu": (1, 1)}
    assert set(expected) == set(ACTIVATIONS)  # a new table entry gets a row here
    assert {name: (A.ffn_widths(name, False), A.ffn_widths(name, True)) for name in ACTIVATIONS} == expected
    with pytest.raises(ValueError, match="activation='geglu' is not supported"):
        A.ffn_widths("geglu", False)


@pytest.mark.parametrize("name", ["gpt-oss-tiny", "gpt-oss-20b", "gpt-oss-120b"])
def test_parameter_tensors_are_the_models(name):
    """Every parameter tensor of the meta-built model, part by part (dryrun.part_of) and in number (AdamW keeps a
    step per tensor): wo's bias, the sinks, the router's gate bias and the experts' b_in / b_out included."""
    from moekit.models.transformer import Transformer, meta_device

    cfg = preset(name)
    with meta_device():
        model = Transformer(cfg)
    measured: dict[str, int] = {}
    for pname, p in model.named_parameters():
        measured[dryrun.part_of(pname)] = measured.get(dryrun.part_of(pname), 0) + p.numel()
    whole = Stage(0, tuple(range(cfg.num_layers)), True, True)
    tensors = param_tensors(cfg, Layout(), whole)
    planned: dict[str, int] = {}
    for part, n in tensors:
        planned[part] = planned.get(part, 0) + n
    assert planned == measured
    assert len(tensors) == len(list(model.parameters()))
    if name == "gpt-oss-20b":  # the model card's 20.91B
        assert sum(measured.values()) == 20_914_757_184


def _cuda_attention(cfg, B: int, S: int, documents: bool = False) -> int:
    wl = Workload(B, S, "bfloat16", "none", "cuda", document_mask=documents)
    return A._attention(cfg, Layout(), A.shapes(cfg, Layout(), wl), 0)


def test_cuda_sink_and_window_attention_terms():
    """On CUDA (assumed efficient attention, see activations._gqa_kept), gpt-oss-20b's attention (N 64 query heads,
    K 8 key heads, D 64, bf16) at B 2, S 4096, by hand from the calls models.attention makes:

    plain: one causal SDPA call, no mask: q, k, v, the output and its fp32 logsumexp (wo reads the output as a view).
    window 128: models.attention.local_attention runs WINDOW_BLOCK 256 queries at a time, 16 blocks. Block 0 reads
        keys 0-255 (its own positions, but the window hides some: masked); block j > 0 reads from its window's
        start 256 j - 127, moved down to 256 j - 128 so that it reads 384 keys, a multiple of 16. All 16 calls are
        masked, so on CUDA each expands its keys and values to the 64 query heads (masked_sdpa) and keeps those
        [B, N, keys, D] copies, not k and v; each keeps its [B, N, 256, D] output, logsumexp and its additive
        [256, keys] mask as a broadcast view (keys % 16 == 0: the reason for the 384; 383 would have kept a padded
        [B, N, 256, 384] copy per block, B x N = 128 times the bytes); q is kept (the calls read views of it) and wo
        reads a copy of the 16 outputs concatenated.
    sinks, no window: sink_attention's one causal call without a mask over the sink key and 4096 keys, padded to
        P' = 4112 keys: q', its output and logsumexp P' rows long (the queries padded to the keys' rows), k' and v'
        [B, K, P', D+8] (GQA native: no mask), and wo's copy of the output's first D channels.
    window and sinks: the 16 blocks' sink_attention over 1 + 256 keys (block 0) and 1 + 384 (the others), padded
        to 272 and 400: per block q' and its output [B, N, 256, D+8], the logsumexp, k' and v' expanded to the 64
        query heads [B, N, keys', D+8] (masked GQA on CUDA) and the [256, keys'] mask as a broadcast view; q, k, v
        themselves are freed; wo's copy of the outputs' first D channels."""
    B, S, W, block = 2, 4096, 128, 256
    base = dataclasses.replace(preset("gpt-oss-20b"), attention_bias=False, attention_out_bias=False)
    N, K, D, H, a, lse = base.num_heads, base.num_kv_heads, base.attn_head_dim, base.hidden_size, 2, 4
    assert (N, K, D) == (64, 8, 64)
    T = B * S
    inputs = T * H * a  # autocast: the one bf16 copy of the norm output the projections read
    plain = dataclasses.replace(base, attention_sinks=False, sliding_window=0, full_attention_every=0)
    assert _cuda_attention(plain, B, S) == inputs + T * (2 * N + 2 * K) * D * a + T * N * lse

    window = dataclasses.replace(plain, sliding_window=W)
    keys = [block] + [block + W] * (S // block - 1)  # block 0: keys 0-255; block j: 256 j - 128 .. 256 j + 255
    assert keys[1] % 16 == 0 and len(keys) == 16
    calls = sum(2 * B * N * P * D * a  # k and v expanded to the query heads
                + B * N * block * D * a + B * N * block * lse  # output, logsumexp
                + block * P * a  # the additive mask, a broadcast view
                for P in keys)
    q, wo_copy = T * N * D * a, T * N * D * a
    assert _cuda_attention(window, B, S) == inputs + q + calls + wo_copy

    sinks = dataclasses.replace(plain, attention_sinks=True)
    Wd, padded = D + 8, S + 16  # 4097 keys (the sink's and 4096) padded to 4112
    causal = (2 * B * N * padded * Wd + 2 * B * K * padded * Wd) * a + B * N * padded * lse  # q', out; k', v'; lse
    assert _cuda_attention(sinks, B, S) == inputs + causal + wo_copy

    both = dataclasses.replace(sinks, sliding_window=W)
    sink_keys = [272] + [400] * 15  # 1 + 256 and 1 + 384, padded to a multiple of 16
    calls = sum(2 * B * N * block * Wd * a  # q' and the output
                + 2 * B * N * P * Wd * a  # k' and v' expanded to the query heads
                + B * N * block * lse + block * P * a  # logsumexp, the mask (a broadcast view)
                for P in sink_keys)
    assert _cuda_attention(both, B, S) == inputs + calls + wo_copy


def test_cuda_document_mask_attention_terms():
    """Document masking (--data.document_mask) on CUDA, gpt-oss-20b's attention at B 2, bf16, by hand: every call is
    masked, by a mask per sequence [B, 1, queries, keys] (models.attention.positioned_attention).

    plain, S 4096: one masked call instead of causal SDPA: k and v expanded to the 64 query heads (masked_sdpa; the
        unexpanded k, v are not kept: no unmasked call reads them), q, the output, its logsumexp and the additive
        [B, 1, S, S] mask, a broadcast view (S % 16 == 0); at S 4104 (not a multiple of 16) torch pads the mask to
        4112 keys and keeps it per head: [B, N, S, 4112].
    window 128: the 16 blocks of the window case (test above), each mask [B, 1, 256, keys] instead of [256, keys].
    sinks, no window: sink_attention's masked form over 4112 keys: q' and its output S rows long (not 4112), k' and
        v' expanded to the query heads, the [B, 1, S, 4112] mask."""
    B, S, W, block = 2, 4096, 128, 256
    base = dataclasses.replace(preset("gpt-oss-20b"), attention_bias=False, attention_out_bias=False)
    N, D, H, a, lse = base.num_heads, base.attn_head_dim, base.hidden_size, 2, 4
    plain = dataclasses.replace(base, attention_sinks=False, sliding_window=0, full_attention_every=0)

    def one_call(S: int, mask: int) -> int:  # the cast input; q, output, logsumexp; k, v expanded to N heads; the mask
        T = B * S
        return T * H * a + 2 * T * N * D * a + T * N * lse + 2 * B * N * S * D * a + mask

    assert _cuda_attention(plain, B, S, True) == one_call(S, B * S * S * a)
    assert _cuda_attention(plain, B, S + 8, True) == one_call(S + 8, B * N * (S + 8) * (S + 16) * a)

    window = dataclasses.replace(plain, sliding_window=W)
    masks = sum(block * P * a for P in [block] + [block + W] * 15)  # [256, keys] per block without documents
    assert _cuda_attention(window, B, S, True) - _cuda_attention(window, B, S) == (B - 1) * masks

    sinks = dataclasses.replace(plain, attention_sinks=True)
    T, Wd, P = B * S, D + 8, S + 16
    masked = T * H * a + (2 * T * N * Wd + 2 * B * N * P * Wd) * a + T * N * lse + B * S * P * a
    assert _cuda_attention(sinks, B, S, True) == masked + T * N * D * a  # + wo's copy of the first D channels


def test_dry_run_gpt_oss_20b(capsys):
    """64 ranks (fsdp 64, ep 8), bf16, with and without checkpointing: the recipe's shards are the estimate's
    (biases and sinks included); both fit an 80 GB GPU (the sink layers' keys are padded to a multiple of 16, so
    their masks are never materialised per head: 2 GiB a layer at S 4096 before), selective with room to spare."""
    base = ["--dry-run", "--preset", "gpt-oss-20b", "--world-size", "64", "--ep", "8", "--fsdp", "64",
            "--batch-size", "64", "--train.seq_len", "4096"]
    peaks = {}
    for mode in ("none", "selective"):
        rc = dryrun.main(base + ["--train.activation_checkpointing", mode])
        out = capsys.readouterr().out
        assert rc == 0 and "the estimate agrees" in out and "MISMATCH" not in out, out
        assert "router 69144" in out  # 24 layers x (one gate row of 2880 + one bias element): fsdp 64 > 32 rows
        peaks[mode] = float(out.split("memory: peak ")[1].split(" GiB")[0])
    assert peaks["selective"] < 20 < peaks["none"] < 40, peaks


def test_estimate_counts_the_biases_once_sharded():
    """EP shards the expert biases' dim 0 like their weights; FSDP their dim 1 over the data-parallel ranks that
    hold the same experts; the router's bias is replicated and FSDP-sharded on dim 0."""
    cfg = preset("gpt-oss-20b")
    E, H, F, L = cfg.num_experts, cfg.hidden_size, cfg.moe_ffn_hidden_size, cfg.num_layers
    layout = Layout(fsdp=16, ep=8)
    wl = Workload(1, 1024, "bfloat16", "full", "cuda")
    est = estimate_memory(cfg, layout, wl)
    without = estimate_memory(dataclasses.replace(cfg, moe_ffn_bias=False), layout, wl)
    assert est.param_numel["experts"] - without.param_numel["experts"] == L * (E // 8) * (2 * F // 2 + H // 2)
    no_gate_bias = dataclasses.replace(cfg, router_options={"normalize": True})
    assert estimate_memory(no_gate_bias, layout, wl).param_numel["router"] == est.param_numel["router"] - L * 2
