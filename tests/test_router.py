import math
import sys
import textwrap

import pytest
import torch

from moekit.moe import update_router_biases
from moekit.moe.losses import (Sequences, bias_update_step, load_balance_loss, sequence_balance_loss, sequence_counts,
                               z_loss)
from moekit.moe.router import Router, apply_capacity, build_router, registered_routers
from moekit.moe.router_variants import sinkhorn
from tests.oracles import ref_capacity, ref_topk

H = 8


def route_logits(name, logits, **opts):
    r = build_router(name, H, logits.shape[1], **opts)
    return r, r.route(logits)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("score,normalize,k,E", [("softmax", True, 2, 8), ("softmax", False, 1, 4),
                                                 ("softmax", False, 3, 6), ("sigmoid", True, 4, 16)])
def test_topk_matches_per_token_loop(seed, score, normalize, k, E):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(37, E, generator=g) * 2
    _, r = route_logits("topk", logits, top_k=k, score=score, normalize=normalize, scaling=1.5)
    idx, w = ref_topk(logits, k, score, normalize, 1.5)
    assert r.indices.tolist() == idx
    torch.testing.assert_close(r.weights, torch.tensor(w, dtype=torch.float32), rtol=1e-5, atol=1e-6)
    assert r.weights.dtype == torch.float32 and r.indices.dtype == torch.int64
    assert r.tokens_per_expert.tolist() == [sum(row.count(e) for row in idx) for e in range(E)]


def test_topk_hand_worked():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 3.0, 1.0]])
    _, r = route_logits("topk", logits, top_k=2)
    assert r.indices.tolist() == [[0, 1], [2, 3]]
    e = math.exp(1.0)  # softmax ratio between the two winners, then renormalised
    torch.testing.assert_close(r.weights, torch.tensor([[e / (1 + e), 1 / (1 + e)], [e ** 2 / (1 + e ** 2), 1 / (1 + e ** 2)]]))
    assert r.tokens_per_expert.tolist() == [1, 1, 1, 1]


