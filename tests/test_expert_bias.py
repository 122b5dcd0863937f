"""gpt-oss's MoE block in moekit: the swiglu_oai activation, per-expert biases (GroupedExperts(bias=True),
MoELayer(ffn_bias=True)) and the router's gate bias (build_router(..., gate_bias=True)).

Every backend (loop, torch, triton in the interpreter, the fused kernels' epilogues) is checked against the
dumbest oracle, a per-token loop written here from the formulas (transformers' GptOssExperts computes the
same), on ragged counts with empty experts and rows past sum(counts); the whole layer against transformers'
own GptOssMLP; expert parallelism over two gloo ranks against one process. TRITON_INTERPRET is set before
triton is first imported, as in tests/test_kernels.py.
"""
from __future__ import annotations

import copy
import os

_PREV_INTERPRET = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"
import triton  # noqa: E402,F401  (first import decides the mode)

import pytest
import torch

import moekit.moe.kernels as K
from moekit.moe import experts as X
from moekit.moe.activations import get_activation
from moekit.moe.experts import GroupedExperts, register_backend
from moekit.moe.kernels import expert_mlp
from moekit.moe.kernels.grouped_mm_wgrad import grouped_colsum, grouped_colsum_ref
from moekit.moe.layer import DenseMLP, MoELayer
from moekit.moe.router import build_router
from tests.dist_utils import run_ranks

if _PREV_INTERPRET is None:
    del os.environ["TRITON_INTERPRET"]
else:
    os.environ["TRITON_INTERPRET"] = _PREV_INTERPRET

ALPHA, LIMIT = 1.702, 7.0  # gpt-oss's swiglu_alpha / swiglu_limit, written here independently of moekit
H, FF, E = 16, 8, 6


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if not K.interpret_mode():
        pytest.fail("triton was imported in compiled mode before this module set TRITON_INTERPRET=1")


def oai(h: torch.Tensor) -> torch.Tensor:
    """The composite expression of transformers' GptOssExperts._apply_gate, on moekit's [gate | up] layout."""
    gate, up = h.chunk(2, dim=-1)
    gate = gate.clamp(max=LIMIT)
    up = up.clamp(-LIMIT, LIMIT)
    return (up + 1) * gate * torch.sigmoid(gate * ALPHA)


def per_token(rows, counts, w_in, w_out, b_in, b_out, activation):
    """The oracle: each row on its own, its expert found by walking the counts (negative = 0, blocks stop at N)."""
    act = oai if activation == "swiglu_oai" else get_activation(activation)
    ends, end = [], 0
    for c in counts.tolist():
        end = min(end + max(c, 0), rows.shape[0])
        ends.append(end)
    out = []
    for r in range(rows.shape[0]):
        e = next((i for i, end in enumerate(ends) if r < end), None)
        if e is None:  # a row no expert owns: 0, no gradient
            out.append(rows[r] * 0 @ w_out.new_zeros(H, H))
            continue
        h = rows[r] @ w_in[e] + (b_in[e] if b_in is not None else 0)
        out.append(act(h) @ w_out[e] + (b_out[e] if b_out is not None else 0))
    return torch.stack(out)


def inputs(activation, counts, extra, dtype, seed):
    """rows, w_in, w_out, b_in, b_out with first-projection outputs of std ~4: many beyond +-LIMIT."""
    g = torch.Generator().manual_seed(seed)
    f_in = get_activation(activation).in_features(FF)
    n = int(counts.clamp(min=0).sum()) + extra
    ts = (torch.randn(n, H, generator=g, dtype=torch.float64), torch.randn(E, H, f_in, generator=g, dtype=torch.float64),
          torch.randn(E, FF, H, generator=g, dtype=torch.float64) / FF**0.5,
          2 * torch.randn(E, f_in, generator=g, dtype=torch.float64), torch.randn(E, H, generator=g, dtype=torch.float64))
    return [t.to(dtype) for t in ts]


def fwd_bwd(fn, tensors, seed=7):
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    y = fn(*leaves)
    cot = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(y.dtype)
    (y * cot).sum().backward()
    return [y.detach()] + [t.grad if t.grad is not None else torch.zeros_like(t) for t in leaves]


