"""Dumb, obviously-correct references written another way than moekit (Python loops over tokens)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def ref_topk(logits, k, score="softmax", normalize=True, scaling=1.0, bias=None,
             num_groups=None, group_top_k=None):
    """Per-token loop: returns (indices [T,k] list of lists, weights [T,k] list of lists)."""
    T, E = logits.shape
    indices, weights = [], []
    for t in range(T):
        row = logits[t].double().tolist()
        if score == "softmax":
            m = max(row)
            ex = [math.exp(v - m) for v in row]
            s = [v / sum(ex) for v in ex]
        else:
            s = [1 / (1 + math.exp(-v)) for v in row]
        choice = [s[e] + (float(bias[e]) if bias is not None else 0.0) for e in range(E)]
        allowed = set(range(E))
        if num_groups:
            per = E // num_groups
            gscore = []
            for g in range(num_groups):
                members = sorted((choice[e] for e in range(g * per, (g + 1) * per)), reverse=True)
                gscore.append((sum(members[: k // group_top_k]), -g))
            best = [-g for _, g in sorted(gscore, reverse=True)[:group_top_k]]
            allowed = {e for g in best for e in range(g * per, (g + 1) * per)}
        ranked = sorted(allowed, key=lambda e: (-choice[e], e))[:k]
        w = [s[e] for e in ranked]
        if normalize:
            w = [v / sum(w) for v in w]
        indices.append(ranked)
        weights.append([v * scaling for v in w])
    return indices, weights


def ref_capacity(indices, weights, capacity, policy):
    """Drop by explicit per-expert queues: probs -> highest weight first (earlier token on ties)."""
    T = len(indices)
    queues = {}
    for t in range(T):
        for j, e in enumerate(indices[t]):
            if e >= 0:
                queues.setdefault(e, []).append((t, j))
    keep = set()
    for e, q in queues.items():
        if policy == "probs":
            q = sorted(q, key=lambda tj: (-weights[tj[0]][tj[1]], tj[0]))
        keep.update(q[:capacity])
    out_i = [[e if (t, j) in keep else -1 for j, e in enumerate(indices[t])] for t in range(T)]
    out_w = [[w if (t, j) in keep else 0.0 for j, w in enumerate(weights[t])] for t in range(T)]
    return out_i, out_w


def act_fn(name):
    if name == "swiglu":
        return lambda h: F.silu(h.chunk(2, -1)[0]) * h.chunk(2, -1)[1]
    return {"gelu": F.gelu, "relu": F.relu}[name]


def ref_moe(x, indices, weights, w_in, w_out, activation):
    """out[t] = sum over kept slots of w * expert_e(x[t]), one token and one expert at a time."""
    act = act_fn(activation)
    outs = []
    for t in range(x.shape[0]):
        acc = torch.zeros_like(x[t])
        for j in range(indices.shape[1]):
            e = int(indices[t, j])
            if e >= 0:
                acc = acc + weights[t, j].to(x.dtype) * (act(x[t] @ w_in[e]) @ w_out[e])
        outs.append(acc)
    return torch.stack(outs) if outs else x.new_zeros(0, x.shape[1])
