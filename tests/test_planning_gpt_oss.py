"""The planner (moekit.train.planning) on gpt-oss's pieces: activations from moe.activations' table, the biases and
sinks as parameters, the attention masks and widened copies SDPA keeps, and dry runs of the released sizes.
Measured CPU runs of gpt-oss-tiny against the estimate are in tests/test_dryrun.py."""
import dataclasses

import pytest
import torch

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


def _cuda_attention(cfg, B: int, S: int) -> int:
    wl = Workload(B, S, "bfloat16", "none", "cuda")
    return A._attention(cfg, Layout(), A.shapes(cfg, Layout(), wl), 0)


def test_cuda_sink_and_window_attention_terms():
    """On CUDA (assumed efficient attention, see activations._gqa_kept): a sink layer keeps q' [B, N, S, D+8],
    k' and v' [B, K, P', D+8] with P' = S + 1 padded to a multiple of 16 (so the [S, P'] mask stays a broadcast
    view: never materialised per head), its [B, N, S, D+8] output, logsumexp and wo's copy of the first D
    channels; without a window it is causal with no mask, q' and the output P' rows long; a window layer keeps
    q, k, v, output, logsumexp and the [S, S] mask."""
    B, S = 2, 4096
    base = dataclasses.replace(preset("gpt-oss-20b"), attention_bias=False, attention_out_bias=False)
    N, K, D, H, a = base.num_heads, base.num_kv_heads, base.attn_head_dim, base.hidden_size, 2
    T = B * S
    inputs = 3 * T * H * a  # autocast's bf16 copy of the norm output per projection
    plain = dataclasses.replace(base, attention_sinks=False, sliding_window=0, full_attention_every=0)
    assert _cuda_attention(plain, B, S) == inputs + T * (2 * N + 2 * K) * D * a + T * N * 4
    window = dataclasses.replace(plain, sliding_window=128)
    assert _cuda_attention(window, B, S) - _cuda_attention(plain, B, S) == S * S * a
    sinks = dataclasses.replace(plain, attention_sinks=True)
    keys = S + 16  # 4097 keys padded to 4112
    # no window: causal SDPA, no mask, the queries padded to the keys' rows
    copies = (2 * B * N * keys * (D + 8) + 2 * B * K * keys * (D + 8) + T * N * D) * a + B * N * keys * 4
    assert _cuda_attention(sinks, B, S) == inputs + copies
    both = dataclasses.replace(sinks, sliding_window=128)  # window and sinks: the [S, keys] mask, S query rows
    copies = (2 * T * N * (D + 8) + 2 * B * K * keys * (D + 8) + T * N * D) * a + T * N * 4
    assert _cuda_attention(both, B, S) == inputs + copies + S * keys * a


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
