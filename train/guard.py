"""Reliability guards of the training loop: non-finite steps (stop or skip, agreed by every rank, with
the MoE layer that produced them), out-of-memory in an expert named, determinism, and a NaN debug hook.

Where a non-finite value came from, at no cost on the happy path:

    forward hooks (device-side flags, no host sync)         flags [L, 3] bool, reset every step
      router pre-hook    input x of MoE layer i             col 0: non-finite input
      router hook        Routing.weights (from the logits)  col 1: non-finite router output
      experts hook       expert output rows                 col 2: non-finite expert output
    only when a rank sees a non-finite loss or gradient norm (rare): flags + per-layer gradient checks +
    a check of the parameters themselves, OR-reduced over every rank; named: the parameters if they are
    non-finite or blown up (|w| >= 1e6: an update with far too large a learning rate), else the first MoE
    layer with a forward flag, else the deepest with a non-finite router or expert gradient (backward runs
    from the last layer to the first).

Rows are indexed by the GLOBAL MoE-layer index i (module order of the whole single-process model, L rows on
every rank): a pipeline rank holds only its stages' layers and fills their rows, so the OR-reduce has the
same shape everywhere and row i is always the layer named ``names[i]`` (e.g. ``layers.3.ffn``). A model
holding part of a larger one lists the whole model's MoE layers in ``moe_layer_names``
(models.pipeline.PipelineModel does).

An expert output flag on rank r can come from rows another rank sent (expert parallelism), but that
rank flagged the same layer's input, so the OR over ranks blames the input, not the experts.

Debug hook (tests, drills): MOEKIT_DEBUG_NAN="STEP:LAYER:WHERE[:RANK]" poisons MoE layer LAYER (global,
0-based, module order of the whole model; under pipeline parallelism too) at optimizer step STEP on global
rank RANK (default: the lowest rank holding that layer): WHERE "router" makes that router's combine
weights NaN in the forward, "grad" makes its weight gradient NaN in the backward, "spike" multiplies that
gradient by SPIKE_SCALE (a finite gradient-norm spike, for --train.spike_skip: moekit.train.spikes).
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from moekit.moe import moe_layers
from moekit.train import UserError

# A run that skips this many steps in a row is not training any more: stop and say so.
MAX_CONSECUTIVE_SKIPS = 10
POISON_ENV = "MOEKIT_DEBUG_NAN"
POISON_WHERE = ("router", "grad", "spike")
SPIKE_SCALE = 1000.0  # the "spike" drill: that router's weight gradient times this (finite: a gradient-norm spike)
INPUT, ROUTER, EXPERTS = 0, 1, 2
_FORWARD = ("input (non-finite before this layer)", "router output (forward)", "expert output (forward)")
_BACKWARD = ("router weight gradient (backward)", "expert weight gradient (backward)")
# |parameter| >= 10**BLOWN_UP_EXP is far beyond any trained weight: AdamW moves each weight by about lr per
# step, so it is what a far too large learning rate leaves, and the forward's products overflow from it
BLOWN_UP_EXP = 6
_MAGNITUDES = 39  # thermometer of |w| >= 10**k, k = 0 .. 38 (float32 ends at 3.4e38)


@dataclass(frozen=True)
class NonFinite:
    """One step's non-finite event, identical on every rank."""

    what: str  # "loss" or "gradient norm"
    value: float
    where: str  # e.g. "MoE layer layers.1.ffn: router output (forward)", or why none was found; a spike: how far
    action: str  # "stop" or "skip"
    kind: str = "nonfinite"  # or "spike" (--train.spike_skip: finite, far above the recent steps)

    def record(self, step: int, lr: float) -> dict:
        """The metrics.jsonl line of a skipped step (JSON has no NaN: non-finite values are null). It keeps
        the keys every step line has (DESIGN.md: step, loss, aux_loss, tokens_per_s, lr)."""
        loss = _json_float(self.value) if self.what == "loss" else None
        return {"step": step, "loss": loss, "aux_loss": None, "tokens_per_s": 0.0, "lr": lr, "skipped": True,
                self.kind: self.what, "value": _json_float(self.value), "where": self.where}

    def describe(self) -> str:
        """"non-finite loss (nan)", "loss spike (12.3)"."""
        return (f"{self.what} spike ({self.value:.4g})" if self.kind == "spike"
                else f"non-finite {self.what} ({self.value})")


