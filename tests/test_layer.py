import copy

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from moekit.moe import MoELayer, build_router, collect_load
from moekit.moe.layer import set_aux_loss_scale
from moekit.moe.experts import GroupedExperts, resolve_backend
from tests.oracles import act_fn, ref_moe

H, FF = 16, 32  # multiples of 16 bytes so the torch grouped_mm backend runs


def layer_and_input(E=6, k=2, activation="swiglu", seed=0, dtype=torch.float32, T=23, **router_opts):
    torch.manual_seed(seed)
    router = build_router("topk", H, E, top_k=k, **router_opts)
    layer = MoELayer(H, FF, E, router, activation=activation).to(dtype)
    x = torch.randn(T, H, dtype=dtype, requires_grad=True)
    return layer, x


def params(layer):
    return [layer.router.weight, layer.experts.w_in, layer.experts.w_out]


@pytest.mark.parametrize("activation", ["swiglu", "gelu", "relu"])
@pytest.mark.parametrize("k,cf", [(1, None), (2, None), (3, 0.6)])
def test_layer_matches_per_token_oracle(activation, k, cf):
    layer, x = layer_and_input(k=k, activation=activation, capacity_factor=cf, aux_loss_coeff=0.0,
                               dtype=torch.float64, seed=k)
    y = layer(x)
    routing = layer.router(x)
    ref = ref_moe(x, routing.indices, routing.weights.double(), layer.experts.w_in, layer.experts.w_out, activation)
    torch.testing.assert_close(y, ref)
    g = torch.randn_like(y)
    got = torch.autograd.grad(y, [x] + params(layer), g)
    want = torch.autograd.grad(ref, [x] + params(layer), g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_gradcheck_float64():
    """Tiny float64 case: routing stays float64 for float64 inputs, so finite differences are exact."""
    torch.manual_seed(0)
    h, f, E = 4, 3, 3
    layer = MoELayer(h, f, E, build_router("topk", h, E, top_k=2, aux_loss_coeff=0.0), backend="loop").double()
    x = torch.randn(5, h, dtype=torch.float64, requires_grad=True)
    names = ["router.weight", "experts.w_in", "experts.w_out"]

    def f_(x, *ws):
        return torch.func.functional_call(layer, dict(zip(names, ws)), (x,))

    inputs = (x, *(layer.get_parameter(n).detach().clone().requires_grad_() for n in names))
    assert torch.autograd.gradcheck(f_, inputs, eps=1e-6, atol=1e-7)


def test_aux_loss_reaches_backward_through_output():
    layer, x = layer_and_input(aux_loss_coeff=0.5, z_loss_coeff=0.1)
    layer.train()
    y = layer(x)
    g = torch.randn_like(y)
    grads = torch.autograd.grad(y, params(layer), g)
    # reference: the same forward without injection, aux loss added to the objective by hand
    routing = layer.router(x)
    plain = layer.dispatcher.combine(
        layer.experts(*(lambda d: (d.rows, d.counts))(layer.dispatcher.dispatch(x, routing))),
        layer.dispatcher.dispatch(x, routing).meta)
    want = torch.autograd.grad((plain * g).sum() + routing.aux_loss, params(layer), retain_graph=True)
    for a, b in zip(grads, want):
        torch.testing.assert_close(a, b)
    assert routing.aux_loss.item() > 0
    layer.aux_loss_scale = 0.0  # e.g. gradient accumulation scale: the aux term can be switched off
    g0 = torch.autograd.grad(layer(x), layer.router.weight, g)[0]
    w0 = torch.autograd.grad((plain * g).sum(), layer.router.weight)[0]
    torch.testing.assert_close(g0, w0)


def test_one_expert_top1_equals_dense_ffn():
    torch.manual_seed(0)
    layer = MoELayer(H, FF, 1, build_router("topk", H, 1, top_k=1, normalize=False))
    x = torch.randn(2, 7, H)
    w_in, w_out = layer.experts.w_in[0], layer.experts.w_out[0]
    dense = act_fn("swiglu")(x @ w_in) @ w_out  # softmax over one expert gives weight exactly 1
    torch.testing.assert_close(layer(x), dense)


def test_dropless_equals_huge_capacity():
    a, x = layer_and_input(k=2, seed=3)
    b, _ = layer_and_input(k=2, seed=3, capacity_factor=1000.0)
    torch.testing.assert_close(a(x), b(x))


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backends_equal_loop(backend, dtype):
    """fp32: equal to the loop. bf16: no further from a float64 reference than the loop in bf16 is."""
    layer, x = layer_and_input(E=8, k=2, T=41, seed=5, dtype=dtype)
    try:
        resolve_backend(backend, x, layer.experts.w_in, layer.experts.w_out)
    except ValueError as exc:  # triton without a GPU or TRITON_INTERPRET=1 (covered by test_kernels)
        pytest.skip(str(exc))

    def run(module, inp):
        out = module(inp)
        return [out.detach(), *torch.autograd.grad(out.float().square().sum(), [inp] + params(module))]

    layer.experts.backend = "loop"
    loop = run(layer, x)
    layer.experts.backend = backend
    got = run(layer, x)
    if dtype == torch.float32:
        for a, b in zip(got, loop):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        return
    ref64 = copy.deepcopy(layer).double()
    ref64.experts.backend = "loop"
    exact = run(ref64, x.detach().double().requires_grad_())
    for a, b, r in zip(got, loop, exact):
        err, err_loop = (a.double() - r).abs().max(), (b.double() - r).abs().max()
        assert err <= 2 * err_loop + 1e-3 * r.abs().max(), (err, err_loop)


def test_auto_backend_order_follows_the_measured_shapes():
    """auto on a GPU: Triton first, torch's grouped matmul first for large experts (H x F >= 2**23); the
    loop on CPU. Shapes from docs/benchmarks.md's second GPU round (meta tensors: no GPU needed)."""
    from moekit.moe.experts import LARGE_EXPERT_ELEMENTS, auto_order

    cuda, cpu = torch.device("cuda"), torch.device("cpu")

    def w_out(E, F, H):
        return torch.empty(E, F, H, device="meta")

    assert auto_order(cpu, w_out(8, 14336, 4096)) == ("loop",)
    for E, F, H in ((8, 14336, 4096), (32, 2048, 7168)):  # Mixtral-8x7B, DeepSeek-V3 local experts
        assert auto_order(cuda, w_out(E, F, H))[0] == "torch"
    for E, F, H in ((8, 3072, 1024), (128, 768, 2048), (128, 256, 1536)):  # mixtral-1b, Qwen3-30B-A3B, fine
        assert auto_order(cuda, w_out(E, F, H))[0] == "triton"
    F = 2048
    H = LARGE_EXPERT_ELEMENTS // F
    assert auto_order(cuda, w_out(4, F, H))[0] == "torch"  # the threshold itself counts as large
    assert auto_order(cuda, w_out(4, F, H - 1))[0] == "triton"
    assert set(auto_order(cuda, w_out(4, F, H))) == set(auto_order(cuda)) == {"torch", "triton", "loop"}


def test_bitwise_repeatable():
    layer, x = layer_and_input(E=8, k=2, T=64, seed=2)
    y1 = layer(x)
    g1 = torch.autograd.grad(y1.sum(), [x] + params(layer))
    y2 = layer(x)
    g2 = torch.autograd.grad(y2.sum(), [x] + params(layer))
    assert torch.equal(y1, y2) and all(torch.equal(a, b) for a, b in zip(g1, g2))


def test_shared_expert_with_sigmoid_gate():
    torch.manual_seed(0)
    routed = MoELayer(H, FF, 4, build_router("topk", H, 4))
    shared = MoELayer(H, FF, 4, build_router("topk", H, 4), shared_ffn_hidden_size=24, shared_expert_gate=True)
    shared.load_state_dict(routed.state_dict(), strict=False)
    x = torch.randn(9, H)
    se = shared.shared_expert
    extra = torch.sigmoid(x @ se.gate.weight.T) * (act_fn("swiglu")(x @ torch.cat([se.w_gate.weight, se.w_up.weight]).T) @ se.w_out.weight.T)
    torch.testing.assert_close(shared(x), routed(x) + extra)


def test_layer_accepts_any_leading_shape_and_router_name():
    layer = MoELayer(H, FF, 4, "switch", activation="gelu")
    assert layer(torch.randn(2, 3, 5, H)).shape == (2, 3, 5, H)
    hashed = MoELayer(H, FF, 4, "hash")
    ids = torch.randint(0, 100, (2, 5))
    assert hashed(torch.randn(2, 5, H), token_ids=ids).shape == (2, 5, H)


def test_load_tracking_training_only_and_not_double_counted_by_checkpointing():
    layer, x = layer_and_input(E=4, k=2, T=10)
    layer.eval()
    layer(x)
    assert collect_load(layer)[""].forwards == 0
    layer.train()
    checkpoint(layer, x, use_reentrant=False).sum().backward()
    s = collect_load(layer)[""]
    assert s.forwards == 1 and sum(s.tokens_per_expert) == 20 and s.dropped_slots == 0
    checkpoint(layer, x, use_reentrant=True).sum().backward()
    assert collect_load(layer, reset=False)[""].forwards == 1
    layer(x)
    s = collect_load(layer)[""]
    assert s.forwards == 2 and sum(s.assigned_per_expert) == 40
    assert collect_load(layer)[""].forwards == 0  # collect resets by default


def test_load_records_drops():
    layer, x = layer_and_input(E=4, k=2, T=40, capacity_factor=0.5)
    layer.train()
    layer(x)
    s = collect_load(layer)[""]
    assert s.dropped_slots > 0 and max(s.tokens_per_expert) <= 10
    assert s.dropped_fraction == pytest.approx(s.stats["dropped_fraction"])


def test_bad_layer_input():
    with pytest.raises(ValueError, match="hidden_size=8, num_experts=4"):
        MoELayer(H, FF, 4, build_router("topk", 8, 4))
    with pytest.raises(ValueError, match="activation='tanh'"):
        MoELayer(H, FF, 4, "topk", activation="tanh")
    with pytest.raises(ValueError, match="expected 16"):
        MoELayer(H, FF, 4, "topk")(torch.randn(3, 8))
    with pytest.raises(ValueError, match="backend 'cuda'"):
        GroupedExperts(4, H, FF, backend="cuda")
    with pytest.raises(ValueError, match="cannot run"):
        e = GroupedExperts(4, H, FF, backend="torch").double()
        e(torch.randn(3, H, dtype=torch.float64), torch.tensor([3, 0, 0, 0]))


def test_bf16_autocast_training_step():
    layer, x = layer_and_input(E=4, k=2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x.detach())
    assert y.dtype == torch.bfloat16
    y.float().square().mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in params(layer))
    assert F.mse_loss(y.float(), layer(x).detach()) < 1e-3