@pytest.mark.parametrize("seed", range(3))
def test_sigmoid_groups_bias_matches_loop(seed):
    g = torch.Generator().manual_seed(seed)
    E, k, G, M = 16, 4, 4, 2
    logits = torch.randn(29, E, generator=g)
    bias = torch.randn(E, generator=g) * 0.3
    _, r = route_logits("topk", logits, top_k=k, score="sigmoid", num_groups=G, group_top_k=M,
                        expert_bias=bias, scaling=2.5)
    idx, w = ref_topk(logits, k, "sigmoid", True, 2.5, bias=bias, num_groups=G, group_top_k=M)
    assert r.indices.tolist() == idx
    torch.testing.assert_close(r.weights, torch.tensor(w, dtype=torch.float32), rtol=1e-5, atol=1e-6)
    # every token's experts live in at most M groups
    assert all(len({e // (E // G) for e in row}) <= M for row in r.indices.tolist())


def test_bias_changes_selection_not_weights():
    logits = torch.tensor([[1.0, 0.9, -2.0, -3.0]])
    bias = torch.tensor([0.0, 0.0, 5.0, 0.0])
    _, plain = route_logits("topk", logits, top_k=1, score="sigmoid")
    _, biased = route_logits("topk", logits, top_k=1, score="sigmoid", expert_bias=bias, normalize=False)
    assert plain.indices.item() == 0 and biased.indices.item() == 2
    assert biased.weights.item() == pytest.approx(torch.sigmoid(torch.tensor(-2.0)).item())


def test_aux_loss_free_bias_update_moves_toward_balance():
    torch.manual_seed(0)
    E = 8
    r = build_router("topk", H, E, top_k=2, score="sigmoid", bias_update_rate=0.05, aux_loss_coeff=0.0)
    x = torch.randn(256, H) + torch.tensor([3.0] + [0.0] * (H - 1))  # skewed inputs
    with torch.no_grad():
        r.weight[0] += 1.0  # expert 0 is over-preferred
    r.train()
    first = r(x).tokens_per_expert.clone()
    r.apply_bias_update()
    assert r.expert_bias.abs().sum() > 0
    assert r.expert_bias.sum().abs() < 1e-5  # kept zero-mean
    assert r.expert_bias[first.argmax()] < 0 and r.expert_bias[first.argmin()] > 0
    for _ in range(100):
        r(x)
        r.apply_bias_update()
    last = r(x).tokens_per_expert
    assert last.max() / last.float().mean() < first.max() / first.float().mean()
    r.apply_bias_update()  # consume the load of the forward above
    # eval forwards do not accumulate load
    r.eval()
    before = r.expert_bias.clone()
    r(x)
    r.apply_bias_update()
    torch.testing.assert_close(r.expert_bias, before)


def test_bias_update_step_rule():
    bias = torch.tensor([0.3, 0.0, -0.1, 0.2])
    bias_update_step(bias, torch.tensor([4, 0, 2, 2]), 0.5)  # mean load 2: sign(2 - load) = [-1, 1, 0, 0]
    torch.testing.assert_close(bias, torch.tensor([-0.2, 0.5, -0.1, 0.2]) - 0.1)  # then re-centred to mean 0


def test_update_router_biases_reaches_every_router():
    """Every Router has apply_bias_update (a no-op unless it keeps a bias), so a model mixing families works."""
    torch.manual_seed(0)
    biased = build_router("topk", H, 4, top_k=1, score="sigmoid", bias_update_rate=0.1, aux_loss_coeff=0.0)
    routers = torch.nn.ModuleList([biased, build_router("switch", H, 4), build_router("expert_choice", H, 4),
                                   build_router("topk", H, 4)])
    routers.train()
    for r in routers:
        r(torch.randn(16, H) + 3.0)
    assert biased.pending_load.sum() == 16
    update_router_biases(routers)
    assert biased.pending_load.sum() == 0 and biased.expert_bias.abs().sum() > 0


@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("seed", range(3))
def test_capacity_matches_queue_reference(policy, seed):
    g = torch.Generator().manual_seed(seed)
    E, k, T, cf = 4, 2, 23, 0.7
    logits = torch.randn(T, E, generator=g) * 3
    _, r = route_logits("topk", logits, top_k=k, capacity_factor=cf, drop_policy=policy)
    C = math.ceil(T * k / E * cf)
    assert r.capacity == C
    idx, w = ref_topk(logits, k)
    idx, w = ref_capacity(idx, w, C, policy)
    assert r.indices.tolist() == idx
    torch.testing.assert_close(r.weights, torch.tensor(w, dtype=torch.float32), rtol=1e-5, atol=1e-6)
    assert r.tokens_per_expert.max() <= C
    dropped = sum(row.count(-1) for row in idx)
    assert r.stats["dropped_fraction"].item() == pytest.approx(dropped / (T * k))


def test_capacity_at_least_tokens_drops_nothing():
    logits = torch.randn(10, 4)
    _, r = route_logits("topk", logits, top_k=2, capacity_factor=100.0)
    assert r.capacity == 10  # never more than the number of tokens
    assert (r.indices >= 0).all() and r.stats["dropped_fraction"].item() == 0


def test_all_tokens_to_one_expert():
    T, E = 12, 4
    logits = torch.zeros(T, E)
    logits[:, 2] = 10.0
    logits[:, 1] = torch.linspace(0, 1, T)  # second choice, ordered by token
    _, r = route_logits("topk", logits, top_k=1, capacity_factor=1.0, drop_policy="position")
    assert r.capacity == 3
    assert r.indices[:, 0].tolist() == [2, 2, 2] + [-1] * 9  # earliest tokens kept
    assert r.tokens_per_expert.tolist() == [0, 0, 3, 0]
    assert r.stats["assigned_per_expert"].tolist() == [0, 0, 12, 0]
    assert r.stats["load_balance"].item() == pytest.approx(E * torch.softmax(logits, -1)[:, 2].mean().item(), rel=1e-5)


def test_ties_keep_earlier_tokens():
    T, E = 6, 2
    logits = torch.tensor([[1.0, 0.0]] * T)  # identical tokens: equal probs for expert 0
    for policy in ("probs", "position"):
        _, r = route_logits("topk", logits, top_k=1, capacity_factor=1.0, drop_policy=policy, normalize=False)
        assert r.indices[:, 0].tolist() == [0, 0, 0, -1, -1, -1], policy


def test_apply_capacity_probs_prefers_heavier_slots():
    indices = torch.tensor([[0], [0], [0]])
    weights = torch.tensor([[0.2], [0.9], [0.5]])
    i, w = apply_capacity(indices, weights, 2, 2, "probs")
    assert i[:, 0].tolist() == [-1, 0, 0] and w[0, 0].item() == 0.0


def test_switch_is_top1_with_jitter_only_in_training():
    torch.manual_seed(0)
    r = build_router("switch", H, 4, jitter=0.1, capacity_factor=None)
    x = torch.randn(16, H)
    r.eval()
    a, b = r(x), r(x)
    assert torch.equal(a.weights, b.weights) and a.indices.shape == (16, 1)
    torch.testing.assert_close(a.weights[:, 0], torch.softmax(r.logits(x), -1).max(-1).values)
    r.train()
    assert not torch.equal(r.logits(x), r.logits(x))


def test_expert_choice_balance_and_reference():
    g = torch.Generator().manual_seed(1)
    T, E, k, cf = 20, 5, 2, 1.0
    logits = torch.randn(T, E, generator=g)
    _, r = route_logits("expert_choice", logits, top_k=k, capacity_factor=cf)
    C = math.ceil(T * k / E * cf)
    assert r.tokens_per_expert.tolist() == [C] * E  # perfectly balanced
    scores = torch.softmax(logits, -1)
    for e in range(E):
        chosen = sorted(range(T), key=lambda t: -scores[t, e].item())[:C]
        assert sorted(t for t in range(T) if r.indices[t, e] == e) == sorted(chosen)
    probs, mask = r.to_dense(E)
    torch.testing.assert_close(probs, torch.where(mask, scores, 0.0))
    unrouted = sum(1 for t in range(T) if (r.indices[t] < 0).all())
    assert r.stats["unrouted_fraction"].item() == pytest.approx(unrouted / T)
    assert r.stats["dropped_fraction"].item() == 0


def test_sinkhorn_plan_is_balanced_and_routing_more_balanced_than_topk():
    g = torch.Generator().manual_seed(0)
    T, E = 256, 8
    logits = torch.randn(T, E, generator=g) + torch.linspace(0, 3, E)  # skewed towards high experts
    plan = sinkhorn(logits, num_iters=50).exp()
    torch.testing.assert_close(plan.sum(1), torch.ones(T), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(plan.sum(0), torch.full((E,), T / E), rtol=1e-3, atol=1e-2)
    sk = build_router("sinkhorn", H, E, top_k=1, num_iters=20)
    sk.train()
    balanced = sk.route(logits).tokens_per_expert.float()
    plain = build_router("topk", H, E, top_k=1).route(logits).tokens_per_expert.float()
    assert balanced.max() / balanced.mean() < 1.5 < plain.max() / plain.mean()
    sk.eval()
    assert sk.route(logits).indices[:, 0].tolist() == logits.argmax(-1).tolist()


def test_hash_router_is_deterministic_and_distinct():
    ids = torch.randint(0, 50_000, (4, 64))
    a = build_router("hash", H, 16, top_k=3)
    b = build_router("hash", H, 16, top_k=3)
    x = torch.randn(4 * 64, H)
    ra, rb = a(x, ids), b(torch.randn_like(x), ids)
    assert torch.equal(ra.indices, rb.indices)  # independent of hidden states and instance
    assert all(len(set(row)) == 3 for row in ra.indices.tolist())
    torch.testing.assert_close(ra.weights, torch.full((256, 3), 1 / 3))
    same = ids.flatten() == ids.flatten()[0]
    assert (ra.indices[same] == ra.indices[0]).all()  # same token id -> same experts
    other = build_router("hash", H, 16, top_k=3, seed=7)(x, ids)
    assert not torch.equal(ra.indices, other.indices)
    with pytest.raises(ValueError, match="token ids"):
        a(x)


def test_user_router_by_module_path(tmp_path, monkeypatch):
    (tmp_path / "my_routers.py").write_text(textwrap.dedent("""
        import torch
        from moekit.moe.router import Router

        class LastExpert(Router):
            def route(self, logits, token_ids=None):
                T, E = logits.shape
                idx = torch.full((T, 1), E - 1, dtype=torch.long)
                return self.finish(logits, logits.softmax(-1), idx, torch.ones(T, 1))
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    r = build_router("my_routers:LastExpert", H, 4)
    assert isinstance(r, Router)
    assert r(torch.randn(5, H)).tokens_per_expert.tolist() == [0, 0, 0, 5]
    with pytest.raises(ValueError, match="could not be loaded"):
        build_router("my_routers:Nope", H, 4)
    sys.modules.pop("my_routers", None)


def test_unknown_router_lists_known_names():
    with pytest.raises(ValueError) as err:
        build_router("tokp", H, 4)
    for name in ("topk", "switch", "expert_choice", "sinkhorn", "hash"):
        assert name in str(err.value)
    assert set(registered_routers()) >= {"topk", "switch", "expert_choice", "sinkhorn", "hash"}


@pytest.mark.parametrize("opts,match", [
    (dict(top_k=0), "top_k=0"), (dict(top_k=9), r"top_k=9.*\[1, 8\]"),
    (dict(capacity_factor=0.0), "capacity_factor=0.0"), (dict(capacity_factor=-1.0), "capacity_factor=-1.0"),
    (dict(drop_policy="random"), "drop_policy='random'"), (dict(score="tanh"), "score='tanh'"),
    (dict(num_groups=3, group_top_k=1), "num_groups=3 must divide num_experts=8"),
    (dict(num_groups=4, group_top_k=5), r"group_top_k=5.*\[1, 4\]"),
    (dict(top_k=3, num_groups=4, group_top_k=2), "group_top_k=2 must divide top_k=3"),
    (dict(num_groups=4), "set both or neither"), (dict(aux_loss_coeff=-0.1), "aux_loss_coeff=-0.1"),
    (dict(expert_bias=torch.zeros(3)), "expert_bias has shape"), (dict(wrong=1), "no option"),
    (dict(balance="token"), r"balance='token'.*\['batch', 'sequence'\]"),
])
def test_bad_options_name_the_parameter(opts, match):
    with pytest.raises(ValueError, match=match):
        build_router("topk", H, 8, **opts)


def test_hidden_size_mismatch():
    with pytest.raises(ValueError, match="hidden_size=8"):
        build_router("topk", H, 4)(torch.randn(3, H + 1))


def test_router_math_is_float32_under_bf16():
    r = build_router("topk", H, 4)
    x = torch.randn(6, H, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = r(x)
        assert r.logits(x).dtype == torch.float32
    assert out.weights.dtype == torch.float32


def test_losses_hand_worked():
    scores = torch.tensor([[0.5, 0.5], [1.0, 0.0]])
    assigned = torch.tensor([2, 0])
    # f = [1, 0], P = [0.75, 0.25] -> 2 * 0.75
    assert load_balance_loss(scores, assigned).item() == pytest.approx(1.5)
    logits = torch.tensor([[0.0, 0.0], [1.0, 2.0]])
    expect = (math.log(2) ** 2 + math.log(math.e + math.e ** 2) ** 2) / 2
    assert z_loss(logits).item() == pytest.approx(expect)


def per_sequence_reference(scores: torch.Tensor, indices: torch.Tensor, B: int) -> torch.Tensor:
    """DeepSeek-V3 eqs. 17-20 written out per sequence: f_i = E / (k S) * #choices of i, P_i = mean score."""
    T, E = scores.shape
    S, k = T // B, indices.shape[1]
    losses = []
    for b in range(B):
        rows = slice(b * S, (b + 1) * S)
        f = torch.stack([(indices[rows] == i).sum() for i in range(E)]).float() * E / (k * S)
        losses.append((f * scores[rows].mean(0)).sum())
    return torch.stack(losses).mean()


def test_sequence_balance_is_deepseek_per_sequence_loss_and_not_the_batch_one():
    """balance="sequence": the per-sequence loss written out (eqs. 17-20), through the router's autograd; a batch
    whose sequences each use one expert is balanced as a batch (loss 1) but not per sequence (loss E)."""
    torch.manual_seed(1)
    B, S, E, k = 3, 7, 6, 2
    r = build_router("topk", H, E, top_k=k, aux_loss_coeff=1.0, balance="sequence")
    x = torch.randn(B * S, H)
    routing = r(x, sequences=Sequences(0, S, B))
    scores = r.logits(x).softmax(-1)
    want = per_sequence_reference(scores, routing.indices, B)
    torch.testing.assert_close(routing.aux_loss, want)
    loads = [torch.bincount(routing.indices[b * S:(b + 1) * S].flatten(), minlength=E).float() for b in range(B)]
    torch.testing.assert_close(routing.stats["sequence_imbalance"],  # logged: mean per-sequence max / mean load
                               torch.stack([c.max() / c.mean() for c in loads]).mean())
    routing.aux_loss.backward()
    got = r.weight.grad.clone()
    r.weight.grad = None
    per_sequence_reference(r.logits(x).softmax(-1), routing.indices, B).backward()
    torch.testing.assert_close(got, r.weight.grad)
    # 2 sequences of 4 tokens, sequence b sending all its choices to expert b (scores one-hot): batch-balanced
    one_hot = torch.eye(2).repeat_interleave(4, 0)  # [8, 2]
    indices, grid = one_hot.argmax(1, keepdim=True), Sequences(0, 4, 2)
    assert load_balance_loss(one_hot, torch.tensor([4, 4])).item() == pytest.approx(1.0)
    assert sequence_balance_loss(one_hot, sequence_counts(indices, grid, 2), grid, 1).item() == pytest.approx(2.0)
    with pytest.raises(ValueError, match=r"balances per sequence \(balance='sequence'\) and needs each token's "
                                         r"sequence"):
        r(x)
    with pytest.raises(ValueError, match=r"21 tokens from position 1 do not fit 3 sequence\(s\) of 7"):
        r(x, sequences=Sequences(1, S, B))


def test_sequence_balance_split_over_ranks_adds_up():
    """A sequence cut between two simulated ranks (a TP token slice, a CP shard): with the per-sequence counts
    summed over both and sequence_parts = 2, the ranks' mean loss and gradient are one process's."""
    torch.manual_seed(2)
    B, S, E = 3, 5, 4
    r = build_router("topk", H, E, top_k=2, aux_loss_coeff=1.0, balance="sequence")
    x = torch.randn(B * S, H)
    ref = r(x, sequences=Sequences(0, S, B)).aux_loss
    ref.backward()
    ref_grad, r.weight.grad = r.weight.grad.clone(), None
    cut = [slice(0, 8), slice(8, 15)]  # sequence 1 is split 3 | 2
    grids = [Sequences(c.start, S, B) for c in cut]
    with torch.no_grad():
        counts = [sequence_counts(r.route(r.logits(x[c])).indices, g, E) for c, g in zip(cut, grids)]
    r.sequence_reducer, r.sequence_parts = (lambda c: counts[0] + counts[1]), 2
    mean = sum(r(x[c], sequences=g).aux_loss for c, g in zip(cut, grids)) / 2
    mean.backward()
    torch.testing.assert_close(mean, ref)
    torch.testing.assert_close(r.weight.grad, ref_grad)


def test_global_batch_reducer_reproduces_whole_batch_loss_and_grad():
    """Two simulated ranks with a count reducer: mean of local aux losses == one-process aux loss."""
    torch.manual_seed(0)
    E, T = 6, 40
    full = build_router("topk", H, E, top_k=2, aux_loss_coeff=1.0)
    x = torch.randn(T, H)
    ref = full(x).aux_loss
    ref.backward()
    ref_grad = full.weight.grad.clone()
    full.weight.grad = None
    halves = x.chunk(2)
    # the reducer sees each rank's counts; sum them as an all-reduce would
    with torch.no_grad():
        counts = [full.route(full.logits(h)).stats["assigned_per_expert"] for h in halves]
    full.count_reducer = lambda c: counts[0] + counts[1]
    local = [full(h).aux_loss for h in halves]
    mean = (local[0] + local[1]) / 2
    mean.backward()
    assert mean.item() == pytest.approx(ref.item(), rel=1e-5)
    torch.testing.assert_close(full.weight.grad, ref_grad, rtol=1e-5, atol=1e-7)


def test_to_dense():
    _, r = route_logits("topk", torch.randn(9, 4), top_k=2, capacity_factor=0.5)
    probs, mask = r.to_dense(4)
    assert mask.sum().item() == (r.indices >= 0).sum().item()
    for t in range(9):
        for j in range(2):
            e = r.indices[t, j].item()
            if e >= 0:
                assert mask[t, e] and probs[t, e].item() == r.weights[t, j].item()
    assert (probs[~mask] == 0).all()


def test_router_keeps_a_bf16_input_in_bf16_for_backward():
    """Router math is fp32, but a bf16 input is saved as bf16 (not its fp32 copy); gradients are bitwise the
    same as upcasting first."""
    from moekit.moe.router import build_router

    torch.manual_seed(0)
    router = build_router("topk", 32, 8, top_k=2)
    x = torch.randn(64, 32).bfloat16().requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        logits = router.logits(x)
    assert logits.dtype == torch.float32
    assert not any(t.dtype == torch.float32 and t.shape == x.shape for t in saved)
    g = torch.randn_like(logits)
    logits.backward(g)
    x2 = x.detach().clone().requires_grad_()
    w2 = router.weight.detach().clone().requires_grad_()
    torch.nn.functional.linear(x2.float(), w2).backward(g)
    assert torch.equal(x.grad, x2.grad.bfloat16()) and torch.equal(router.weight.grad, w2.grad)


@pytest.mark.parametrize("name,opts", [("topk", dict(top_k=2)), ("expert_choice", dict(capacity_factor=1.0))])
def test_zero_coefficient_terms_are_logged_but_left_out_of_backward(name, opts):
    """A loss term at coefficient 0 is computed outside autograd (issue 19): the same routing and logged
    stats as with the term weighted, an aux loss that is a constant 0, and backward never reaches it."""
    g = torch.Generator().manual_seed(4)
    E, T = 6, 29
    x = torch.randn(T, H, generator=g)
    zero = build_router(name, H, E, **opts, **({"aux_loss_coeff": 0.0} if name == "topk" else {}), z_loss_coeff=0.0)
    weighted = build_router(name, H, E, **opts, **({"aux_loss_coeff": 0.5} if name == "topk" else {}),
                            z_loss_coeff=0.25)
    weighted.load_state_dict(zero.state_dict())
    r0, r1 = zero(x), weighted(x)
    for a, b in ((r0.indices, r1.indices), (r0.weights, r1.weights), (r0.tokens_per_expert, r1.tokens_per_expert)):
        assert torch.equal(a, b)
    assert r0.stats.keys() == r1.stats.keys() and all(torch.equal(r0.stats[s], r1.stats[s]) for s in r0.stats)
    logits = x @ zero.weight.t()  # the logged z-loss against its definition, mean_t logsumexp^2
    torch.testing.assert_close(r0.stats["z_loss"], torch.logsumexp(logits, -1).square().mean())
    assert not r0.aux_loss.requires_grad and r0.aux_loss.item() == 0.0
    assert r1.aux_loss.requires_grad  # > 0 still computes it, with its gradient
    lb = r1.stats.get("load_balance", torch.zeros(()))
    torch.testing.assert_close(r1.aux_loss.detach(), (0.5 if name == "topk" else 0.0) * lb + 0.25 * r1.stats["z_loss"])
    (gz,) = torch.autograd.grad(z_loss(x @ weighted.weight.t()), weighted.weight, retain_graph=True)
    if name == "expert_choice":  # aux = 0.25 * z-loss alone: its gradient is the z-loss's
        torch.testing.assert_close(torch.autograd.grad(r1.aux_loss, weighted.weight)[0], 0.25 * gz)


@pytest.mark.parametrize("args,allowed", [((1,), "an integer >= 1"), ((0, 7), r"an integer in \[0, 7\]"),
                                          ((1, 1), "the integer 1")])
def test_check_int_wording(args, allowed):
    from moekit.moe.router import check_int

    with pytest.raises(ValueError, match=rf"^n=-3 is invalid; it must be {allowed}$"):
        check_int("n", -3, *args)


@pytest.mark.parametrize("x,error,needle", [
    (torch.ones(3, H, dtype=torch.long), TypeError, r"x\.dtype=torch\.int64 is not supported.*float32"),
    (torch.ones(3, H, dtype=torch.complex64), TypeError, r"x\.dtype=torch\.complex64"),
    (torch.tensor(2.0), ValueError, rf"x must be a tensor \[\.\.\., {H}\].*0-d"),
    ([[1.0] * H], TypeError, rf"x must be a tensor \[\.\.\., {H}\].*list"),
    (torch.zeros(3, H, device="meta"), ValueError, "meta tensors are not supported"),
])
def test_router_refuses_bad_hidden_states(x, error, needle):
    with pytest.raises(error, match=rf"router TopKRouter: .*{needle}"):
        build_router("topk", H, 4)(x)


def _fixed_router(aux_loss):
    from moekit.moe.router import Routing

    class Fixed(Router):
        def route(self, logits, token_ids=None):
            idx = logits.topk(1, dim=-1).indices
            return Routing(idx, torch.ones(idx.shape), torch.zeros(4, dtype=torch.long), aux_loss)

    return Fixed(H, 4)


@pytest.mark.parametrize("aux,needle", [
    (torch.ones(3, requires_grad=True), r"aux_loss has shape \(3,\); it must be a scalar tensor"),
    (torch.ones(1), r"aux_loss has shape \(1,\)"),
    (float("nan"), r"aux_loss=nan is invalid"), (float("inf"), r"aux_loss=inf is invalid"),
    (True, r"aux_loss=True is invalid"), ("0.1", r"must be tensors or numbers, got '0.1'"),
])
def test_custom_router_aux_loss_must_be_a_scalar(aux, needle):
    with pytest.raises(ValueError, match=rf"router .*Fixed: .*{needle}"):
        _fixed_router(aux)(torch.randn(3, H))


def test_custom_router_scalar_aux_loss_is_accepted():
    assert _fixed_router(0.5)(torch.randn(3, H)).aux_loss.shape == ()
    aux = torch.tensor(0.25, requires_grad=True)
    assert _fixed_router(aux)(torch.randn(3, H)).aux_loss is aux