def _json_float(v: float) -> float | None:
    return v if math.isfinite(v) else None


@dataclass(frozen=True)
class Poison:
    step: int
    layer: int  # global MoE-layer index
    where: str
    rank: int | None  # None: the lowest rank holding the layer


def parse_poison(raw: str | None, num_layers: int) -> Poison | None:
    """MOEKIT_DEBUG_NAN="STEP:LAYER:WHERE[:RANK]" -> Poison; a malformed value is a one-line UserError.
    ``num_layers``: MoE layers of the whole model (LAYER is a global index)."""
    if not raw:
        return None
    parts = raw.split(":")
    try:
        step, layer, where = int(parts[0]), int(parts[1]), parts[2]
        rank = int(parts[3]) if len(parts) == 4 else None
        ok = (len(parts) in (3, 4) and step >= 1 and 0 <= layer < num_layers and where in POISON_WHERE
              and (rank is None or rank >= 0))
    except (ValueError, IndexError):
        ok = False
    if not ok:
        raise UserError(f"{POISON_ENV}={raw!r} is invalid; use STEP:LAYER:WHERE[:RANK] with STEP >= 1, LAYER in "
                        f"[0, {num_layers}) (MoE layers), WHERE one of {list(POISON_WHERE)}, e.g. 3:0:grad:1")
    return Poison(step, layer, where, rank)


