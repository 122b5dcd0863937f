"""Expert placement: which experts each expert-parallel rank holds, and a load-aware planner for it.

Shape legend: E logical experts (the router's ids), P ranks of the EP group (positions 0..P-1, as in
``topology.members("ep")``), S slots per rank, R = P*S - E redundant slots (replicas), m nodes of G
ranks each in the EP group (positions node-major: node = position // G).

    logical (router ids)            physical (what the ranks hold; physical id = position * S + slot)
    e0 e1 e2 e3 e4 e5 e6 e7         rank 0: [e0 e5 e6]   rank 1: [e1 e2 e5]   rank 2: [e3 e4 e7] ...
                                                 ^^ e5 is replicated: its tokens are split over both copies

A ``Placement`` is that table; the contiguous one (rank p holds p*E/P .. (p+1)*E/P - 1, no replicas) is
what expert parallelism does without one. The EP dispatchers map each routed slot's logical id to one
physical copy (``route_table``: the copies on the source's node when there are any, else all of them,
taken round-robin by token index), so each rank's experts are one contiguous block of physical ids and
the all-to-all is unchanged. Checkpoints stay in logical order (comm.relocate).

``plan_placement(load, ep, ranks_per_node, replicas, num_groups)`` packs the experts of every layer onto
the ranks from a recorded load, EPLB-style:
    1. replicas: the hottest experts (largest load per copy) get the R extra slots, one at a time
    2. nodes (when the EP group spans m > 1 nodes): with group-limited routing (num_groups a multiple of m)
       whole groups go to nodes, balanced, and replicas stay in their group's node (EPLB's hierarchical
       mode: node-limited routing keeps its traffic bound); else each expert's copies are spread over the
       nodes, as evenly as possible, onto the least-loaded ones (a token then finds a copy on its own node
       more often: no inter-node row for it)
    3. ranks: each node's copies onto its G ranks, S each: heaviest first onto the least-loaded rank
       (greedy LPT), then pairwise swaps while they lower the heavier rank
"""
from __future__ import annotations

import heapq
import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FORMAT, VERSION = "moekit-expert-placement", 1


