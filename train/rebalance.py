"""The trainer's expert placement (comm.placement): where a run starts, and rebalancing it every N steps.

    --layout.expert_placement FILE   start from a placement file (moekit-placement writes them)
    --layout.expert_replicas R       R redundant expert slots over the EP group, R/ep per rank (without a
                                     file: copies of the next ranks' first experts until a rebalance)
    --layout.rebalance_every N       every N steps: plan from the expert load summed over the last N steps
                                     (comm.placement.plan_placement: node-aware, the same slots per rank)
                                     and move the expert weights and AdamW moments there (comm.relocate)

A checkpoint records the placement in force and the load summed since the last rebalance (meta.json
"placement"); a rebalancing run resumes with both, so a resume after a rebalance does bitwise what the
uninterrupted run does. Any other run resumes with its configured placement, whatever the checkpoint's:
checkpoints hold the experts in logical order (comm.relocate), so any placement, ep or one process loads them.
"""
from __future__ import annotations

import numpy as np

from moekit.comm.placement import (Placement, default_placement, imbalance, load_placements, placements_from_json,
                                   placement_document, plan_placement)
from moekit.comm.relocate import rebalance
from moekit.train import UserError


def ep_ranks_per_node(topology) -> int | None:
    """EP ranks per node when the EP group spans several nodes (the planner's node size), else None."""
    group = topology.members("ep")
    nodes = {topology.node_of(r) for r in group}
    return len(group) // len(nodes) if len(nodes) > 1 else None