def test_autocast_dispatches_rows_in_the_compute_dtype():
    """Under bf16 autocast the rows are cast before dispatch (half the bytes through an EP all-to-all); the
    output equals casting after dispatch (the permutation is exact), and the router still sees fp32."""
    layer, x = layer_and_input(E=4, k=2)
    seen = {}
    dispatch, route = layer.dispatcher.dispatch, layer.router.forward

    def spy_dispatch(rows, routing):
        seen["rows"] = rows.dtype
        return dispatch(rows, routing)

    def spy_route(inp, *args, **kwargs):
        seen["router"] = inp.dtype
        return route(inp, *args, **kwargs)

    layer.dispatcher.dispatch, layer.router.forward = spy_dispatch, spy_route
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x.detach())
    assert seen == {"rows": torch.bfloat16, "router": torch.float32}
    layer.dispatcher.dispatch, layer.router.forward = dispatch, route  # the old order: fp32 rows, cast in experts
    with torch.autocast("cpu", dtype=torch.bfloat16):
        flat = x.detach().reshape(-1, x.shape[-1])
        d = layer.dispatcher.dispatch(flat, layer.router(flat))
        ref = layer.dispatcher.combine(layer.experts(d.rows, d.counts), d.meta)
    torch.testing.assert_close(y.reshape(ref.shape), ref.to(y.dtype), rtol=0, atol=0)