@dataclass(frozen=True)
class Placement:
    """slots[p][s]: the logical expert held in slot s of EP position p (an expert may appear several times)."""

    slots: tuple[tuple[int, ...], ...]
    num_experts: int

    def __post_init__(self):
        slots = tuple(tuple(int(e) for e in row) for row in self.slots)
        object.__setattr__(self, "slots", slots)
        E = self.num_experts
        if not slots or not slots[0] or len({len(r) for r in slots}) != 1:
            raise ValueError(f"an expert placement needs the same positive number of slots on every rank, got "
                             f"{[len(r) for r in slots]}")
        held = {e for row in slots for e in row}
        if any(not 0 <= e < E for e in held):
            raise ValueError(f"expert placement names experts outside 0..{E - 1}: {sorted(e for e in held if not 0 <= e < E)}")
        if len(held) != E:
            raise ValueError(f"expert placement leaves experts {sorted(set(range(E)) - held)} on no rank; every one of "
                             f"the {E} experts needs a slot")

    @classmethod
    def contiguous(cls, num_experts: int, ep: int) -> "Placement":
        """What expert parallelism does without a placement: rank p holds the block p*E/P .. (p+1)*E/P - 1."""
        if num_experts % ep:
            divisors = [d for d in range(1, num_experts + 1) if num_experts % d == 0]
            raise ValueError(f"num_experts={num_experts} is not divisible by ep={ep}; every EP rank holds the same "
                             f"number of experts: use an ep among {divisors}")
        El = num_experts // ep
        return cls(tuple(tuple(range(p * El, (p + 1) * El)) for p in range(ep)), num_experts)

    @property
    def ep(self) -> int:
        return len(self.slots)

    @property
    def slots_per_rank(self) -> int:
        return len(self.slots[0])

    @property
    def num_physical(self) -> int:
        return self.ep * self.slots_per_rank

    @property
    def replicas(self) -> int:
        return self.num_physical - self.num_experts

    @property
    def is_contiguous(self) -> bool:
        return self.replicas == 0 and self == Placement.contiguous(self.num_experts, self.ep)

    def logical(self) -> list[int]:
        """[P*S] the logical expert of every physical id."""
        return [e for row in self.slots for e in row]

    def copies(self) -> list[list[int]]:
        """[E] the physical ids holding each logical expert, ascending (the first is its primary copy)."""
        out: list[list[int]] = [[] for _ in range(self.num_experts)]
        for phys, e in enumerate(self.logical()):
            out[e].append(phys)
        return out

    def primary_mask(self, position: int) -> list[bool]:
        """[S] whether each slot of ``position`` holds its expert's primary copy (counted once in norms)."""
        S, first = self.slots_per_rank, [c[0] for c in self.copies()]
        return [first[e] == position * S + s for s, e in enumerate(self.slots[position])]

    def route_table(self, source: int, nodes: tuple[int, ...] | None = None) -> list[list[int]]:
        """[E] the physical copies that tokens of EP position ``source`` use for each expert: the copies on
        the source's node if there are any (``nodes[p]``: the node of position p), else all of them."""
        S = self.slots_per_rank
        out = []
        for copies in self.copies():
            near = [c for c in copies if nodes is not None and nodes[c // S] == nodes[source]]
            out.append(near or copies)
        return out

    def route_matrix(self, nodes: tuple[int, ...] | None = None) -> np.ndarray:
        """[E, P*S] share of an expert's tokens each physical copy computes, sources spread evenly over ranks
        and split round-robin over their route_table: the planner's model of the dispatchers."""
        M = np.zeros((self.num_experts, self.num_physical))
        for source in range(self.ep):
            for e, copies in enumerate(self.route_table(source, nodes)):
                M[e, copies] += 1.0 / (len(copies) * self.ep)
        return M

    def rank_loads(self, counts, nodes: tuple[int, ...] | None = None) -> np.ndarray:
        """counts [..., E] tokens per expert -> [..., P] predicted rows each rank computes."""
        per_copy = np.asarray(counts, dtype=np.float64) @ self.route_matrix(nodes)  # [..., P*S]
        return per_copy.reshape(*per_copy.shape[:-1], self.ep, self.slots_per_rank).sum(-1)

    def signature(self) -> int:
        """A 31-bit digest of the table: EP peers check they hold the same placement before exchanging."""
        import zlib

        return zlib.crc32(json.dumps([self.num_experts, self.slots]).encode()) & 0x7FFFFFFF


def default_placement(num_experts: int, ep: int, replicas: int = 0) -> Placement:
    """Contiguous blocks, plus ``replicas / ep`` slots per rank holding copies of the next ranks' first
    experts (rank p: experts (p+1)*E/P, (p+1)*E/P + 1, ... mod E): a start before any load is known."""
    base = Placement.contiguous(num_experts, ep)
    if replicas % ep or not 0 <= replicas <= num_experts * (ep - 1):
        raise ValueError(f"replicas={replicas} must be a multiple of ep={ep} in 0..{num_experts * (ep - 1)}")
    El, extra = num_experts // ep, replicas // ep
    return Placement(tuple(row + tuple(((p + 1) * El + j) % num_experts for j in range(extra))
                           for p, row in enumerate(base.slots)), num_experts)


def imbalance(loads: np.ndarray) -> np.ndarray:
    """[..., P] -> [...] max / mean (1 = balanced); 0 where nothing was routed."""
    mean = loads.mean(-1)
    return np.where(mean > 0, loads.max(-1) / np.where(mean > 0, mean, 1.0), 0.0)


# ---------------------------------------------------------------------------------------------------
# Placement files (moekit-placement writes them, --layout.expert_placement reads them)
# ---------------------------------------------------------------------------------------------------


def placement_document(placements: dict[str, Placement], **info) -> dict:
    """The JSON document of {layer name: Placement} (all with the same E, P, S) and ``info``."""
    first = next(iter(placements.values()))
    return {"format": FORMAT, "version": VERSION, "num_experts": first.num_experts, "ep": first.ep,
            "slots_per_rank": first.slots_per_rank, **info,
            "layers": {name: [list(row) for row in p.slots] for name, p in placements.items()}}


def save_placements(path: str | Path, placements: dict[str, Placement], **info) -> None:
    """Write {layer name: Placement} and ``info`` (provenance, predictions) as a placement file (one line
    per layer: its ranks' slots)."""
    doc = placement_document(placements, **info)
    layers = doc.pop("layers")
    head = json.dumps(doc, indent=1)[:-2]  # without the closing "\n}"
    body = ",\n".join(f"  {json.dumps(name)}: {json.dumps(rows)}" for name, rows in layers.items())
    Path(path).write_text(f'{head},\n "layers": {{\n{body}\n }}\n}}\n')


def placements_from_json(doc: dict, where: str = "placement") -> dict[str, Placement]:
    """{layer name: Placement} from a placement document (a file's JSON, or a checkpoint's meta.json entry)."""
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ValueError(f"{where}: not a {FORMAT!r} document (write one with moekit-placement)")
    if doc.get("version") != VERSION:
        raise ValueError(f"{where}: version {doc.get('version')!r}; this moekit reads version {VERSION}")
    try:
        E = int(doc["num_experts"])
        found = {str(name): Placement(tuple(map(tuple, rows)), E) for name, rows in doc["layers"].items()}
    except (KeyError, TypeError, AttributeError, ValueError) as exc:  # ValueError: a non-integer expert id
        raise ValueError(f"{where}: malformed ({type(exc).__name__}: {exc}); write it with moekit-placement") from None
    ranks = {p.ep for p in found.values()}
    if "ep" in doc and ranks != {doc["ep"]}:
        raise ValueError(f"{where}: says ep={doc['ep']!r} but its layers place the experts on {sorted(ranks)} ranks; "
                         f"write it again with moekit-placement")
    return found


def load_placements(path: str | Path) -> tuple[dict[str, Placement], dict]:
    """({layer name: Placement}, the whole document) of a placement file; ValueError naming what is wrong."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: cannot read it as JSON ({exc})") from None
    return placements_from_json(doc, str(path)), doc


# ---------------------------------------------------------------------------------------------------
# The planner
# ---------------------------------------------------------------------------------------------------


def plan_placement(load, ep: int, ranks_per_node: int | None = None, replicas: int = 0,
                   num_groups: int | None = None) -> list[Placement]:
    """One balanced Placement per layer from ``load`` ([steps, L, E], [L, E] or [E] tokens per expert).

    ranks_per_node: EP ranks per node (None or >= ep: one node); replicas: extra slots over the EP group,
    a multiple of ep; num_groups: the router's expert groups (group-limited routing), kept whole on a node.
    """
    w = np.asarray(load, dtype=np.float64)
    w = w.sum(0) if w.ndim == 3 else (w[None] if w.ndim == 1 else w)
    if w.ndim != 2 or (w < 0).any() or not np.isfinite(w).all():
        raise ValueError(f"load must be non-negative token counts [steps, L, E], [L, E] or [E], got shape {w.shape}")
    E = w.shape[1]
    if ep < 1 or E % ep:
        raise ValueError(f"num_experts={E} is not divisible by ep={ep}; every EP rank holds the same number of "
                         f"experts: use an ep among {[d for d in range(1, E + 1) if E % d == 0]}")
    if replicas < 0 or replicas % ep:
        raise ValueError(f"replicas={replicas} must be a non-negative multiple of ep={ep} (every rank gets the "
                         f"same number of slots)")
    G = ep if not ranks_per_node or ranks_per_node >= ep else ranks_per_node
    if ep % G:
        raise ValueError(f"ranks_per_node={ranks_per_node} must divide ep={ep} (the EP group spans whole nodes)")
    if (E + replicas) // ep > E:
        raise ValueError(f"replicas={replicas} gives each rank {(E + replicas) // ep} slots for {E} experts; at most "
                         f"{E * (ep - 1)} replicas (one copy of every expert on every rank)")
    return [_plan_layer(row, ep, G, replicas, num_groups) for row in w]


def _plan_layer(w: np.ndarray, P: int, G: int, R: int, num_groups: int | None) -> Placement:
    E, m = w.size, P // G
    S = (E + R) // P
    total = w.sum()
    w = w + (total * 1e-9 if total > 0 else 1.0)  # unrouted experts still weigh something: ties break by id
    grouped = m > 1 and num_groups and num_groups % m == 0 and E % num_groups == 0
    if grouped and R % m == 0 and R // m <= E // m * (G - 1):  # replicas fit inside their group's node
        size = E // num_groups
        groups = _pack(w.reshape(num_groups, size).sum(1), list(range(num_groups)), m, num_groups // m)
        nodes = []
        for held in groups:
            experts = [g * size + i for g in held for i in range(size)]
            nodes.append(_items(w, experts, R // m, G))
    elif m > 1:
        nodes = _spread(w, _copies(w, list(range(E)), R, P), m, G * S)
    else:
        nodes = [_items(w, list(range(E)), R, P)]
    slots = []
    for node in nodes:
        for b in _pack([c for c, _ in node], [e for _, e in node], G, S):
            slots.append(tuple(sorted(node[i][1] for i in b)))
    return Placement(tuple(slots), E)


def _items(w: np.ndarray, experts: list[int], extra: int, cap: int) -> list[tuple[float, int]]:
    """(load per copy, expert) of every copy after giving ``extra`` replicas to the experts with the largest
    load per copy (at most ``cap`` copies each, one per rank)."""
    copies = _copies(w, experts, extra, cap)
    return [(w[e] / copies[e], e) for e in experts for _ in range(copies[e])]


def _spread(w: np.ndarray, copies: dict[int, int], m: int, capacity: int) -> list[list[tuple[float, int]]]:
    """Every expert's copies onto m nodes of ``capacity`` slots, heaviest expert first, each copy to the node
    with the fewest copies of it, then the least load. A copy's load follows the dispatchers' routing: node j's
    tokens (w/m) go to the c_j copies on node j, those of nodes without a copy to all r copies:
    w/(m c_j) + (nodes without) w/(m r)."""
    free, load = [capacity] * m, [0.0] * m
    out: list[list[tuple[float, int]]] = [[] for _ in range(m)]
    for e in sorted(copies, key=lambda e: (-w[e], e)):
        r, on = copies[e], [0] * m
        for _ in range(r):
            j = min((j for j in range(m) if free[j]), key=lambda j: (on[j], load[j], j))
            on[j] += 1
            free[j] -= 1
        remote = w[e] * on.count(0) / (m * r)  # tokens of the nodes without a copy, per copy
        for j in range(m):
            if on[j]:
                per = w[e] / (m * on[j]) + remote
                out[j] += [(per, e)] * on[j]
                load[j] += per * on[j]
    return out


def _copies(w: np.ndarray, experts: list[int], extra: int, cap: int) -> dict[int, int]:
    """Copies per expert: one each, then ``extra`` more, each to the expert with the largest load per copy
    (at most ``cap`` copies of one expert)."""
    copies = {e: 1 for e in experts}
    heap = [(-w[e], e) for e in experts]
    heapq.heapify(heap)
    for _ in range(extra):
        while True:
            _, e = heapq.heappop(heap)
            if copies[e] < cap:
                break
        copies[e] += 1
        heapq.heappush(heap, (-w[e] / copies[e], e))
    return copies


def _pack(weights, keys: list[int], bins: int, capacity: int) -> list[list[int]]:
    """Indices of ``weights`` into ``bins`` bins of exactly ``capacity`` items, balancing their sums: heaviest
    first onto the lightest bin with room that does not hold the same key (if any does not), then swaps."""
    weights = [float(x) for x in weights]
    assert len(weights) == bins * capacity, (len(weights), bins, capacity)
    out: list[list[int]] = [[] for _ in range(bins)]
    held: list[Counter] = [Counter() for _ in range(bins)]  # keys in each bin
    sums = [0.0] * bins
    for i in sorted(range(len(weights)), key=lambda i: (-weights[i], keys[i], i)):
        room = [b for b in range(bins) if len(out[b]) < capacity]
        fresh = [b for b in room if not held[b][keys[i]]]
        b = min(fresh or room, key=lambda b: (sums[b], len(out[b]), b))
        out[b].append(i)
        held[b][keys[i]] += 1
        sums[b] += weights[i]
    _improve(out, held, sums, weights, keys)
    return out


def _improve(out: list[list[int]], held: list[Counter], sums: list[float], weights: list[float], keys: list[int],
             rounds: int = 200) -> None:
    """Swap an item of the heaviest bin with one of another bin while that lowers the larger of the two sums
    (no swap may bring a key into a bin already holding it)."""
    for _ in range(rounds):
        a = max(range(len(out)), key=lambda b: (sums[b], -b))
        best = None
        for b in range(len(out)):
            for x in out[a] if b != a else ():
                for y in out[b]:
                    d = weights[x] - weights[y]
                    gain = sums[a] - max(sums[a] - d, sums[b] + d)
                    if d <= 0 or gain <= sums[a] * 1e-12 or (best is not None and gain <= best[0]):
                        continue
                    if keys[x] != keys[y] and (held[b][keys[x]] or held[a][keys[y]]):
                        continue
                    best = (gain, b, x, y, d)
        if best is None:
            return
        _, b, x, y, d = best
        out[a][out[a].index(x)], out[b][out[b].index(y)] = y, x
        held[a][keys[x]] -= 1
        held[a][keys[y]] += 1
        held[b][keys[y]] -= 1
        held[b][keys[x]] += 1
        sums[a], sums[b] = sums[a] - d, sums[b] + d
