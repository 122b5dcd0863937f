"""One object that knows the whole layout: degrees, rank coordinates, nodes, and every process group.

The only place in moekit that reads RANK / WORLD_SIZE / LOCAL_WORLD_SIZE.

Rank order (tensor parallel innermost, so TP peers share a node; context parallel next, so a sequence's
ranks do too; pipeline outermost):

    rank = (((pp_i * dp + dp_i) * fsdp + fsdp_i) * cp + cp_i) * tp + tp_i

Data-parallel ranks (D = dp * fsdp of them, index d = dp_i * fsdp + fsdp_i) each read their own share of
the global batch; the ``cp`` context-parallel ranks of a data rank split each of its sequences
(comm.context_parallel). For everything but the batch split and attention, the D * cp ranks that hold
different tokens are alike (``Layout.dp_cp``, index t = d * cp + cp_i, Megatron's "dp x cp" group): dense
gradients are averaged over them, load-balance counts summed, and FSDP shards over fsdp x cp (torchtitan's
dp_shard_cp). Expert parallelism folds into them (Megatron's "MoE parallel folding", torchtitan's
ep-inside-dp_shard): consecutive blocks of ``ep`` such ranks form an EP group that together holds all E
experts (E/ep each) and exchanges tokens; ranks at the same position of different EP groups hold the same
experts and reduce those experts' gradients (the expert-data-parallel group, size dp_cp/ep).

    D = 4, cp = 1, ep = 2:   EP groups {d0, d1} {d2, d3}     expert-DP groups {d0, d2} {d1, d3}
    D = 2, cp = 2, ep = 2:   EP groups {t0, t1} {t2, t3}     (t = d * cp + cp_i: a sequence's two halves)

Nodes: ``ranks_per_node`` consecutive ranks share a node (torchrun's LOCAL_WORLD_SIZE, or overridden to
simulate several nodes on one machine). Hierarchical dispatch uses, inside an EP group, the ranks of one
node (intra-node group) and the ranks with the same local position on every node (the "rail").
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

DEGREES = ("pp", "dp", "fsdp", "tp", "ep", "cp")
GROUP_KINDS = ("dp", "ep", "edp", "ep_node", "ep_rail", "tp", "pp", "stage", "cp")


class LayoutError(ValueError):
    """A layout that cannot run; the message names the values and the fix."""


@dataclass(frozen=True)
class Layout:
    """The parallel degrees of a run: moekit's one layout type, validated here and nowhere else.

    The trainer's ``[layout]`` config section (moekit.train.config.LayoutSection) holds what the user asked
    for (dp 0 = infer it, plus knobs such as the pipeline schedule); moekit.train.plan.resolve_layout turns
    those settings into this object with ``infer`` and adds the batch split. Every message names the flag
    (``--dp``, ``--ep``, ...), the value and the fix, so the trainer prints it as it is.
    """

    pp: int = 1
    dp: int = 1  # replicated data parallel
    fsdp: int = 1  # sharded data parallel
    tp: int = 1
    ep: int = 1  # folded inside the dp * fsdp * cp ranks that hold different tokens
    cp: int = 1  # context parallel: ranks that split each sequence (comm.context_parallel)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.fsdp * self.cp * self.tp

    @property
    def data_parallel(self) -> int:
        """D: the ranks that each read their own share of the global batch."""
        return self.dp * self.fsdp

    @property
    def dp_cp(self) -> int:
        """The ranks of a pipeline stage (and TP coordinate) that hold different tokens: D x cp."""
        return self.dp * self.fsdp * self.cp

    @property
    def flags(self) -> str:
        """The degrees as the trainer's flags: '--dp 2 --ep 2 --tp 1 --pp 1 --fsdp 1' (and --cp when used)."""
        names = ("dp", "ep", "tp", "pp", "fsdp") + (("cp",) if self.cp > 1 else ())
        return " ".join(f"--{k} {getattr(self, k)}" for k in names)

    @classmethod
    def infer(cls, world_size: int, pp: int = 1, dp: int | None = None, fsdp: int = 1, tp: int = 1,
              ep: int = 1, num_experts: int | None = None, cp: int = 1) -> "Layout":
        """Fill ``dp`` from the world size when omitted (the rest default to 1), then validate."""
        for name, v in (("--pp", pp), ("--fsdp", fsdp), ("--tp", tp), ("--ep", ep), ("--cp", cp),
                        ("world size", world_size)):
            _positive(name, v)
        if dp is None:
            rest = pp * fsdp * cp * tp
            if world_size % rest:
                names, values = ("pp*fsdp*tp", f"{pp}*{fsdp}*{tp}") if cp == 1 else \
                    ("pp*fsdp*cp*tp", f"{pp}*{fsdp}*{cp}*{tp}")
                raise LayoutError(f"world size {world_size} is not divisible by {names} = {values} = {rest}, so dp "
                                  f"cannot be inferred; launch a multiple of {rest} processes or change the degrees")
            dp = world_size // rest
        layout = cls(pp, dp, fsdp, tp, ep, cp)
        layout.validate(world_size, num_experts)
        return layout

    def validate(self, world_size: int, num_experts: int | None = None) -> None:
        for name in DEGREES:
            _positive(f"--{name}", getattr(self, name))
        if self.world_size != world_size:
            product = "dp*fsdp*tp*pp" if self.cp == 1 else "dp*fsdp*cp*tp*pp"
            raise LayoutError(
                f"layout {self.flags} needs {product} = {self.world_size} processes but the world size is "
                f"{world_size}; launch {self.world_size} processes (torchrun --nproc-per-node) or use degrees "
                f"whose product is {world_size}"
            )
        if self.dp_cp % self.ep:
            fix = "choose an ep that divides it"
            if self.dp_cp < self.ep:  # typically one process launched for an --ep run
                need = self.ep * self.tp * self.pp
                fix = (f"launch at least {need} processes (torchrun --nproc-per-node {need} -m moekit.train ...; "
                       f"--dry-run --world-size {need} plans it in one) or {fix}")
            what = "dp*fsdp" if self.cp == 1 else "dp*fsdp*cp"
            raise LayoutError(f"layout {self.flags}: ep={self.ep} must divide the data-parallel size {what} = "
                              f"{self.dp_cp} (expert parallelism folds inside the data-parallel ranks); "
                              f"{fix}")
        if num_experts is not None and num_experts % self.ep:
            raise LayoutError(f"num_experts={num_experts} is not divisible by ep={self.ep}; choose --ep among "
                              f"{[d for d in range(1, num_experts + 1) if num_experts % d == 0]}")


