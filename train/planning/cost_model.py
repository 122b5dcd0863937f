"""Expected dispatch traffic per token for flat and hierarchical expert-parallel all-to-all.

Model: N nodes x G ranks per node form the EP group; E experts, E/(N G) per rank; each token picks k
distinct experts uniformly at random (what a well-balanced router approaches). Optionally node-limited
routing confines a token's experts to at most M nodes (DeepSeek-V3: M = 4), modelled as: M nodes drawn
uniformly, k experts uniformly among those nodes' experts. Rows are H elements of ``bytes_per_elem``.

Dispatch only; combine moves the same bytes back (flat: one row per slot; hierarchical: one partial sum
per (token, node), so its inter-node combine traffic is deduplicated as well).

    flat          inter rows / token = k * P(expert on another node)
                  intra rows / token = k * P(expert on my node, another rank)
    hierarchical  inter rows / token = E[# remote nodes among the token's expert nodes]
                  intra rows / token = k * P(a slot's rank is not the receiving peer on its node)
"""
from __future__ import annotations

from dataclasses import dataclass
from math import comb


@dataclass(frozen=True)
class ExpectedRows:
    """Expected rows per token of one dispatch algorithm (not moekit.comm.all_to_all.Traffic, which counts
    the bytes a run actually sent)."""

    inter_rows: float  # rows per token crossing a node boundary (per direction)
    intra_rows: float  # rows per token between ranks of one node

    def bytes(self, hidden: int, bytes_per_elem: int) -> tuple[float, float]:
        return self.inter_rows * hidden * bytes_per_elem, self.intra_rows * hidden * bytes_per_elem


def _p_none(pool: int, avoid: int, k: int) -> float:
    """P(k distinct draws from ``pool`` items all miss a given set of ``avoid`` items)."""
    return comb(pool - avoid, k) / comb(pool, k) if pool - avoid >= k else 0.0


def flat(num_nodes: int, ranks_per_node: int, num_experts: int, top_k: int,
         node_limit: int | None = None) -> ExpectedRows:
    """One row per slot. Node limiting does not help here: by symmetry a slot still lands on my node
    with probability 1/N, so flat traffic is the same with or without it."""
    N, G, k = num_nodes, ranks_per_node, top_k
    return ExpectedRows(k * (N - 1) / N, k * (G - 1) / (N * G))


def hierarchical(num_nodes: int, ranks_per_node: int, num_experts: int, top_k: int,
                 node_limit: int | None = None) -> ExpectedRows:
    """One row per (token, visited remote node) across nodes. Inside a visited node the row arrives at
    the peer at my position, which forwards one row per slot hosted by another rank of that node
    (moekit dedups across nodes, where links are slow, not across ranks of a node)."""
    N, G, E, k = num_nodes, ranks_per_node, num_experts, top_k
    per_node = E // N
    M = N if node_limit is None else min(node_limit, N)
    pool = M * per_node  # experts a token can choose from
    p_visit = 1 - _p_none(pool, per_node, k)  # a chosen node receives >= 1 of its k experts
    remote_chosen = M * (N - 1) / N  # my node is among the M chosen with probability M/N
    return ExpectedRows(remote_chosen * p_visit, k * (G - 1) / G)
