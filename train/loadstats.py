"""Expert-load statistics that scale: one chunked pass over a run's record (moekit.train.records).

Per optimizer step and MoE layer, from the kept tokens per expert c_e (E experts) of that step:

    imbalance  max(c) / mean(c)      1 = balanced, E = one expert took every slot (0 when the layer got none)
    cv         std(c) / mean(c)      coefficient of variation (population std; 0 when the layer got none)
    dropped    dropped slots / assigned slots of the layer in that step
    dead       experts with c_e = 0 in that step
    saturated  experts at capacity: the router assigned them more slots than they kept (assigned_e > c_e)
    hot        experts with c_e >= HOT x mean(c)

Their distribution over steps (``distribution``): mean, p50, p95 and max, over the steps of one layer or
pooled over every (step, layer) pair (numpy's linear percentiles). The window totals (counts summed over
the steps) give each expert's share of the layer's tokens, as the heatmaps show it.

``analyse`` reads the record ``rows`` steps at a time (about 64 MB of int64 counts), so a memory-mapped
61 x 256 x 100,000-step record is never in memory whole: it keeps [N, L] per-step statistics, [L, E]
totals and [B, L, E] sums over at most ``max_bins`` step bins.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moekit.train.records import ExpertLoadRecord

HOT = 2.0  # an expert is "hot" in a step when it gets at least HOT x the layer's mean load
MAX_BINS = 512  # step bins of the over-time heatmaps and curves
CHUNK_BYTES = 64 << 20


@dataclass
class LayerStats:
    """Window statistics of one layer from its summed counts (the old summary's numbers) plus the per-step
    imbalance distribution."""

    name: str
    share: np.ndarray  # [E] fraction of the layer's kept slots per expert over the window
    imbalance: float  # max/mean of the summed counts
    cv: float
    dropped: float
    step_imbalance: dict  # distribution over steps of the per-step max/mean
    dead_fraction: float  # mean over steps of the share of experts with no token


def distribution(values: np.ndarray) -> dict:
    """mean, p50, p95, max of ``values`` (any shape, flattened; NaN ignored)."""
    v = np.asarray(values, dtype=np.float64).ravel()
    v = v[~np.isnan(v)]
    if v.size == 0:
        return {"mean": float("nan"), "p50": float("nan"), "p95": float("nan"), "max": float("nan")}
    return {"mean": float(v.mean()), "p50": float(np.percentile(v, 50)), "p95": float(np.percentile(v, 95)),
            "max": float(v.max())}


def step_stats(tokens: np.ndarray, assigned: np.ndarray, dropped: np.ndarray) -> dict[str, np.ndarray]:
    """Per-step per-layer statistics of int counts tokens/assigned [n, L, E], dropped [n, L] (module doc)."""
    E = tokens.shape[-1]
    total = tokens.sum(axis=-1, dtype=np.int64)  # [n, L]
    mean = total / E
    with np.errstate(invalid="ignore", divide="ignore"):
        imbalance = np.where(total > 0, tokens.max(axis=-1) / np.where(mean > 0, mean, 1), 0.0)
        tf = tokens.astype(np.float64)
        sq = np.einsum("nle,nle->nl", tf, tf)
        var = np.maximum(sq / E - mean * mean, 0.0)
        cv = np.where(total > 0, np.sqrt(var) / np.where(mean > 0, mean, 1), 0.0)
        routed = assigned.sum(axis=-1, dtype=np.int64)
        drop = np.where(routed > 0, dropped / np.where(routed > 0, routed, 1), 0.0)
        hot = (tf >= HOT * mean[..., None]) & (tokens > 0)
    return {"imbalance": imbalance, "cv": cv, "dropped": drop,
            "dead": (tokens == 0).sum(axis=-1, dtype=np.int32),
            "saturated": (assigned > tokens).sum(axis=-1, dtype=np.int32),
            "hot": hot.sum(axis=-1, dtype=np.int32)}


@dataclass
class LoadAnalysis:
    router: str
    top_k: int
    layers: list[str]
    num_experts: int
    steps: np.ndarray  # [N]
    imbalance: np.ndarray  # [N, L] float64
    cv: np.ndarray  # [N, L]
    dropped: np.ndarray  # [N, L] fraction
    dead: np.ndarray  # [N, L] int
    saturated: np.ndarray  # [N, L] int
    hot: np.ndarray  # [N, L] int
    totals: np.ndarray  # [L, E] kept slots summed over the window
    assigned_totals: np.ndarray  # [L, E]
    dropped_totals: np.ndarray  # [L]
    bin_edges: np.ndarray  # [B + 1] row indices: bin b holds rows bin_edges[b] .. bin_edges[b+1]-1
    bin_sums: np.ndarray  # [B, L, E] kept slots summed over each bin's steps

    @property
    def share(self) -> np.ndarray:
        """[L, E] each expert's share of its layer's kept slots over the window."""
        t = self.totals.astype(np.float64)
        s = t.sum(axis=1, keepdims=True)
        return np.divide(t, s, out=np.zeros_like(t), where=s > 0)

    @property
    def bin_steps(self) -> np.ndarray:
        """[B] the mean step of each bin (x positions of binned curves and heatmap columns)."""
        e = self.bin_edges
        csum = np.concatenate([[0.0], np.cumsum(self.steps, dtype=np.float64)])
        return (csum[e[1:]] - csum[e[:-1]]) / np.maximum(e[1:] - e[:-1], 1)

    @property
    def bin_share(self) -> np.ndarray:
        """[B, L, E] share of the layer's kept slots per expert in each step bin."""
        t = self.bin_sums.astype(np.float64)
        s = t.sum(axis=2, keepdims=True)
        return np.divide(t, s, out=np.zeros_like(t), where=s > 0)

    def binned(self, values: np.ndarray, reduce: str = "mean") -> np.ndarray:
        """[N, ...] per-step values -> [B, ...] per bin (mean or max over the bin's steps)."""
        e = self.bin_edges
        if reduce == "max":
            return np.maximum.reduceat(values, e[:-1], axis=0)
        return np.add.reduceat(values.astype(np.float64), e[:-1], axis=0) / (e[1:] - e[:-1]).reshape(
            (-1,) + (1,) * (values.ndim - 1))

    def layer_stats(self) -> list[LayerStats]:
        out = []
        assigned = self.assigned_totals.sum(axis=1).astype(np.float64)
        share = self.share
        E = self.num_experts
        for i, name in enumerate(self.layers):
            c = self.totals[i].astype(np.float64)
            mean = c.mean()
            out.append(LayerStats(name, share[i], float(c.max() / mean) if mean > 0 else 0.0,
                                  float(c.std() / mean) if mean > 0 else 0.0,
                                  float(self.dropped_totals[i] / assigned[i]) if assigned[i] > 0 else 0.0,
                                  distribution(self.imbalance[:, i]), float(self.dead[:, i].mean() / E)))
        return out

    def summary(self) -> dict:
        """The run's numbers over the window: per-step distributions pooled over layers, and totals."""
        E = self.num_experts
        assigned = float(self.assigned_totals.sum())
        return {
            "steps": [int(self.steps[0]), int(self.steps[-1])], "records": int(self.steps.size),
            "layers": len(self.layers), "experts": E, "router": self.router, "top_k": self.top_k,
            "step_imbalance": distribution(self.imbalance),  # every (step, layer)
            "step_imbalance_worst_layer": distribution(self.imbalance.max(axis=1)),  # per step, the worst layer
            "step_cv": distribution(self.cv),
            "dropped_fraction": float(self.dropped_totals.sum() / assigned) if assigned > 0 else 0.0,
            "dead_fraction": float(self.dead.mean() / E),  # share of experts with no token, mean over steps, layers
            "saturated_fraction": float(self.saturated.mean() / E),
            "hot_fraction": float(self.hot.mean() / E),
            "window_imbalance": float(np.mean([s.imbalance for s in self.layer_stats()])),
        }

    def per_layer(self) -> list[dict]:
        return [{"layer": s.name, "step_imbalance": s.step_imbalance,
                 "step_cv_mean": float(self.cv[:, i].mean()), "window_imbalance": s.imbalance, "window_cv": s.cv,
                 "dropped_fraction": s.dropped, "dead_fraction": s.dead_fraction,
                 "saturated_fraction": float(self.saturated[:, i].mean() / self.num_experts)}
                for i, s in enumerate(self.layer_stats())]


def bin_edges(n: int, max_bins: int) -> np.ndarray:
    """Row boundaries of min(n, max_bins) contiguous, near-equal bins."""
    bins = max(1, min(n, max_bins))
    return np.unique(np.linspace(0, n, bins + 1).round().astype(np.int64))


def analyse(rec: ExpertLoadRecord, max_bins: int = MAX_BINS, chunk_bytes: int = CHUNK_BYTES) -> LoadAnalysis:
    """Every statistic of the module doc in one pass over ``rec``, ``chunk_bytes`` of counts at a time."""
    N, L, E = len(rec), len(rec.layers), rec.num_experts
    edges = bin_edges(N, max_bins)
    B = edges.size - 1
    rows = max(1, chunk_bytes // max(L * E * 8, 1))  # about chunk_bytes of float64 working copies
    per = {k: np.zeros((N, L), dtype=np.float64 if k in ("imbalance", "cv", "dropped") else np.int32)
           for k in ("imbalance", "cv", "dropped", "dead", "saturated", "hot")}
    totals = np.zeros((L, E), dtype=np.int64)
    assigned_totals = np.zeros((L, E), dtype=np.int64)
    dropped_totals = np.zeros(L, dtype=np.int64)
    bin_sums = np.zeros((B, L, E), dtype=np.int64)
    bin_of = np.repeat(np.arange(B), np.diff(edges))  # [N] bin of each row
    for start, tokens, assigned, dropped in rec.chunks(rows):
        n = tokens.shape[0]
        for k, v in step_stats(tokens, assigned, dropped).items():
            per[k][start : start + n] = v
        totals += tokens.sum(axis=0, dtype=np.int64)
        assigned_totals += assigned.sum(axis=0, dtype=np.int64)
        dropped_totals += dropped.sum(axis=0, dtype=np.int64)
        b = bin_of[start : start + n]
        cuts = np.flatnonzero(np.diff(b)) + 1  # the chunk's rows grouped by bin (contiguous)
        firsts = np.concatenate([[0], cuts])
        bin_sums[b[firsts]] += np.add.reduceat(tokens, firsts, axis=0, dtype=np.int64)  # distinct bins
    return LoadAnalysis(rec.router, rec.top_k, list(rec.layers), E, np.asarray(rec.steps), per["imbalance"],
                        per["cv"], per["dropped"], per["dead"], per["saturated"], per["hot"], totals,
                        assigned_totals, dropped_totals, edges, bin_sums)


def layer_load_stats(load: dict) -> dict[str, dict]:
    """Per MoE layer, one step's numbers from ``moe.collect_load`` summaries {name: LoadSummary}: imbalance,
    cv, dropped (fraction), dead, saturated, and the routers' unweighted balance_loss / z_loss where they
    report them. What the TensorBoard and W&B sinks log per layer."""
    if not load:
        return {}
    names = list(load)
    tokens = np.array([[s.tokens_per_expert for s in load.values()]], dtype=np.int64)  # [1, L, E]
    assigned = np.array([[s.assigned_per_expert for s in load.values()]], dtype=np.int64)
    dropped = np.array([[s.dropped_slots for s in load.values()]], dtype=np.int64)
    st = step_stats(tokens, assigned, dropped)
    out = {}
    for i, name in enumerate(names):
        s = load[name]
        row = {"imbalance": float(st["imbalance"][0, i]), "cv": float(st["cv"][0, i]),
               "dropped": float(st["dropped"][0, i]), "dead": int(st["dead"][0, i]),
               "saturated": int(st["saturated"][0, i])}
        if "load_balance" in s.stats:
            row["balance_loss"] = float(s.stats["load_balance"])
        if "z_loss" in s.stats:
            row["z_loss"] = float(s.stats["z_loss"])
        if "sequence_imbalance" in s.stats:  # routers balancing per sequence (moe.losses.sequence_imbalance)
            row["sequence_imbalance"] = float(s.stats["sequence_imbalance"])
        out[name] = row
    return out


def load_metrics(load: dict) -> dict:
    """metrics.jsonl keys from one step's load summaries: balance_loss and z_loss (the routers' terms before
    their coefficients, mean over the MoE layers that report them; absent when none does), sequence_imbalance
    (routers balancing per sequence: the mean per-sequence max / mean load, mean over those layers), cv (mean
    over layers), dead_experts (experts with no kept token this step, summed over layers)."""
    per = layer_load_stats(load)
    if not per:
        return {}
    out = {"cv": float(np.mean([r["cv"] for r in per.values()])),
           "dead_experts": int(sum(r["dead"] for r in per.values()))}
    for key in ("balance_loss", "z_loss", "sequence_imbalance"):
        vals = [r[key] for r in per.values() if key in r]
        if vals:
            out[key] = float(np.mean(vals))
    return out