def assert_all_close(got, want, what, rel=1e-5):
    names = ("y", "d rows", "d w_in", "d w_out", "d b_in", "d b_out")
    for name, a, b in zip(names, got, want):
        atol = rel * max(float(b.abs().max()), 1.0)
        torch.testing.assert_close(a.double(), b, rtol=rel, atol=atol, msg=lambda m: f"{what} {name}: {m}")


# --------------------------------------------------------------------------------------------------
# The activation
# --------------------------------------------------------------------------------------------------


def test_swiglu_oai_forward_and_derivative_match_the_composite_under_autograd():
    """float64 values spanning well past +-limit, and exactly at the clamp bounds (where torch's clamp passes
    the gradient): the table's function (hand-written backward), its unit / up_fn composite and the dense MLP's
    combine equal autograd of the composite expression; a double backward works."""
    act = get_activation("swiglu_oai")
    assert act.gated and act.in_features(5) == 10
    g = torch.Generator().manual_seed(0)
    h = 6 * torch.randn(64, 10, generator=g, dtype=torch.float64)
    h[0, :5] = torch.tensor([LIMIT, -LIMIT, LIMIT + 1e-9, 20.0, -30.0], dtype=torch.float64)  # gates
    h[0, 5:] = torch.tensor([LIMIT, -LIMIT, -LIMIT - 1e-9, 12.0, -12.0], dtype=torch.float64)  # ups
    assert (h.abs() > LIMIT).float().mean() > 0.1
    want = fwd_bwd(oai, [h])
    for what, fn in (("fn", act.fn), ("combine", lambda t: act.combine(*t.chunk(2, -1)))):
        got = fwd_bwd(fn, [h])
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=lambda m: f"{what}: {m}")
    x = h.clone().requires_grad_()  # double backward: d/dh of sum(d y / d h)
    (grad,) = torch.autograd.grad(act(x).sum(), x, create_graph=True)
    (gg,) = torch.autograd.grad(grad.sum(), x)
    x2 = h.clone().requires_grad_()
    (grad2,) = torch.autograd.grad(oai(x2).sum(), x2, create_graph=True)
    torch.testing.assert_close(gg, torch.autograd.grad(grad2.sum(), x2)[0])
    mlp = DenseMLP(6, 5, "swiglu_oai").double()  # the dense MLP (and the shared expert) use the same entry
    xs = torch.randn(3, 6, generator=g, dtype=torch.float64) * 10
    with torch.no_grad():
        want_y = mlp.w_out(oai(torch.cat([mlp.w_gate(xs), mlp.w_up(xs)], -1)))
        torch.testing.assert_close(mlp(xs), want_y)


# --------------------------------------------------------------------------------------------------
# Grouped experts with biases, every backend
# --------------------------------------------------------------------------------------------------

COUNTS = [torch.tensor([5, 0, 11, 0, 3, 7]), torch.tensor([0, 9, -2, 4, 0, 0]), torch.tensor([0] * 6)]


@pytest.mark.parametrize("backend", ["loop", "torch", "triton"])
@pytest.mark.parametrize("activation", ["swiglu_oai", "gelu"])
@pytest.mark.parametrize("case", range(len(COUNTS)))
def test_grouped_experts_with_bias_match_the_per_token_loop(backend, activation, case):
    """GroupedExperts(bias=True) forward and gradients of rows, weights and both biases; ragged counts with
    empty experts (a negative count too), 4 rows past sum(counts), and no rows owned at all."""
    counts = COUNTS[case]
    dtype = torch.float64 if backend == "loop" else torch.float32  # Triton / grouped_mm: no float64
    ts = inputs(activation, counts, 4, torch.float64, seed=10 + case)
    want = fwd_bwd(lambda *a: per_token(*a[:1], counts, *a[1:], activation), ts)
    experts = GroupedExperts(E, H, FF, activation, backend=backend, bias=True, dtype=dtype)
    assert experts.param_names() == ("w_in", "w_out", "b_in", "b_out")

    with torch.no_grad():
        for name, t in zip(experts.param_names(), ts[1:]):
            getattr(experts, name).copy_(t)
    rows = ts[0].to(dtype).requires_grad_()
    y = experts(rows, counts)
    cot = torch.randn(y.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64).to(y.dtype)
    (y * cot).sum().backward()
    got = [y.detach(), rows.grad] + [getattr(experts, n).grad for n in experts.param_names()]
    assert_all_close(got, want, f"{backend} {activation} counts {counts.tolist()}",
                     rel=1e-10 if dtype == torch.float64 else 2e-5)
    owned = int(counts.clamp(min=0).sum())
    assert got[0][owned:].abs().max() == 0 and got[1][owned:].abs().max() == 0