class EveryOther:
    """A fake in-process TokenSplit: "rank" ``part`` of 2 routes every other token; gather puts its rows
    back among zeros, so the two ranks' outputs add up to the whole layer's."""

    parts = 2

    def __init__(self, part):
        self.part, self.calls = part, []

    def split(self, x, token_ids):
        flat = x.reshape(-1, x.shape[-1])
        idx = torch.arange(self.part, flat.shape[0], 2)
        ids = None if token_ids is None else token_ids.reshape(-1)[idx]
        self.calls.append(("split", len(idx)))
        return flat[idx], ids, (idx, flat.shape[0])

    def gather(self, y, meta):
        idx, T = meta
        self.calls.append(("gather", y.shape[0]))
        return y.new_zeros(T, y.shape[-1]).index_copy(0, idx, y)


@pytest.mark.parametrize("router", ["topk", "hash"])
def test_token_split_slot_routes_this_ranks_tokens(router):
    """MoELayer routes only what its token_split hands it (token ids follow: the hash router reads them),
    and the split aux losses, scaled by 1/parts (set_aux_loss_scale), give the whole layer's gradient."""
    torch.manual_seed(0)
    B, S, E = 2, 6, 4  # 12 tokens, 6 per "rank": the z-loss means over the halves average to the whole
    opts = dict(top_k=2, aux_loss_coeff=0.0, z_loss_coeff=0.1) if router == "topk" else {}
    whole = MoELayer(H, FF, E, build_router(router, H, E, **opts), backend="loop").double()
    assert whole.token_split.parts == 1 and whole.dispatcher.expert_range == (0, E)
    x = torch.randn(B, S, H, dtype=torch.float64)
    ids = torch.randint(0, 50, (B, S))
    y = whole(x, token_ids=ids)
    grads = torch.autograd.grad(y.square().sum(), list(whole.parameters()))
    halves, split_grads = [], []
    for part in range(2):
        layer = copy.deepcopy(whole)
        layer.token_split = EveryOther(part)
        set_aux_loss_scale(layer, token_slices=2)
        out = layer(x, token_ids=ids)
        assert out.shape == x.shape and layer.token_split.calls == [("split", 6), ("gather", 6)]
        halves.append(out)
        split_grads.append(torch.autograd.grad(out.square().sum(), list(layer.parameters())))
    torch.testing.assert_close(halves[0] + halves[1], y)
    assert halves[0].reshape(-1, H)[1::2].abs().max() == 0  # rows of the other "rank"
    for g, a, b in zip(grads, *split_grads):
        torch.testing.assert_close(a + b, g)