class Guard:
    """Per-step checks the loop calls: ``begin_step``, ``check`` (collective), ``discard_step``."""

    def __init__(self, model: nn.Module, dist, on_nonfinite: str):
        self.model, self.dist, self.on_nonfinite = model, dist, on_nonfinite
        local = dict(moe_layers(model))  # this rank's MoE layers: every one in one process
        self.names: tuple[str, ...] = tuple(getattr(model, "moe_layer_names", None) or local)  # global order
        unknown = sorted(set(local) - set(self.names))
        assert not unknown, f"MoE layers {unknown} are missing from the model's moe_layer_names"
        # global index -> this rank's layer, in module order
        self.layers: dict[int, nn.Module] = {i: local[n] for i, n in enumerate(self.names) if n in local}
        device = next(model.parameters()).device
        self.flags = torch.zeros(len(self.names), 3, dtype=torch.bool, device=device)  # rows: global index
        self.in_experts: tuple[int, Tensor, int] | None = None  # (layer, counts, rows) during an expert forward
        self.consecutive_skips = 0
        self.updated = False  # an optimizer step has run in this process (a bad parameter is its doing)
        self.poison = self._resolve_poison(parse_poison(os.environ.get(POISON_ENV), len(self.names)))
        self._poison_handles: list = []
        for i, layer in self.layers.items():
            self._probe(i, layer)

    def _resolve_poison(self, p: Poison | None) -> Poison | None:
        """Under pipeline parallelism not every rank holds LAYER: pick the default rank among those that do,
        and refuse a RANK that does not (collective, only when the drill is set; every rank raises alike)."""
        if p is None:
            return None
        held = torch.zeros(len(self.names), self.dist.world, dtype=torch.bool, device=self.flags.device)
        held[list(self.layers), self.dist.rank] = True
        holders = self.dist.any_flags(held)[p.layer].nonzero().flatten().tolist()
        if p.rank is None:
            return dataclasses.replace(p, rank=holders[0])
        if p.rank not in holders:
            raise UserError(f"{POISON_ENV}: rank {p.rank} does not hold MoE layer {p.layer} "
                            f"({self.names[p.layer]}); ranks holding it: {holders}")
        return p

    # -- forward probes -----------------------------------------------------------------------------

    def _flag(self, i: int, col: int, t: Tensor) -> None:
        self.flags[i, col] |= ~torch.isfinite(t.detach()).all()  # device op: no host sync

    def _probe(self, i: int, layer: nn.Module) -> None:
        layer.router.register_forward_pre_hook(lambda m, args: self._flag(i, INPUT, args[0]))
        layer.router.register_forward_hook(lambda m, args, out: self._flag(i, ROUTER, out.weights))

        def enter(m, args):
            self.in_experts = (i, args[1], args[0].shape[0])  # counts [E_local], rows: names an OOM

        def leave(m, args, out):
            self.in_experts = None
            self._flag(i, EXPERTS, out)

        layer.experts.register_forward_pre_hook(enter)
        layer.experts.register_forward_hook(leave)

    # -- per step -----------------------------------------------------------------------------------

    def begin_step(self, step: int) -> None:
        self.flags.zero_()
        p = self.poison
        if p is None or p.step != step or p.rank != self.dist.rank:
            return
        router = self.layers[p.layer].router  # resolved: this rank holds the layer
        if p.where == "grad":
            self._poison_handles.append(router.weight.register_hook(lambda g: torch.full_like(g, math.nan)))
        elif p.where == "spike":
            self._poison_handles.append(router.weight.register_hook(lambda g: g * SPIKE_SCALE))
        else:  # prepend: the probe hook must see the poisoned output, as it would see a real bad router
            nan_weights = lambda m, args, out: dataclasses.replace(out, weights=out.weights * math.nan)  # noqa: E731
            self._poison_handles.append(router.register_forward_hook(nan_weights, prepend=True))

    def check(self, step: int, loss: float, grad_norm: float,
              spike: tuple[str, float, str] | None = None) -> NonFinite | None:
        """None if the step is good on every rank; else the event, the same on all (collective). ``spike``: this
        rank's loss-spike verdict (moekit.train.spikes: what, value, how far), skipped on every rank when any
        rank has one."""
        for h in self._poison_handles:
            h.remove()
        self._poison_handles.clear()
        what = [name for name, v in (("loss", loss), ("gradient norm", grad_norm)) if not math.isfinite(v)]
        if not self.dist.any_nonfinite(loss, grad_norm, spike=spike is not None):
            if self.dist.spike_any:
                self.consecutive_skips += 1
                action = "skip" if self.consecutive_skips < MAX_CONSECUTIVE_SKIPS else "stop"
                name, value, how = spike or ("loss", loss, "on another rank")  # all-reduced values agree: rare
                return NonFinite(name, value, how, action, kind="spike")
            self.consecutive_skips = 0
            self.updated = True  # the loop steps the optimizer next
            return None
        name = what[0] if what else "loss"  # another rank's value: all-reduced means agree, so rarely reached
        value = loss if name == "loss" else grad_norm
        self.consecutive_skips += 1
        action = self.on_nonfinite
        if action == "skip" and self.consecutive_skips >= MAX_CONSECUTIVE_SKIPS:
            action = "stop"
        return NonFinite(name, value, self.locate(name == "loss"), action)

    def locate(self, loss_bad: bool) -> str:
        """Where the non-finite values started, over every rank (collective; runs only on a bad step).

        Parameters that are non-finite or blown up (AdamW with far too large a learning rate) spoil
        everything computed from them: they come first. Forward: the first MoE layer whose input, router
        or experts went non-finite; later layers only inherit it. Backward runs the other way, so a
        gradient that went non-finite inside the model reaches every earlier layer: the deepest MoE layer
        with one is where it started.
        """
        grads = torch.zeros(len(self.names), 2, dtype=torch.bool, device=self.flags.device)
        for i, layer in self.layers.items():
            grads[i, 0] = _nonfinite_grad(list(layer.router.parameters()))  # the gate (+ its bias)
            grads[i, 1] = _nonfinite_grad([getattr(layer.experts, n) for n in layer.experts.param_names()])
        flags = torch.cat([self.flags, grads], dim=1).flatten()  # [L * 5]: the same shape on every rank
        agreed = self.dist.any_flags(torch.cat([flags, self._param_flags()])).tolist()  # D2H sync: diagnosis only
        rows = [agreed[5 * i : 5 * i + 5] for i in range(len(self.names))]
        nonfinite, magnitude = agreed[-_MAGNITUDES - 1], sum(agreed[-_MAGNITUDES:]) - 1  # log10 of max |w|
        if nonfinite or magnitude >= BLOWN_UP_EXP:
            what = "non-finite" if nonfinite else f"blown up (|w| up to ~1e{magnitude})"
            when = ("after the last optimizer step (learning rate too large)" if self.updated else
                    "before any update of this run (the initial or loaded weights)")
            return f"the parameters themselves: {what} {when}"
        for name, row in zip(self.names, rows):
            if any(row[:3]):
                return f"MoE layer {name}: {_FORWARD[row.index(True)]}"
        if loss_bad:
            return "the loss, with finite MoE layer outputs (attention, embeddings or the output head)"
        for name, row in reversed(list(zip(self.names, rows))):
            if any(row[3:]):
                return f"MoE layer {name}: {_BACKWARD[row[3:].index(True)]}"
        return "no MoE router or expert gradient (attention, norm or embedding gradients)"

    def _param_flags(self) -> Tensor:
        """[1 + _MAGNITUDES] bool, device-side: some parameter of this rank is non-finite; then the
        thermometer max |w| >= 10**k of the finite ones (OR over ranks: the global maximum's)."""
        device = self.flags.device
        nonfinite, largest = torch.zeros((), dtype=torch.bool, device=device), torch.zeros((), device=device)
        for p in self.model.parameters():
            t = _local(p.detach())
            if t.numel() == 0 or not t.is_floating_point():
                continue
            nonfinite |= ~torch.isfinite(t).all()
            largest = torch.maximum(largest, t.abs().float().nan_to_num(0.0, 0.0, 0.0).amax())
        powers = torch.logspace(0, _MAGNITUDES - 1, _MAGNITUDES, dtype=torch.float64, device=device)
        return torch.cat([nonfinite[None], largest.double() >= powers])

    def discard_step(self, model: nn.Module, optimizer) -> None:
        """A skipped step leaves no trace: no gradients, no router-load or bias update from its batch."""
        optimizer.zero_grad(set_to_none=True)
        for layer in self.layers.values():
            layer.load.reset()
            pending = getattr(layer.router, "pending_load", None)
            if pending is not None:
                pending.zero_()

    # -- out of memory ------------------------------------------------------------------------------

    def explain_oom(self, exc: BaseException) -> None:
        """Re-raise an out-of-memory inside an expert computation as a one-line UserError naming it."""
        oom = isinstance(exc, torch.OutOfMemoryError) or (isinstance(exc, RuntimeError) and "out of memory" in str(exc))
        if not oom or self.in_experts is None:
            return
        i, counts, rows = self.in_experts
        self.in_experts = None
        name, layer = self.names[i], self.layers[i]
        per_expert = counts.cpu().tolist()  # D2H sync: error path only
        local = max(range(len(per_expert)), key=per_expert.__getitem__)
        # the logical expert of each local slot: under an expert placement the slots are any experts
        ids = getattr(layer.dispatcher, "local_expert_ids", None)
        expert = ids[local] if ids is not None else layer.dispatcher.expert_range[0] + local
        raise UserError(
            f"out of memory in MoE layer {name}: expert {expert} got {per_expert[local]:,} rows "
            f"({rows:,} rows on this rank's {len(per_expert)} experts). Dropless routing sends every token its "
            f"router picks: set --capacity-factor (e.g. 1.25), lower --batch-size or --train.micro_batch_size, "
            f"or raise --ep") from None