class RunPlacement:
    """The placements of this run's MoE layers ({name: Placement}, None = contiguous blocks everywhere) and
    the rebalancer's load window; built before the model is parallelised (the recipe takes ``placements``)."""

    def __init__(self, cfg, topology, names: list[str], saved: dict | None = None):
        L, E = cfg.layout, cfg.model.num_experts
        self.names, self.every, self.ep = list(names), L.rebalance_every, L.ep
        self.ranks_per_node = ep_ranks_per_node(topology)
        self.num_groups = cfg.model.router_options.get("num_groups")
        self.placements: dict[str, Placement] | None = None
        self.window = {n: np.zeros(E, dtype=np.int64) for n in self.names}
        self.last_note = ""
        if L.expert_placement:
            self.placements = self._from_file(L.expert_placement, E, L.expert_replicas)
        elif L.expert_replicas:
            self.placements = {n: default_placement(E, L.ep, L.expert_replicas) for n in self.names}
        if self.every and saved is not None:
            self._resume(saved, E)
        self.replicas = next(iter(self.placements.values())).replicas if self.placements else 0

    @classmethod
    def for_run(cls, cfg, topology, model, resume_from=None) -> "RunPlacement":
        """The placement of a trainer's run: ``model`` is the whole model (the meta-device one will do),
        ``resume_from`` the checkpoint it resumes (its recorded placement), if any."""
        from moekit.moe.load import moe_layers
        from moekit.train.checkpoint import read_placement

        saved = read_placement(resume_from) if resume_from is not None else None
        return cls(cfg, topology, [name for name, _ in moe_layers(model)], saved)

    def _from_file(self, path: str, E: int, replicas: int) -> dict[str, Placement]:
        try:
            found, _ = load_placements(path)
        except ValueError as exc:
            raise UserError(f"--layout.expert_placement {exc}") from None
        where = f"--layout.expert_placement {path}"
        if set(found) != set(self.names):
            raise UserError(f"{where}: it places layers {sorted(found)} but the model's MoE layers are {self.names}; "
                            f"plan it from a run of this model (moekit-placement RUN_DIR --ep {self.ep})")
        p = found[self.names[0]]
        if (p.num_experts, p.ep) != (E, self.ep):
            raise UserError(f"{where}: planned for {p.num_experts} experts over ep={p.ep}, this run has "
                            f"{E} experts over --ep {self.ep}; plan it again with --ep {self.ep}")
        if any(q.slots_per_rank != p.slots_per_rank for q in found.values()):
            raise UserError(f"{where}: its layers have different numbers of slots per rank; every layer needs the same")
        if replicas and p.replicas != replicas:
            raise UserError(f"{where}: has {p.replicas} redundant slots but --layout.expert_replicas is {replicas}; "
                            f"leave the flag out (the file decides) or plan the file with --replicas {replicas}")
        return found

    def _resume(self, saved: dict, E: int) -> None:
        """A rebalancing run continues with the checkpoint's placement and load window (if they fit this run)."""
        try:
            found = placements_from_json(saved, "checkpoint placement")
        except ValueError:
            return
        p = next(iter(found.values()), None)
        slots = (next(iter(self.placements.values())).slots_per_rank if self.placements else E // self.ep)
        if set(found) != set(self.names) or p is None or (p.ep, p.num_experts, p.slots_per_rank) != (self.ep, E, slots):
            return  # another layout: start from the configured placement
        self.placements = found
        for name, counts in (saved.get("rebalance_window") or {}).items():
            if name in self.window and len(counts) == E:
                self.window[name] = np.asarray(counts, dtype=np.int64)

    def observe(self, step: int, load: dict, model, optimizer) -> bool:
        """After step ``step``'s optimizer update, with its global expert load ({layer name: LoadSummary},
        every layer on every rank): add it to the window; every ``rebalance_every`` steps plan from the
        window and move the experts (collective). Returns whether it rebalanced (``last_note`` says how)."""
        if not self.every:
            return False
        for name in self.names:
            if name in load:
                self.window[name] += np.asarray(load[name].tokens_per_expert, dtype=np.int64)
        if step % self.every:
            return False
        counts = np.stack([self.window[n] for n in self.names])  # [L, E]
        planned = plan_placement(counts, self.ep, self.ranks_per_node, self.replicas, self.num_groups)
        contiguous, before = self._imbalance(counts, None), self._imbalance(counts, self.placements)
        self.placements = dict(zip(self.names, planned))
        rebalance(model, optimizer, self.placements)
        after = self._imbalance(counts, self.placements)
        self.last_note = (f"step={step} rebalanced the experts from the load of steps {step - self.every + 1}-{step}: "
                          f"max/mean tokens per rank on them {before:.3f} -> {after:.3f} (contiguous blocks: "
                          f"{contiguous:.3f}; mean over MoE layers)")
        for name in self.names:
            self.window[name][:] = 0
        return True

    def _imbalance(self, counts: np.ndarray, placements: dict[str, Placement] | None) -> float:
        E = counts.shape[1]
        loads = [(placements or {}).get(n, Placement.contiguous(E, self.ep)).rank_loads(c, self._nodes())
                 for n, c in zip(self.names, counts)]
        return float(np.mean([imbalance(x) for x in loads]))

    def _nodes(self) -> tuple[int, ...] | None:
        G = self.ranks_per_node
        return None if G is None else tuple(p // G for p in range(self.ep))

    def record(self) -> dict | None:
        """meta.json's "placement" for a checkpoint (None when every layer has contiguous blocks and nothing
        is rebalanced)."""
        if self.placements is None and not self.every:
            return None
        E = len(next(iter(self.window.values()))) if self.window else 0
        placements = self.placements or {n: Placement.contiguous(E, self.ep) for n in self.names}
        extra = {"rebalance_every": self.every,
                 "rebalance_window": {n: w.tolist() for n, w in self.window.items()}} if self.every else {}
        return placement_document(placements, **extra)

    def describe(self) -> str:
        if self.placements is None and not self.every:
            return ""
        p = next(iter(self.placements.values())) if self.placements else None
        what = (f"{p.slots_per_rank} expert slots per rank ({p.replicas} redundant)" if p else
                "contiguous expert blocks")
        again = f", rebalanced every {self.every} steps" if self.every else ""
        return f"expert placement: {what}{again}"
