"""Expert-load tracking: what training logs and tools/heatmap.py read.

Each MoELayer owns an ``ExpertLoad``. In training mode every forward adds its routing counts
(kept slots per expert, slots assigned before dropping, aux-loss terms) as device tensors, so
recording costs no host sync; ``summary()`` syncs once when the trainer logs.

Activation checkpointing re-runs forwards inside backward; those recomputations are not counted
(``in_backward()``), so a step's record is the same with and without checkpointing.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch
from torch import Tensor, nn


def in_backward() -> bool:
    """True while autograd's engine runs a backward pass (e.g. a checkpointed forward recomputing)."""
    return torch._C._current_graph_task_id() != -1


@dataclass
class LoadSummary:
    """Host-side totals since the last reset, for one MoE layer."""

    tokens_per_expert: list[int]  # kept slots per expert (after capacity dropping)
    assigned_per_expert: list[int]  # slots the router chose per expert (before dropping)
    dropped_slots: int
    forwards: int  # training forwards recorded (micro-batches)
    aux_loss: float  # sum over recorded forwards of the coefficient-weighted aux loss
    stats: dict[str, float]  # means over recorded forwards of Routing.stats scalars

    @property
    def total_slots(self) -> int:
        return sum(self.assigned_per_expert)

    @property
    def dropped_fraction(self) -> float:
        return self.dropped_slots / self.total_slots if self.total_slots else 0.0

    @property
    def imbalance(self) -> float:
        """max/mean of kept tokens per expert: 1.0 is perfect balance, E means one expert took all."""
        return imbalance(self.tokens_per_expert)


def imbalance(counts) -> float:
    counts = [float(c) for c in counts]
    mean = sum(counts) / len(counts) if counts else 0.0
    return max(counts) / mean if mean > 0 else 0.0


class ExpertLoad:
    """Accumulates one layer's routing statistics between resets (all tensors stay on device)."""

    def __init__(self, num_experts: int):
        self.num_experts = num_experts
        self.reset()

    def reset(self) -> None:
        self._kept: Tensor | None = None
        self._assigned: Tensor | None = None
        self._aux: Tensor | None = None
        self._stats: dict[str, Tensor] = {}
        self.forwards = 0

    def record(self, routing) -> None:
        """Add one forward's routing. Skipped during backward recomputation (activation checkpointing)."""
        if in_backward():
            return
        kept = routing.tokens_per_expert.detach()
        assigned = routing.stats.get("assigned_per_expert", kept).detach()
        aux = routing.aux_loss.detach().float()
        if self._kept is None:
            self._kept, self._assigned, self._aux = kept.clone(), assigned.clone(), aux.clone()
        else:
            self._kept += kept
            self._assigned += assigned
            self._aux += aux
        for name, value in routing.stats.items():
            if value.dim() == 0:
                v = value.detach().float()
                self._stats[name] = self._stats[name] + v if name in self._stats else v.clone()
        self.forwards += 1

    def summary(self) -> LoadSummary:
        if self._kept is None:
            zeros = [0] * self.num_experts
            return LoadSummary(zeros, list(zeros), 0, 0, 0.0, {})
        # D2H sync: one transfer of the accumulated counts and scalars when the trainer logs
        kept = self._kept.cpu().tolist()
        assigned = self._assigned.cpu().tolist()
        n = self.forwards
        stats = {k: float(v.cpu()) / n for k, v in self._stats.items()}
        return LoadSummary(kept, assigned, sum(assigned) - sum(kept), n, float(self._aux.cpu()), stats)


def moe_layers(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(qualified name, layer) of every ``MoELayer`` in ``model``, in module order."""
    from moekit.moe.layer import MoELayer  # here, not at the top: moe.layer imports this module

    for name, module in model.named_modules():
        if isinstance(module, MoELayer):
            yield name, module


def collect_load(model: nn.Module, reset: bool = True) -> dict[str, LoadSummary]:
    """Summaries of every MoE layer in ``model`` (one sync per layer), optionally resetting them."""
    out = {}
    for name, layer in moe_layers(model):
        out[name] = layer.load.summary()
        if reset:
            layer.load.reset()
    return out