def test_set_aux_loss_scale_sets_every_layer_once():
    layers = torch.nn.ModuleList(MoELayer(H, FF, 4, "topk") for _ in range(2))
    set_aux_loss_scale(layers, accumulation=4, microbatches=1)
    set_aux_loss_scale(layers, accumulation=3, token_slices=1, microbatches=2)  # sets, does not divide again
    assert [m.aux_loss_scale for m in layers] == [1.0 / 3 / 2] * 2
    layers[0].token_split = EveryOther(0)
    with pytest.raises(ValueError, match=r"token_slices=1\) but the MoE layers' token split has 2 parts"):
        set_aux_loss_scale(layers, accumulation=2)
    with pytest.raises(ValueError, match="microbatches=0"):
        set_aux_loss_scale(layers, microbatches=0)


# --- bad inputs to forward: a TypeError / ValueError naming x, before any op (shape/dtype/device checks only) ---


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
@pytest.mark.parametrize("dtype", [torch.long, torch.int32, torch.int8, torch.bool, torch.complex64])
def test_non_floating_input_is_a_type_error_naming_the_dtype(dtype, activation):
    layer = MoELayer(H, FF, 4, "topk", activation=activation)
    with pytest.raises(TypeError, match=rf"MoELayer: x\.dtype={dtype}.*float32, bfloat16, float16, float64"):
        layer(torch.ones(3, H, dtype=dtype))


@pytest.mark.parametrize("x,error,needle", [
    (torch.tensor(1.0), ValueError, r"x must be a tensor \[\.\.\., 16\].*0-d tensor"),
    ([[0.0] * H], TypeError, r"x must be a tensor \[\.\.\., 16\].*got a list"),
    (pytest.importorskip("numpy").zeros((3, H), dtype="float32"), TypeError,
     r"x must be a tensor \[\.\.\., 16\].*numpy\.ndarray.*torch\.as_tensor"),
])
def test_non_tensor_or_0d_input_names_what_was_given(x, error, needle):
    with pytest.raises(error, match=needle):
        MoELayer(H, FF, 4, "topk")(x)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_shared_expert_follows_the_routed_experts_dtype(dtype):
    """float32 weights, float64 (or bf16) input: the shared expert computes in the input's dtype, as the routed
    experts do, instead of failing in F.linear; in float64 it matches a float64 copy of itself exactly."""
    torch.manual_seed(0)
    layer = MoELayer(H, FF, 4, "topk", shared_ffn_hidden_size=8, shared_expert_gate=True)
    x = torch.randn(5, H, dtype=dtype, requires_grad=True)
    y = layer(x)
    assert y.dtype == dtype and y.shape == x.shape
    y.sum().backward()
    assert x.grad.dtype == dtype and layer.shared_expert.w_up.weight.grad.dtype == torch.float32
    if dtype == torch.float64:
        ref = copy.deepcopy(layer.shared_expert).double()
        torch.testing.assert_close(layer.shared_expert(x), ref(x), rtol=0, atol=0)


def test_shared_expert_under_autocast_keeps_autocasts_dtype():
    layer = MoELayer(H, FF, 4, "topk", shared_ffn_hidden_size=8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer.shared_expert(torch.randn(3, H)).dtype == torch.bfloat16


def test_meta_input_is_refused_clearly():
    with pytest.raises(ValueError, match="meta tensors are not supported in forward.*to_empty"):
        MoELayer(H, FF, 4, "topk")(torch.randn(3, H, device="meta"))


def test_router_without_route_names_the_method_to_implement():
    from moekit.moe.router import Router

    class NoRoute(Router):
        pass

    layer = MoELayer(H, FF, 4, NoRoute(H, 4))
    with pytest.raises(NotImplementedError, match=r"NoRoute does not implement route\(\).*route\(self, logits"):
        layer(torch.randn(3, H))