def test_fused_kernels_with_bias_and_swiglu_oai():
    """The fused path (bias in the up-projection and second-GEMM epilogues, ACT 3 forward and backward,
    column-sum bias gradients) and the plain variant against the oracle; inference skips pre and gives the
    same output; counts past N stop at N."""
    counts = torch.tensor([4, 0, 13, 1, 0, 40])  # sums past N: the last expert's block stops at row N
    ts = inputs("swiglu_oai", torch.tensor([4, 0, 13, 1, 0, 0]), 9, torch.float64, seed=3)
    want = fwd_bwd(lambda *a: per_token(*a[:1], counts, *a[1:], "swiglu_oai"), ts)
    f32 = [t.float() for t in ts]
    for variant in ("fused", "plain"):
        got = fwd_bwd(lambda r, wi, wo, bi, bo: expert_mlp(r, counts, wi, wo, "swiglu_oai", variant=variant,
                                                           b_in=bi, b_out=bo), f32)
        assert_all_close(got, want, variant, rel=2e-5)
    with torch.no_grad():
        y = expert_mlp(f32[0], counts, *f32[1:3], "swiglu_oai", b_in=f32[3], b_out=f32[4])
    torch.testing.assert_close(y.double(), want[0], rtol=2e-5, atol=2e-5 * float(want[0].abs().max()))
    with pytest.raises(ValueError, match=r"b_in must be \[E=6, N=16\]"):
        expert_mlp(f32[0], counts, *f32[1:3], "swiglu_oai", b_in=f32[3][:, :15])