def _nonfinite_grad(params) -> Tensor:
    # device-side; this rank's shard of a DTensor gradient (a non-finite value anywhere shows on some rank:
    # flags are OR-ed)
    bad = [~torch.isfinite(_local(p.grad)).all() for p in params if p.grad is not None]
    return torch.stack(bad).any() if bad else torch.zeros((), dtype=torch.bool)


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


# ---------------------------------------------------------------------------------------------------
# Determinism
# ---------------------------------------------------------------------------------------------------


def set_deterministic(on: bool, device: torch.device):
    """Deterministic kernels for --train.deterministic; returns a function restoring the previous state.

    CPU runs are already bitwise reproducible. On CUDA, torch then raises on ops without a deterministic
    kernel (index_add_ / scatter_add_ on floats among them) instead of silently varying; moe/'s dispatch
    gathers only and the Triton grouped GEMM has no atomics (docs/kernels.md), so the MoE path runs.
    """
    if not on:
        return lambda: None
    before = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
              torch.backends.cudnn.benchmark)
    if device.type == "cuda":
        # cuBLAS picks reduction splits by workspace; a fixed config makes GEMMs reproducible (CUDA >= 10.2).
        # Must be set before the first cuBLAS handle: the trainer calls this before building the model.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False

    def restore() -> None:
        torch.use_deterministic_algorithms(before[0])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[1], before[2]

    return restore