def _positive(name: str, v) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise LayoutError(f"{name}={v!r} is invalid; it must be a positive integer")


def world_size_from_env() -> int:
    """torchrun's WORLD_SIZE (1 when unset): how many processes this launch has."""
    raw = os.environ.get("WORLD_SIZE", "1")
    try:
        return int(raw)
    except ValueError:
        raise LayoutError(f"WORLD_SIZE={raw!r} is not an integer; launch with torchrun, which sets it") from None


@dataclass(frozen=True)
class Coords:
    pp: int
    dp: int
    fsdp: int
    tp: int
    cp: int = 0


@dataclass
class Topology:
    """Layout + this rank + nodes; ``build()`` creates the process groups (collectively, in fixed order)."""

    layout: Layout
    rank: int
    ranks_per_node: int
    groups: dict[str, object] = field(default_factory=dict, repr=False)

    def __post_init__(self):
        L = self.layout
        if not 0 <= self.rank < L.world_size:
            raise LayoutError(f"rank {self.rank} is outside the world of {L.world_size} ranks")
        _positive("ranks_per_node", self.ranks_per_node)
        if L.world_size % self.ranks_per_node:
            raise LayoutError(f"ranks_per_node={self.ranks_per_node} must divide the world size {L.world_size}")

    @classmethod
    def from_env(cls, layout: Layout, num_experts: int | None = None,
                 ranks_per_node: int | None = None) -> "Topology":
        """Read torchrun's RANK / WORLD_SIZE / LOCAL_WORLD_SIZE (defaults: one process) and validate."""
        world = world_size_from_env()
        rank = int(os.environ.get("RANK", "0"))
        layout.validate(world, num_experts)
        per_node = ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
        return cls(layout, rank, per_node)

    # --- coordinates ------------------------------------------------------------------------------------
    def coords(self, rank: int | None = None) -> Coords:
        r = self.rank if rank is None else rank
        L = self.layout
        tp_i, r = r % L.tp, r // L.tp
        cp_i, r = r % L.cp, r // L.cp
        fsdp_i, r = r % L.fsdp, r // L.fsdp
        dp_i, pp_i = r % L.dp, r // L.dp
        return Coords(pp_i, dp_i, fsdp_i, tp_i, cp_i)

    def rank_of(self, pp: int, dp: int, fsdp: int, tp: int, cp: int = 0) -> int:
        L = self.layout
        return (((pp * L.dp + dp) * L.fsdp + fsdp) * L.cp + cp) * L.tp + tp

    def data_rank(self, rank: int | None = None) -> int:
        """Index among the data-parallel ranks: which share of the global batch this rank reads."""
        c = self.coords(rank)
        return c.dp * self.layout.fsdp + c.fsdp

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    @property
    def num_nodes(self) -> int:
        return self.layout.world_size // self.ranks_per_node

    # --- group membership (pure functions of the layout: testable without processes) ------------------
    def token_rank(self, rank: int | None = None) -> int:
        """Index among the dp x fsdp x cp ranks that hold different tokens: t = data_rank * cp + cp_i."""
        return self.data_rank(rank) * self.layout.cp + self.coords(rank).cp

    def _data_ranks(self, rank: int) -> list[int]:
        """All dp x fsdp x cp ranks with the same pp and tp coordinates as ``rank``, by token index."""
        c, L = self.coords(rank), self.layout
        return [self.rank_of(c.pp, t // (L.fsdp * L.cp), t // L.cp % L.fsdp, c.tp, t % L.cp) for t in range(L.dp_cp)]

    def members(self, kind: str, rank: int | None = None) -> list[int]:
        r = self.rank if rank is None else rank
        ep = self.layout.ep
        data, d = self._data_ranks(r), self.token_rank(r)
        if kind == "dp":  # every data-parallel (and context-parallel) peer: dense gradients, load-balance counts
            return data
        if kind == "ep":  # exchange tokens, together hold all experts
            start = d - d % ep
            return data[start : start + ep]
        if kind == "edp":  # hold the same experts: expert gradients
            return data[d % ep :: ep]
        c, L = self.coords(r), self.layout
        if kind == "tp":  # shard attention heads / dense MLP; split the MoE layer's tokens between them
            return [self.rank_of(c.pp, c.dp, c.fsdp, t, c.cp) for t in range(L.tp)]
        if kind == "cp":  # split each sequence of this data rank; attention gathers keys / values over them
            return [self.rank_of(c.pp, c.dp, c.fsdp, c.tp, i) for i in range(L.cp)]
        if kind == "pp":  # the pipeline this rank is a stage of, stage order
            return [self.rank_of(p, c.dp, c.fsdp, c.tp, c.cp) for p in range(L.pp)]
        if kind == "stage":  # every rank of this pipeline stage: dp x fsdp x cp x tp (MoE token statistics)
            return [g + t - c.tp for g in data for t in range(L.tp)]
        if kind in ("ep_node", "ep_rail"):
            group = self.members("ep", r)
            node = self.node_of(r)
            if kind == "ep_node":
                return [g for g in group if self.node_of(g) == node]
            pos = [g for g in group if self.node_of(g) == node].index(r)
            nodes = sorted({self.node_of(g) for g in group})
            return [[g for g in group if self.node_of(g) == n][pos] for n in nodes]
        raise ValueError(f"unknown group kind {kind!r}")

    def check_hierarchical(self) -> None:
        """Two-level dispatch needs every node of an EP group to hold the same number of its ranks."""
        group = self.members("ep")
        per_node = {}
        for g in group:
            per_node[self.node_of(g)] = per_node.get(self.node_of(g), 0) + 1
        if len(set(per_node.values())) != 1:
            raise LayoutError(f"hierarchical dispatch needs the EP group {group} spread evenly over nodes, got "
                              f"ranks per node {per_node}; make ep a multiple of ranks_per_node={self.ranks_per_node} "
                              f"or use flat dispatch")

    # --- process groups -------------------------------------------------------------------------------
    def build(self, timeout: timedelta | None = None, device_type: str = "cpu") -> "Topology":
        """Create every process group once, on every rank in the same order (a collective requirement).

        ``timeout``: how long a collective on these groups may wait before it raises. torch gives new
        groups its 30-minute default, not init_process_group's timeout, so the trainer passes its own.
        """
        if not dist.is_initialized():
            raise RuntimeError("Topology.build() needs torch.distributed initialised (init_process_group)")
        if dist.get_world_size() != self.layout.world_size:
            raise LayoutError(f"process group has {dist.get_world_size()} ranks, layout {self.layout.world_size}")
        for kind in GROUP_KINDS:
            seen = set()
            for r in range(self.layout.world_size):  # every rank creates every group, in order
                ranks = tuple(self.members(kind, r))
                if ranks in seen:
                    continue
                seen.add(ranks)
                pg = dist.new_group(list(ranks), timeout=timeout)
                if self.rank in ranks:
                    self.groups[kind] = pg
        self.meshes = self._device_meshes(device_type)
        if timeout is not None:  # init_device_mesh gives its dimension groups torch's 30-minute default,
            # whatever init_process_group was given; DTensor, FSDP and TP collectives run on them
            # (a dimension spanning the whole world may reuse the default group: its timeout is the caller's)
            from torch.distributed.distributed_c10d import _get_default_group, _set_pg_timeout

            default = _get_default_group()
            for mesh in self.meshes.values():
                for dim in range(mesh.ndim):
                    if mesh.get_group(dim) is not default:
                        _set_pg_timeout(timeout, mesh.get_group(dim))
        return self

    def _device_meshes(self, device_type: str) -> dict:
        """DeviceMeshes for DTensor / fully_shard / pipelining, in rank order (see the module docstring).

            "world":   (pp, dp, fsdp x cp, tp)     dense parameters: TP shards, FSDP (HSDP) shards; the "fsdp"
                                                   dimension spans a data rank's cp ranks too (they hold the
                                                   same parameters: FSDP shards over them, as torchtitan's
                                                   dp_shard_cp), which their consecutive rank order allows
            "experts": (pp, edp, ep, tp)           the dp x fsdp x cp ranks regrouped: ep consecutive ones hold
                                                   all experts, edp of them hold the same ones
        """
        from torch.distributed.device_mesh import init_device_mesh

        L = self.layout
        world = init_device_mesh(device_type, (L.pp, L.dp, L.fsdp * L.cp, L.tp),
                                 mesh_dim_names=("pp", "dp", "fsdp", "tp"))
        experts = init_device_mesh(device_type, (L.pp, L.dp_cp // L.ep, L.ep, L.tp),
                                   mesh_dim_names=("pp", "edp", "ep", "tp"))
        return {"world": world, "experts": experts}

    def mesh(self, name: str = "world"):
        if not getattr(self, "meshes", None):
            raise RuntimeError("device meshes do not exist yet: call Topology.build() first")
        return self.meshes[name]

    def group(self, kind: str):
        if kind not in self.groups:
            raise RuntimeError(f"process group {kind!r} does not exist yet: call Topology.build() first")
        return self.groups[kind]