@pytest.mark.parametrize("offs", [[0, 5, 5, 17, 30], [3, 1, 40, 40, 2], [0, 0, 0, 0, 0]])
def test_grouped_colsum_is_the_per_expert_row_sum(offs):
    """The bias-gradient kernel: per-expert column sums over clamped, monotone row blocks (decreasing and
    past-M offsets included); rows past the last end contribute nothing."""
    dy = torch.randn(33, 37, generator=torch.Generator().manual_seed(1))
    o = torch.tensor(offs, dtype=torch.int32)
    got = grouped_colsum(dy, o)
    torch.testing.assert_close(got, grouped_colsum_ref(dy, o), rtol=1e-6, atol=1e-5)
    ends = torch.tensor(offs).cummax(0).values.clamp(0, 33).tolist()
    starts = [0] + ends[:-1]
    for e, (s, t) in enumerate(zip(starts, ends)):  # a second, independent reading of the blocks
        torch.testing.assert_close(got[e], dy[s:t].sum(0) if t > s else torch.zeros(37), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("offs", [[0, 5, 5, 17, 30], [3, 1, 40, 40, 2], [0, 0, 0, 0, 0]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_colsum_weights_rows_and_dots_them_with_a_per_expert_vector(offs, dtype):
    """row_scale: out[e] = sum of s[r] dy[r] over e's rows; dot_with: dots[r] = <dy[r], w[expert of r]> from the same
    read (the fused permute's bias gradients), 0 for rows no expert owns; N 37 spans several column blocks, whose
    partial dots the launcher sums. Against float64 on the blocks read independently."""
    g = torch.Generator().manual_seed(len(offs) + sum(offs))
    dy = torch.randn(33, 37, generator=g).to(dtype)
    scale = torch.rand(33, generator=g)
    w = torch.randn(5, 37, generator=g).to(dtype)
    o = torch.tensor(offs, dtype=torch.int32)
    out, dots = grouped_colsum(dy, o, row_scale=scale, dot_with=w)
    assert out.dtype == dtype and dots.dtype == torch.float32 and dots.shape == (33,)
    ends = torch.tensor(offs).cummax(0).values.clamp(0, 33).tolist()
    starts = [0] + ends[:-1]
    want_dots = torch.zeros(33, dtype=torch.float64)
    tol = dict(rtol=1e-6, atol=1e-5) if dtype == torch.float32 else dict(rtol=2**-7, atol=2e-2)
    for e, (s, t) in enumerate(zip(starts, ends)):
        block = dy[s:t].double()
        want = (block * scale[s:t, None].double()).sum(0) if t > s else torch.zeros(37, dtype=torch.float64)
        torch.testing.assert_close(out[e].double(), want, **tol)
        want_dots[s:t] = block @ w[e].double()
    torch.testing.assert_close(dots.double(), want_dots, rtol=1e-5, atol=1e-4)
    assert torch.equal(grouped_colsum(dy, o, dot_with=w)[0], grouped_colsum(dy, o))  # no scale: the plain sums
    empty = grouped_colsum(dy[:0], o, row_scale=scale[:0], dot_with=w)
    assert empty[0].abs().max() == 0 and empty[1].shape == (0,)
    with pytest.raises(ValueError, match="row_scale must be float32"):
        grouped_colsum(dy, o, row_scale=scale.double())
    with pytest.raises(ValueError, match=r"dot_with must be \[5, 37\]"):
        grouped_colsum(dy, o, dot_with=w[:4])


def test_bias_off_adds_no_parameters_and_backends_without_bias_refuse_it():
    """Off (the default): exactly the old parameters and state-dict keys, for the layer and the router. On: a
    backend that cannot compute biases (float8, a user's backend registered without bias=True) is a ValueError
    naming the option, never a silent drop; "auto" skips such backends."""
    layer = MoELayer(H, FF, E, build_router("topk", H, E, top_k=2))
    assert list(layer.state_dict()) == ["router.weight", "experts.w_in", "experts.w_out"]
    assert [n for n, _ in layer.named_parameters()] == ["router.weight", "experts.w_in", "experts.w_out"]
    assert layer.experts.param_names() == ("w_in", "w_out") and layer.experts.b_in is None
    assert not hasattr(layer.router, "bias")
    on = MoELayer(H, FF, E, build_router("topk", H, E, top_k=2, gate_bias=True), activation="swiglu_oai",
                  ffn_bias=True)
    assert list(on.state_dict()) == ["router.weight", "router.bias", "experts.w_in", "experts.w_out", "experts.b_in",
                                     "experts.b_out"]
    assert all(float(on.state_dict()[k].abs().max()) == 0 for k in ("router.bias", "experts.b_in", "experts.b_out"))
    rows, counts = torch.randn(5, H), torch.tensor([2, 3, 0, 0, 0, 0])
    with pytest.raises(ValueError, match=r"'float8' does not compute expert biases.*ffn_bias=True"):
        GroupedExperts(E, H, FF, backend="float8", bias=True)(rows, counts)

    @register_backend("nobias_test")
    def _nobias(rows, counts, w_in, w_out, activation):  # pragma: no cover - never reached with biases
        raise AssertionError("called with biases dropped")

    with pytest.raises(ValueError, match="'nobias_test' does not compute expert biases"):
        GroupedExperts(E, H, FF, backend="nobias_test", bias=True)(rows, counts)
    with pytest.raises(ValueError, match="bias='yes' is invalid"):
        GroupedExperts(E, H, FF, bias="yes")
    with pytest.raises(ValueError, match="ffn_bias=1 is invalid"):
        MoELayer(H, FF, E, "topk", ffn_bias=1)
    assert X.resolve_backend("auto", rows, on.experts.w_in, on.experts.w_out, bias=True).bias


# --------------------------------------------------------------------------------------------------
# Router gate bias
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["topk", "switch", "expert_choice", "sinkhorn"])
def test_router_gate_bias_enters_the_float32_logits(name):
    """logits = x W^T + b in float32 from bf16 hidden states, b's gradient the logits' column sums; the key
    is ``bias`` beside ``weight``; the gate-less hash router refuses the option."""
    r = build_router(name, H, E, gate_bias=True).eval()  # eval: no switch jitter
    assert [n for n, _ in r.named_parameters()] == ["weight", "bias"] and float(r.bias.detach().abs().max()) == 0
    with torch.no_grad():
        r.bias.copy_(torch.randn(E))
    x = torch.randn(7, H).to(torch.bfloat16)
    logits = r.logits(x)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, x.float() @ r.weight.detach().T + r.bias.detach(), rtol=1e-6, atol=1e-6)
    cot = torch.randn(7, E)
    (logits * cot).sum().backward()
    torch.testing.assert_close(r.bias.grad, cot.sum(0))
    with pytest.raises(ValueError, match=r"has no option\(s\) \['gate_bias'\]"):
        build_router("hash", H, E, gate_bias=True)


# --------------------------------------------------------------------------------------------------
# The whole block against transformers' GptOssMLP
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend,dtype", [("loop", torch.float64), ("torch", torch.float32),
                                           ("triton", torch.float32)])
def test_moe_layer_reproduces_transformers_gpt_oss_mlp(backend, dtype):
    """Router with gate bias, top-k softmax over the chosen logits (topk: softmax + normalize), swiglu_oai,
    both expert biases: transformers' GptOssMLP output and gradients (input, router, experts), its
    interleaved gate / up columns de-interleaved into moekit's [gate | up]."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    cfg = transformers.GptOssConfig(hidden_size=H, intermediate_size=FF, num_local_experts=E, num_experts_per_tok=2,
                                    num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                    vocab_size=32)
    hf = GptOssMLP(cfg).double()
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64))
        hf.experts.down_proj.mul_(FF**-0.5)
    router = build_router("topk", H, E, top_k=2, score="softmax", normalize=True, aux_loss_coeff=0.0, gate_bias=True)
    layer = MoELayer(H, FF, E, router, activation="swiglu_oai", ffn_bias=True, backend=backend).to(dtype)
    ex, hx = layer.experts, hf.experts
    with torch.no_grad():
        layer.router.weight.copy_(hf.router.weight)  # the router stays float32 math; its weights in dtype
        layer.router.bias.copy_(hf.router.bias)
        ex.w_in.copy_(torch.cat([hx.gate_up_proj[..., ::2], hx.gate_up_proj[..., 1::2]], -1))
        ex.b_in.copy_(torch.cat([hx.gate_up_proj_bias[:, ::2], hx.gate_up_proj_bias[:, 1::2]], -1))
        ex.w_out.copy_(hx.down_proj)
        ex.b_out.copy_(hx.down_proj_bias)
    x = torch.randn(2, 5, H, generator=g, dtype=torch.float64)
    cot = torch.randn(2, 5, H, generator=g, dtype=torch.float64)
    xh, xm = x.clone().requires_grad_(), x.to(dtype).requires_grad_()
    yh = hf(xh)[0]
    ym = layer(xm)
    (yh * cot).sum().backward()
    (ym * cot.to(dtype)).sum().backward()
    rel = 1e-9 if dtype == torch.float64 else 3e-5
    scale = float(yh.detach().abs().max())
    torch.testing.assert_close(ym.double(), yh.detach(), rtol=rel, atol=rel * scale)
    pairs = [("x", xm.grad, xh.grad), ("router.weight", layer.router.weight.grad, hf.router.weight.grad),
             ("router.bias", layer.router.bias.grad, hf.router.bias.grad),
             ("w_in", ex.w_in.grad, torch.cat([hx.gate_up_proj.grad[..., ::2], hx.gate_up_proj.grad[..., 1::2]], -1)),
             ("b_in", ex.b_in.grad, torch.cat([hx.gate_up_proj_bias.grad[:, ::2], hx.gate_up_proj_bias.grad[:, 1::2]],
                                              -1)),
             ("w_out", ex.w_out.grad, hx.down_proj.grad), ("b_out", ex.b_out.grad, hx.down_proj_bias.grad)]
    for name, a, b in pairs:
        torch.testing.assert_close(a.double(), b, rtol=rel, atol=rel * max(float(b.abs().max()), 1.0),
                                   msg=lambda m: f"{backend} {name}: {m}")


# --------------------------------------------------------------------------------------------------
# Expert parallelism: the biases shard with their experts
# --------------------------------------------------------------------------------------------------


def _ep_rank(rank, world):
    from moekit.comm.expert_parallel import apply_expert_parallel
    from moekit.comm.grad_sync import gradient_roles, sync_gradients
    from moekit.comm.topology import Layout, Topology

    topo = Topology(Layout(dp=world, ep=world), rank, world).build()
    torch.manual_seed(2)
    router = build_router("topk", H, E, top_k=2, normalize=True, aux_loss_coeff=0.1, gate_bias=True)
    ref = MoELayer(H, FF, E, router, activation="swiglu_oai", ffn_bias=True, backend="loop").double()
    with torch.no_grad():  # non-zero biases, the same on every rank
        for p in (ref.router.bias, ref.experts.b_in, ref.experts.b_out):
            p.copy_(torch.randn(p.shape, dtype=torch.float64))
    ep = copy.deepcopy(ref)
    apply_expert_parallel(ep, topo)
    T = 5
    g = torch.Generator().manual_seed(3)
    x = 3 * torch.randn(world * T, H, generator=g, dtype=torch.float64)
    c = torch.randn(world * T, H, generator=g, dtype=torch.float64)
    y_ref = ref(x)
    ((y_ref * c).sum() / (world * T)).backward()
    mine = slice(rank * T, (rank + 1) * T)
    y = ep(x[mine])
    torch.testing.assert_close(y, y_ref[mine].detach())
    ((y * c[mine]).sum() / T).backward()
    sync_gradients(ep, topo, gradient_roles(ep))
    lo, hi = ep.dispatcher.expert_range
    assert hi - lo == E // world
    torch.testing.assert_close(ep.router.bias.grad, ref.router.bias.grad)
    torch.testing.assert_close(ep.router.weight.grad, ref.router.weight.grad)
    for name in ("w_in", "w_out", "b_in", "b_out"):
        p = getattr(ep.experts, name)
        assert p.to_local().shape[0] == E // world, name  # sharded with its experts
        torch.testing.assert_close(p.grad.to_local(), getattr(ref.experts, name).grad[lo:hi], msg=lambda m: f"{name}: {m}")
        torch.testing.assert_close(p.full_tensor(), getattr(ref.experts, name).detach())  # checkpoints: whole [E, ...]


def test_ep2_with_biases_matches_one_process():
    run_ranks(_ep_rank, 2)


def test_init_weights_zeroes_the_biases_and_leaves_the_weights_as_without_them():
    """models.init: an ffn_bias / gate_bias layer's biases start at 0 whatever they held, and its weights get the
    values the same layer without biases gets (each value a function of seed, name and position)."""
    from moekit.models.config import ModelConfig
    from moekit.models.init import init_weights
    from moekit.models.stats import _expert_bias_vectors, _inactive
    from moekit.models.transformer import build_model

    cfg = ModelConfig(name="bias-init", hidden_size=H, num_layers=1, num_heads=2, num_kv_heads=1, max_seq_len=8,
                      ffn_hidden_size=32, num_experts=E, moe_ffn_hidden_size=FF, top_k=2, vocab_size=32)
    plain, biased = build_model(cfg, seed=1), build_model(cfg, seed=1)
    router = build_router("topk", H, E, top_k=2, gate_bias=True)
    biased.layers[0].ffn = MoELayer(H, FF, E, router, activation=cfg.activation, ffn_bias=True)
    with torch.no_grad():
        for p in biased.parameters():
            p.fill_(float("nan"))
    init_weights(biased, seed=1)
    got, want = biased.state_dict(), plain.state_dict()
    for k in ("layers.0.ffn.router.bias", "layers.0.ffn.experts.b_in", "layers.0.ffn.experts.b_out"):
        assert torch.equal(got[k], torch.zeros_like(got[k])), k
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    block = biased.layers[0]  # parameter accounting: the biases of the k active experts are vectors, not matmuls
    assert _inactive(block, cfg) == (E - 2) * (H * 2 * FF + FF * H + 2 * FF + H)  # weights and biases per expert
    assert _expert_bias_vectors(block, cfg) == 2 * (2 * FF + H) and _expert_bias_vectors(plain.layers[0], cfg) == 0
