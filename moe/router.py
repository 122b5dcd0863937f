"""Routers: which experts each token goes to, with what weight, and what gets dropped.

Shape legend: T tokens routed together (one rank's micro-batch), E experts, k slots per token,
H hidden size. All router math is float32 whatever the input dtype.

A router is ``route(logits [T, E]) -> Routing``: a policy over the gate logits alone (plus router
state such as ``expert_bias``). ``forward(x) = route(logits(x))``. Build one by name with
``build_router("topk", H, E, top_k=2, ...)``; register your own with ``@register_router("mine")`` or
pass ``"package.module:ClassName"``.

Capacity (per rank, documented in DESIGN.md): C = min(T, ceil(T * k / E * capacity_factor)).
Slots beyond an expert's capacity are dropped: index -1, weight 0. ``capacity_factor=None`` is dropless.

Contract of a ``Routing`` (what every dispatcher relies on): ``indices`` [T, k] integer, each in [0, E)
or -1 (dropped: nothing computed, weight 0); ``tokens_per_expert`` counts exactly the kept slots;
``capacity`` None promises no -1 at all. moekit's own routers keep it by construction. A router defined
elsewhere (``module:Class``, a subclass) cannot be trusted to, and checking its ids on the host would
cost a device sync, so ``Router.forward`` makes its routing safe on the device instead: an id outside
[0, E), -1 included, becomes a dropped slot (-1, weight 0) that no expert reads or writes; the counts
are recomputed from the ids; ``capacity`` becomes T * k (a bound that always holds, so dispatch keeps
room for drops); ``stats["invalid_fraction"]`` is the share of ids outside [0, E) other than -1, which
``stats["dropped_fraction"]`` includes. Wrong shapes or a non-integer ``indices`` are a ValueError.
"""
from __future__ import annotations

import importlib
import math
import numbers
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moekit.moe.options import check_options, error_text
from moekit.moe.precision import upcast_linear

from moekit.moe.load import in_backward
from moekit.moe.losses import (CountReducer, Sequences, bias_update_step, load_balance_loss, sequence_balance_loss,
                               sequence_counts, sequence_imbalance, z_loss)

DROP_POLICIES = ("probs", "position")
BALANCES = ("batch", "sequence")  # Router(balance=): what the load-balance loss averages over
SCORES = ("softmax", "sigmoid")
# Where top-k routing (TopKRouter and Switch, without expert groups or force_expert) runs as one Triton
# kernel each way (moe.kernels.topk_route) instead of ~35 torch ops: "auto" on CUDA outside torch.compile,
# "always" wherever the kernel can run (also the CPU under TRITON_INTERPRET=1: tests; a kernel that fails
# to build raises), "never" (the torch reference everywhere).
FUSED_ROUTER = "auto"
_FUSED_ROUTER_MODES = ("auto", "always", "never")
_FUSED_BUILD_FAILURE: list[str] = []  # why the kernel could not be built here, once it failed (then: torch)


def _fused_topk_route(logits: Tensor, top_k: int, score: str, normalize: bool, scaling: float, bias: Tensor | None):
    """moe.kernels.topk_route's outputs, or None (one warning) if this machine's Triton cannot build it."""
    from moekit.moe.kernels._common import BUILD_ERRORS, record_build_failure
    from moekit.moe.kernels.topk_route import topk_route

    try:
        return topk_route(logits, top_k, score, normalize, scaling, bias)
    except BUILD_ERRORS as exc:
        if FUSED_ROUTER == "always":
            raise
        record_build_failure(exc, _FUSED_BUILD_FAILURE, "moe.router", "fused top-k kernel", "the torch router runs",
                             "moe.router.FUSED_ROUTER")
        return None


@dataclass
class Routing:
    indices: Tensor  # [T, k] int64 expert id per slot; -1 where capacity dropped the slot
    weights: Tensor  # [T, k] float32 combine weight per slot; 0 where dropped (float64 for float64 input)
    tokens_per_expert: Tensor  # [E] int64, slots kept per expert
    aux_loss: Tensor  # scalar, coefficient-weighted sum of the auxiliary losses
    stats: dict[str, Tensor] = field(default_factory=dict)  # unweighted terms for logging
    # Slots per expert, a Python int a dispatcher can use without a host sync. None promises that no
    # slot was dropped (no -1 in indices); a router that drops must set it (Router.finish does).
    capacity: int | None = None

    def to_dense(self, num_experts: int) -> tuple[Tensor, Tensor]:
        """probs [T, E] float32 (combine weight per chosen expert, else 0), mask [T, E] bool (kept)."""
        kept = (self.indices >= 0) & (self.indices < num_experts)
        col = torch.where(kept, self.indices, num_experts)  # dropped slots land in a spare column
        T = self.indices.shape[0]
        probs = torch.zeros(T, num_experts + 1, dtype=torch.float32, device=self.indices.device)
        probs.scatter_(1, col, torch.where(kept, self.weights.float(), 0.0))
        mask = torch.zeros(T, num_experts + 1, dtype=torch.bool, device=self.indices.device)
        mask.scatter_(1, col, kept)
        return probs[:, :num_experts], mask[:, :num_experts]


# ---------------------------------------------------------------------------------------------------
# Validation helpers: every bad option is a ValueError naming the parameter, its value and the range
# ---------------------------------------------------------------------------------------------------


def check_int(name: str, value, lo: int, hi: int | None = None) -> None:
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= lo and (hi is None or value <= hi)
    if not ok:
        if hi is None:
            allowed = f"an integer >= {lo}"
        elif hi == lo:
            allowed = f"the integer {lo}"
        else:
            allowed = f"an integer in [{lo}, {hi}]"
        raise ValueError(f"{name}={value!r} is invalid; it must be {allowed}")


def check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is invalid; choose one of {list(choices)}")


def check_float(name: str, value, lo: float = 0.0, strict: bool = False) -> None:
    bad = not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value)
    if bad or value < lo or (strict and value == lo):
        op = ">" if strict else ">="
        raise ValueError(f"{name}={value!r} is invalid; it must be a finite number {op} {lo}")


# The dtypes hidden states may have: what the gate, every expert backend and the shared expert compute in
# (routing itself runs in float32, float64 for float64 input). Integer, bool and complex inputs fail deep
# inside torch, or (complex) run and return complex outputs, so they are refused up front.
HIDDEN_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_HIDDEN_DTYPE_NAMES = ", ".join(str(d).removeprefix("torch.") for d in HIDDEN_DTYPES)


def check_hidden_states(who: str, x, hidden_size: int) -> None:
    """Refuse hidden states no layer can compute on, before any op touches them: not a tensor, 0-d, a dtype
    outside HIDDEN_DTYPES, or on the meta device. The caller then checks ``x.shape[-1]``. Type, shape,
    dtype and device only: no host sync, and torch.compile turns them into guards."""
    want = f"a tensor [..., {hidden_size}] (hidden states)"
    if not isinstance(x, Tensor):
        what = type(x).__name__ if type(x).__module__ == "builtins" else f"{type(x).__module__}.{type(x).__qualname__}"
        hint = "; convert it with torch.as_tensor(x)" if hasattr(x, "__array__") or isinstance(x, (list, tuple)) else ""
        raise TypeError(f"{who}: x must be {want}, got a {what}{hint}")
    if x.dim() == 0:
        raise ValueError(f"{who}: x must be {want}, got a 0-d tensor (shape ())")
    if x.dtype not in HIDDEN_DTYPES:
        raise TypeError(f"{who}: x.dtype={x.dtype} is not supported; hidden states must be a floating dtype, "
                        f"one of {_HIDDEN_DTYPE_NAMES}")
    if x.device.type == "meta":
        raise ValueError(f"{who}: x is on the meta device: meta tensors are not supported in forward (routing and the "
                         f"experts read the data); build on meta, then to_empty(device=...) and initialise the "
                         f"weights before running")


def count_experts(indices: Tensor, num_experts: int) -> Tensor:
    """[E] int64 slots per expert, ignoring -1 (and any id outside [0, E)). scatter_add on integers: exact,
    no host sync."""
    flat = indices.reshape(-1)
    flat = torch.where((flat < 0) | (flat >= num_experts), num_experts, flat)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=indices.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    return counts[:num_experts]


def apply_capacity(indices: Tensor, weights: Tensor, capacity: int, num_experts: int, policy: str):
    """Keep at most ``capacity`` slots per expert; return (indices, weights) with the rest dropped.

    policy "probs": an expert keeps its highest-weight slots; "position": its earliest tokens.
    Ties go to the earlier token (stable sort), so results never depend on the sort backend.
    """
    T, k = indices.shape
    chosen = (indices >= 0) & (indices < num_experts)  # an id outside [0, E) is dropped too
    safe = torch.where(chosen, indices, 0)
    selected = torch.zeros(T, num_experts, dtype=torch.bool, device=indices.device)
    selected.scatter_(1, safe, chosen)  # [T, E] token t chose expert e
    if policy == "position":
        rank = selected.long().cumsum(0) - 1  # [T, E] how many earlier tokens chose e
    else:
        priority = torch.full((T, num_experts), -math.inf, device=indices.device)
        priority.scatter_(1, safe, torch.where(chosen, weights.float(), -math.inf))
        order = torch.sort(priority, dim=0, descending=True, stable=True).indices  # [T, E]
        arange = torch.arange(T, device=indices.device)[:, None].expand(T, num_experts)
        rank = torch.empty_like(order).scatter_(0, order, arange)  # [T, E] position in e's queue
    keep_dense = selected & (rank < capacity)  # [T, E]
    keep = keep_dense.gather(1, safe) & chosen  # [T, k]
    return torch.where(keep, indices, -1), torch.where(keep, weights, 0.0)


# ---------------------------------------------------------------------------------------------------
# Base class and registry
# ---------------------------------------------------------------------------------------------------


class Router(nn.Module):
    """Owns the gate ``weight`` [E, H]; subclasses implement ``route(logits, token_ids=None)``.

    ``gate_bias``: the gate also has a ``bias`` [E] (gpt-oss's router: logits = x W^T + b), zero-initialised,
    in the same float32 logits math; off, nothing named ``bias`` is registered (the state dict has ``weight``
    only, and a router subclass keeps the name for itself). It is a learned parameter of the logits, unlike
    the top-k router's ``expert_bias`` buffer (selection only).

    ``count_reducer`` (None = micro-batch balancing) sums per-expert counts over the ranks that form
    the balancing batch; comm/ sets it for expert/data parallelism so the aux loss and the bias
    updates see the global batch. Routers never import torch.distributed themselves.

    ``balance``: "batch" (the default) balances the load over the balancing batch; "sequence" is DeepSeek-V3's
    complementary sequence-wise balance loss (DeepSeek-AI 2024, eqs. 17-20): the same E * sum_i f_i P_i within
    each sequence, averaged over the sequences, so that no single sequence piles onto a few experts. It needs
    to know where the tokens sit among the sequences (``forward(x, sequences=moe.losses.Sequences(offset, S, B))``,
    which MoELayer passes for [B, S, H] input).
    When a sequence's tokens are split over ranks (tensor / sequence / context parallelism) comm/ sets
    ``sequence_reducer`` (sums [B, E] counts over those ranks) and ``sequence_parts`` (their number): each rank's
    loss is then its tokens' share of every sequence's loss, times ``sequence_parts``, so that the layouts'
    gradient averaging gives one process's gradient.
    """

    requires_token_ids = False  # hash routing needs the token ids, not the hidden states

    def __init__(self, hidden_size: int, num_experts: int, *, top_k: int = 1,
                 capacity_factor: float | None = None, drop_policy: str = "probs",
                 aux_loss_coeff: float = 0.0, z_loss_coeff: float = 0.0, gate: bool = True,
                 gate_bias: bool = False, balance: str = "batch"):
        super().__init__()
        check_int("hidden_size", hidden_size, 1)
        if not isinstance(gate_bias, bool):
            raise ValueError(f"gate_bias={gate_bias!r} is invalid; it must be true (logits = x W^T + b) or false")
        if gate_bias and not gate:
            raise ValueError(f"gate_bias=True needs a gate, but the {type(self).__name__} has none (its routing does "
                             f"not use logits); drop gate_bias")
        check_int("num_experts", num_experts, 1)
        check_int("top_k", top_k, 1, num_experts)
        if capacity_factor is not None:
            check_float("capacity_factor", capacity_factor, 0.0, strict=True)
        check_choice("drop_policy", drop_policy, DROP_POLICIES)
        check_float("aux_loss_coeff", aux_loss_coeff)
        check_float("z_loss_coeff", z_loss_coeff)
        check_choice("balance", balance, BALANCES)
        self.balance = balance
        self.hidden_size, self.num_experts, self.top_k = hidden_size, num_experts, top_k
        self.capacity_factor, self.drop_policy = capacity_factor, drop_policy
        self.aux_loss_coeff, self.z_loss_coeff = float(aux_loss_coeff), float(z_loss_coeff)
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size)) if gate else None
        self.gate_bias = gate_bias
        if gate_bias:
            self.bias = nn.Parameter(torch.zeros(num_experts))
        self.count_reducer: CountReducer = None
        self.sequence_reducer: CountReducer = None  # balance "sequence": sums [B, E] over a sequence's ranks
        self.sequence_parts = 1  # how many ranks share each sequence's tokens (comm/ sets both)
        self._sequences: Sequences | None = None  # this forward's tokens among the sequences
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02, generator: torch.Generator | None = None) -> None:
        if self.weight is not None and not self.weight.is_meta:
            with torch.no_grad():
                self.weight.normal_(0.0, std, generator=generator)
        if self.gate_bias and not self.bias.is_meta:
            with torch.no_grad():
                self.bias.zero_()

    def logits(self, x: Tensor) -> Tensor:
        """[T, H] -> [T, E] float32 (float64 for float64 input), outside autocast: routing stays fp32."""
        dtype = torch.float64 if x.dtype == torch.float64 else torch.float32  # never below fp32
        if self.weight is None:
            return x.new_zeros(x.shape[0], self.num_experts, dtype=dtype)
        with torch.autocast(device_type=x.device.type, enabled=False):
            if x.dtype == dtype:
                logits = F.linear(x, self.weight.to(dtype))
            else:
                logits = upcast_linear(x, self.weight, dtype)
            return logits + self.bias.to(dtype) if self.gate_bias else logits


    def capacity(self, num_tokens: int) -> int | None:
        if self.capacity_factor is None:
            return None
        return min(num_tokens, math.ceil(num_tokens * self.top_k / self.num_experts * self.capacity_factor))

    def forward(self, x: Tensor, token_ids: Tensor | None = None,
                sequences: Sequences | None = None) -> Routing:
        """x [..., H] -> Routing of its T tokens; a router outside moekit gets its routing made safe (module
        docstring, "Contract"): override ``route``, not this. ``sequences`` (moe.losses.Sequences): where the
        tokens sit among the micro-batch's sequences, which balance="sequence" needs (class docstring); its
        ``weight`` is the caller's aux-loss weight (MoELayer's ``aux_weight``), which the sequence loss divides
        out: it is each rank's share of whole sequences already, unlike the z-loss, a per-token mean."""
        check_hidden_states(f"router {type(self).__qualname__}", x, self.hidden_size)
        if x.shape[-1] != self.hidden_size:
            raise ValueError(f"router got hidden size {x.shape[-1]} but was built for hidden_size={self.hidden_size}")
        x = x.reshape(-1, self.hidden_size)
        if token_ids is not None:
            token_ids = token_ids.reshape(-1)
            if token_ids.numel() != x.shape[0]:
                raise ValueError(f"token_ids has {token_ids.numel()} entries for {x.shape[0]} tokens")
        elif self.requires_token_ids:
            raise ValueError(f"the {type(self).__name__} needs token ids: call forward(x, token_ids=...)")
        if self.balance == "sequence":
            if sequences is None:
                raise ValueError(f"the {type(self).__name__} balances per sequence (balance='sequence') and needs "
                                 f"each token's sequence: call forward(x, sequences=Sequences(offset, S, B)), as "
                                 f"MoELayer does")
            if not isinstance(sequences, Sequences):
                raise ValueError(f"sequences={sequences!r} must be a moe.losses.Sequences(offset, length, count)")
            sequences.check(x.shape[0])
        self._sequences = sequences if self.balance == "sequence" else None  # read by finish, this forward only
        try:
            routing = self.route(self.logits(x), token_ids)
        finally:
            self._sequences = None
        if type(self) not in _BUILTIN:  # module docstring, "Contract": made safe on the device, no host sync
            routing = self._safe_routing(routing, x.shape[0])
        return routing

    def _safe_routing(self, routing: Routing, num_tokens: int) -> Routing:
        """``routing`` with ids outside [0, E) dropped, counts recomputed, capacity T * k (no host sync)."""
        who = f"router {type(self).__qualname__}"
        if not isinstance(routing, Routing):
            raise ValueError(f"{who}: route() returned {type(routing).__name__}; it must return a moe.router.Routing")
        idx, w = routing.indices, routing.weights
        if not (isinstance(idx, Tensor) and isinstance(w, Tensor)):
            raise ValueError(f"{who}: Routing.indices and .weights must be tensors, got {type(idx).__name__} and "
                             f"{type(w).__name__}")
        if idx.dim() != 2 or idx.shape[0] != num_tokens or w.shape != idx.shape:
            raise ValueError(f"{who}: Routing.indices {tuple(idx.shape)} and .weights {tuple(w.shape)} must both "
                             f"be [T, k] with T={num_tokens} tokens")
        if idx.dtype.is_floating_point or idx.dtype.is_complex or idx.dtype == torch.bool:
            raise ValueError(f"{who}: Routing.indices has dtype {idx.dtype}; expert ids must be an integer tensor")
        if not w.dtype.is_floating_point:
            raise ValueError(f"{who}: Routing.weights has dtype {w.dtype}; combine weights must be floating point")

        def tensor(v) -> Tensor:  # the load records and the aux-loss injection take tensors (a fill: no sync)
            if isinstance(v, Tensor):
                return v
            if isinstance(v, numbers.Real):
                return w.new_full((), float(v), dtype=torch.float32)
            raise ValueError(f"{who}: Routing.aux_loss and the .stats values must be tensors or numbers, got {v!r}")

        aux_in = routing.aux_loss
        if isinstance(aux_in, bool) or (isinstance(aux_in, numbers.Real) and not math.isfinite(aux_in)):
            raise ValueError(f"{who}: Routing.aux_loss={aux_in!r} is invalid; it must be a scalar tensor (or a finite "
                             f"number for a constant loss)")
        if isinstance(aux_in, Tensor) and aux_in.dim() != 0:  # shape only: AuxLossInjector adds it as a scalar
            raise ValueError(f"{who}: Routing.aux_loss has shape {tuple(aux_in.shape)}; it must be a scalar tensor "
                             f"(shape ()): reduce it, e.g. .sum() or .mean()")
        E = self.num_experts
        aux, stats = tensor(aux_in), {k: tensor(v) for k, v in routing.stats.items()}
        assigned = stats.get("assigned_per_expert")
        if assigned is not None and assigned.shape != (E,):
            raise ValueError(f"{who}: stats['assigned_per_expert'] has shape {tuple(assigned.shape)}; it must be "
                             f"[num_experts={E}]")
        kept = (idx >= 0) & (idx < E)
        invalid = (~kept & (idx != -1)).sum() / max(idx.numel(), 1)  # 0-dim device tensor
        stats["invalid_fraction"] = invalid
        stats["dropped_fraction"] = stats.get("dropped_fraction", 0.0) + invalid
        indices = torch.where(kept, idx.long(), -1)
        return Routing(indices, torch.where(kept, w, 0.0), count_experts(indices, E), aux, stats,
                       num_tokens * idx.shape[1])

    def route(self, logits: Tensor, token_ids: Tensor | None = None) -> Routing:
        """The routing policy: logits [T, E] float32 (float64 for float64 input) -> Routing; subclasses implement it."""
        raise NotImplementedError(
            f"router {type(self).__qualname__} does not implement route(): define "
            f"route(self, logits: Tensor, token_ids: Tensor | None = None) -> Routing, the policy over the gate "
            f"logits [T, E={self.num_experts}] (see moe.router.Router and Router.finish for the shared tail)")

    def reduce_counts(self, counts: Tensor) -> Tensor:
        """Counts over the balancing batch (this micro-batch unless comm/ installed a reducer)."""
        return counts if self.count_reducer is None else self.count_reducer(counts)

    def reduce_sequence_counts(self, counts: Tensor) -> Tensor:
        """Per-sequence counts [B, E] over the ranks holding parts of the sequences (balance="sequence")."""
        return counts if self.sequence_reducer is None else self.sequence_reducer(counts)

    def finish(self, logits: Tensor, balance_scores: Tensor, indices: Tensor, weights: Tensor,
               capacity: int | None = None, assigned: Tensor | None = None, lse: Tensor | None = None) -> Routing:
        """Shared tail of top-k-style routers: capacity dropping, counts, aux losses, stats.

        balance_scores [T, E]: each token's score distribution (rows sum to 1) for the balance loss.
        ``assigned`` ([E] slots per expert of ``indices``) and ``lse`` (the logits' per-token logsumexp) are
        passed by routers that already have them (the fused top-k kernel); otherwise computed here.
        """
        E = self.num_experts
        if assigned is None:
            assigned = count_experts(indices, E)  # [E] before dropping
        per_sequence = None
        if self._sequences is not None:  # balance "sequence": [B, E] choices before any dropping
            per_sequence = sequence_counts(indices, self._sequences, E)
            if self.aux_loss_coeff > 0:  # a collective only where the loss is trained (as reduce_counts below)
                per_sequence = self.reduce_sequence_counts(per_sequence)
        kept = assigned  # dropless: every assignment is kept
        if capacity is not None:
            indices, weights = apply_capacity(indices, weights, capacity, E, self.drop_policy)
            kept = count_experts(indices, E)
        balance_counts = self.reduce_counts(assigned) if self.aux_loss_coeff > 0 else assigned
        self.observe_load(balance_counts if self.aux_loss_coeff > 0 else None, assigned)
        # A term whose coefficient is 0 is only logged (stats): computed outside autograd, so backward skips
        # it, and with both at 0 the aux loss is a constant the layer does not inject. Same values either way.
        # (`True if c > 0 else False`: under torch.compile a coefficient may be a symbolic float, after a graph
        # break (observe_load, a reducer) once another model's differed; the branch makes the flag a constant.)
        lb_grad = True if torch.is_grad_enabled() and self.aux_loss_coeff > 0 else False
        z_grad = True if torch.is_grad_enabled() and self.z_loss_coeff > 0 else False
        with torch.set_grad_enabled(lb_grad):
            if per_sequence is None:
                lb = load_balance_loss(balance_scores, balance_counts)
            else:  # DeepSeek-V3's sequence-wise loss (class docstring): this rank's share, times the sharing ranks
                lb = sequence_balance_loss(balance_scores, per_sequence, self._sequences, indices.shape[1])
                lb = lb * self.sequence_parts
        logged = lb.detach()
        if per_sequence is not None and self._sequences.weight != 1.0:
            lb = lb / self._sequences.weight
        with torch.set_grad_enabled(z_grad):
            zl = z_loss(logits) if lse is None or lse.shape[0] == 0 else lse.square().mean()
        # only the terms with a coefficient (each op is a launch on a GPU, where the router is launch-bound)
        terms = [c * t for c, t in ((self.aux_loss_coeff, lb), (self.z_loss_coeff, zl)) if c != 0]
        aux = terms[0] + terms[1] if len(terms) == 2 else terms[0] if terms else lb.new_zeros(())
        total = max(indices.numel(), 1)
        dropped = ((assigned.sum() - kept.sum()).float() / total if capacity is not None
                   else assigned.new_zeros((), dtype=torch.float32))  # dropless: nothing dropped
        stats = {
            "load_balance": logged,
            "z_loss": zl.detach(),
            "dropped_fraction": dropped,
            "assigned_per_expert": assigned,
        }
        if per_sequence is not None:  # how unevenly each sequence loads the experts (logging; 1 = even)
            stats["sequence_imbalance"] = sequence_imbalance(per_sequence)
        return Routing(indices, weights, kept, aux, stats, capacity)

    def observe_load(self, global_counts: Tensor | None, local_counts: Tensor) -> None:
        """Hook for routers with load-dependent state (aux-loss-free bias); a no-op by default."""

    def apply_bias_update(self) -> None:
        """Once per optimizer step: fold the load seen by ``observe_load`` into router state; a no-op by default."""


_ROUTERS: dict[str, type[Router]] = {}
_BUILTIN: set[type[Router]] = set()  # moekit's routers, whose routings keep the contract by construction


def _builtin(cls):
    """Class decorator for moekit's own routers (not inherited: a subclass's routing is checked)."""
    _BUILTIN.add(cls)
    return cls


def register_router(name: str):
    """Class decorator: ``@register_router("mine") class MyRouter(Router): ...``."""

    def deco(cls):
        if not (isinstance(cls, type) and issubclass(cls, Router)):
            raise TypeError(f"register_router({name!r}) needs a Router subclass, got {cls!r}")
        if name in _ROUTERS and _ROUTERS[name] is not cls:
            raise ValueError(f"router name {name!r} is already registered to {_ROUTERS[name].__qualname__}")
        _ROUTERS[name] = cls
        return cls

    return deco


def registered_routers() -> list[str]:
    return sorted(_ROUTERS)


def router_class(name: str) -> type[Router]:
    """Resolve a registered name or ``package.module:ClassName`` to a Router class.

    Whatever goes wrong importing the module (ImportError, a SyntaxError, any exception its code raises,
    even ``sys.exit``) or finding the class is a ValueError naming the spec and the original error."""
    if not isinstance(name, str):
        raise ValueError(f"router={name!r} is invalid; use a registered name {registered_routers()} or "
                         f"'package.module:ClassName'")
    if ":" in name:
        module_name, _, cls_name = name.partition(":")
        try:
            cls = getattr(importlib.import_module(module_name), cls_name)
        except (Exception, SystemExit) as exc:
            raise ValueError(f"router {name!r} could not be loaded ({error_text(exc)}); expected "
                             f"'package.module:ClassName' naming an importable module and a class in it") from exc
        if not (isinstance(cls, type) and issubclass(cls, Router)):
            raise ValueError(f"router {name!r} is not a subclass of moe.router.Router")
        return cls
    if name not in _ROUTERS:
        raise ValueError(
            f"unknown router {name!r}; known routers: {registered_routers()}, or 'package.module:ClassName'"
        )
    return _ROUTERS[name]


def build_router(name: str, hidden_size: int, num_experts: int, **options) -> Router:
    """Build router ``name`` (registered or ``module:Class``) with ``options``, checked first against the
    constructor: unknown names, and values whose type contradicts the parameter's annotation (or, where
    it has none, its default's type: a bool, a number, a string), are ValueErrors naming the router, the
    option, the value and the expected type. An exception other than ValueError from the constructor
    becomes a ValueError naming the router and the original error."""
    cls = router_class(name)
    check_options(f"router {name!r}", cls.__init__, options, skip=("self", "hidden_size", "num_experts"))
    try:
        return cls(hidden_size, num_experts, **options)
    except ValueError:
        raise
    except Exception as exc:
        raise ValueError(f"router {name!r} could not be built ({error_text(exc)})") from exc


# ---------------------------------------------------------------------------------------------------
# Top-k family: Mixtral, Switch, DeepSeek (sigmoid, group-limited, aux-loss-free bias)
# ---------------------------------------------------------------------------------------------------


@_builtin
@register_router("topk")
class TopKRouter(Router):
    """Top-k over softmax or sigmoid scores.

    Mixtral: softmax, normalize. Switch: top_k=1, softmax, no normalize. DeepSeek-V3: sigmoid,
    num_groups/group_top_k, group_score_top=2, expert_bias with bias_update_rate > 0, scaling
    (routed_scaling_factor). Group-limited routing keeps each token's ``group_top_k`` best of ``num_groups``
    expert groups, a group scoring the sum of its best ``group_score_top`` expert scores (default
    top_k // group_top_k; DeepSeek-V3 uses 2).
    ``normalize=None`` renormalises the k weights to sum 1 whenever k > 1.
    ``expert_bias`` (True, or an initial [E] tensor) is added to the scores for *selection only*;
    ``bias_update_rate`` > 0 turns it on and moves it by the observed load each
    ``apply_bias_update()`` (call once per optimizer step; ``moe.update_router_biases(model)``).
    ``force_expert`` (debug option, not for training): every token's first slot goes to this expert
    (the other k-1 are chosen as usual); selection only, the weights stay the real scores. It makes
    one expert, and under expert parallelism one rank, take every token: an imbalance stress test.
    """

    def __init__(self, hidden_size: int, num_experts: int, *, top_k: int = 2, score: str = "softmax",
                 normalize: bool | None = None, num_groups: int | None = None, group_top_k: int | None = None,
                 group_score_top: int | None = None, scaling: float = 1.0, expert_bias: bool | Tensor = False,
                 bias_update_rate: float = 0.0,
                 capacity_factor: float | None = None, drop_policy: str = "probs",
                 aux_loss_coeff: float = 0.01, z_loss_coeff: float = 0.0, force_expert: int | None = None,
                 gate_bias: bool = False, balance: str = "batch"):
        super().__init__(hidden_size, num_experts, top_k=top_k, capacity_factor=capacity_factor,
                         drop_policy=drop_policy, aux_loss_coeff=aux_loss_coeff, z_loss_coeff=z_loss_coeff,
                         gate_bias=gate_bias, balance=balance)
        check_choice("score", score, SCORES)
        if force_expert is not None:
            check_int("force_expert", force_expert, 0, num_experts - 1)
        self.force_expert = force_expert
        check_float("scaling", scaling, 0.0, strict=True)
        check_float("bias_update_rate", bias_update_rate)
        self._check_groups(num_groups, group_top_k, group_score_top)
        self.score, self.scaling, self.bias_update_rate = score, float(scaling), float(bias_update_rate)
        self.normalize = top_k > 1 if normalize is None else bool(normalize)
        self.num_groups, self.group_top_k = num_groups, group_top_k
        # experts summed per group to score it (moekit's default top_k // group_top_k; DeepSeek-V3: 2)
        self.group_score_top = group_score_top or (top_k // group_top_k if group_top_k else None)
        if isinstance(expert_bias, Tensor) or expert_bias or bias_update_rate > 0:
            init = expert_bias if isinstance(expert_bias, Tensor) else torch.zeros(num_experts)
            if init.shape != (num_experts,):
                raise ValueError(f"expert_bias has shape {tuple(init.shape)}; it must be [num_experts={num_experts}]")
            self.register_buffer("expert_bias", init.detach().float().clone())
            self.register_buffer("pending_load", torch.zeros(num_experts), persistent=False)
        else:
            self.expert_bias = None

    def _check_groups(self, num_groups, group_top_k, group_score_top=None) -> None:
        if num_groups is None and group_top_k is None:
            if group_score_top is not None:
                raise ValueError(f"group_score_top={group_score_top!r} scores expert groups: it needs num_groups and "
                                 f"group_top_k (group-limited routing); set them or drop group_score_top")
            return
        if num_groups is None or group_top_k is None:
            raise ValueError(f"num_groups={num_groups!r} and group_top_k={group_top_k!r}: set both or neither")
        E, k = self.num_experts, self.top_k
        check_int("num_groups", num_groups, 1, E)
        if E % num_groups:
            raise ValueError(f"num_groups={num_groups} must divide num_experts={E}")
        check_int("group_top_k", group_top_k, 1, num_groups)
        if group_score_top is not None:
            check_int("group_score_top", group_score_top, 1, E // num_groups)  # experts per group
            if k > group_top_k * (E // num_groups):
                raise ValueError(f"top_k={k} exceeds the {group_top_k * (E // num_groups)} experts of the "
                                 f"group_top_k={group_top_k} groups a token may use; raise group_top_k")
            return
        if k % group_top_k:
            raise ValueError(f"group_top_k={group_top_k} must divide top_k={k} (a group's score sums its "
                             f"top top_k // group_top_k experts)")
        if k // group_top_k > E // num_groups:
            raise ValueError(f"top_k // group_top_k = {k // group_top_k} exceeds the {E // num_groups} experts per "
                             f"group; raise group_top_k or num_groups={num_groups}")

    def scores(self, logits: Tensor) -> Tensor:
        return logits.softmax(dim=-1) if self.score == "softmax" else logits.sigmoid()

    def limit_groups(self, choice: Tensor) -> Tensor:
        """Mask experts outside each token's best ``group_top_k`` groups with -inf."""
        T, E, G = choice.shape[0], self.num_experts, self.num_groups
        per_group = choice.view(T, G, E // G)
        group_score = per_group.topk(self.group_score_top, dim=-1).values.sum(-1)  # [T, G]
        best = group_score.topk(self.group_top_k, dim=-1).indices  # [T, group_top_k]
        allowed = torch.zeros(T, G, dtype=torch.bool, device=choice.device).scatter_(1, best, True)
        return per_group.masked_fill(~allowed[:, :, None], -math.inf).view(T, E)

    def select(self, scores: Tensor) -> Tensor:
        """[T, E] scores -> [T, k] expert ids; bias and groups affect which, never the weights."""
        choice = scores if self.expert_bias is None else scores + self.expert_bias
        if self.force_expert is not None:  # debug: +inf wins every token's first slot (and its group)
            choice = choice.index_fill(1, torch.tensor([self.force_expert], device=choice.device), math.inf)
        if self.num_groups is not None:
            choice = self.limit_groups(choice)
        return choice.topk(self.top_k, dim=-1).indices

    def balance_scores(self, scores: Tensor) -> Tensor:
        """Each token's score distribution for the balance loss: softmax scores as they are, sigmoid scores
        normalised to sum 1."""
        return scores if self.score == "softmax" else scores / scores.sum(-1, keepdim=True).clamp_min(1e-20)

    def fused_route_reason(self, logits: Tensor) -> str:
        """"" when this routing runs as moe.kernels.topk_route (one kernel each way), else why not."""
        mode = FUSED_ROUTER
        if mode not in _FUSED_ROUTER_MODES:
            raise ValueError(f"moe.router.FUSED_ROUTER={mode!r}; use one of {', '.join(_FUSED_ROUTER_MODES)}")
        if mode == "never":
            return "moe.router.FUSED_ROUTER is 'never'"
        if mode == "auto":
            if logits.device.type != "cuda":
                return "FUSED_ROUTER 'auto' fuses on CUDA only"
            if torch.compiler.is_compiling():
                return "under torch.compile the torch steps run (inductor fuses them itself)"
            if _FUSED_BUILD_FAILURE:
                return f"the kernel failed to build here ({_FUSED_BUILD_FAILURE[0]})"
        if self.num_groups is not None or self.force_expert is not None:
            return "group-limited routing and force_expert run in torch"
        cls = type(self)
        if cls.scores is not TopKRouter.scores or cls.select is not TopKRouter.select:
            return f"{cls.__qualname__} overrides scores() or select(): its own code runs"
        try:
            from moekit.moe.kernels.topk_route import why_not_topk_route
        except ImportError as exc:  # no triton on this platform
            return f"moekit.moe.kernels cannot be imported ({exc})"
        return why_not_topk_route(logits, self.top_k, self.score, self.expert_bias)

    def route(self, logits: Tensor, token_ids: Tensor | None = None) -> Routing:
        if FUSED_ROUTER != "never" and not self.fused_route_reason(logits):
            fused = _fused_topk_route(logits, self.top_k, self.score, self.normalize, self.scaling, self.expert_bias)
            if fused is not None:
                indices, weights, scores, lse, assigned = fused
                return self.finish(logits, self.balance_scores(scores), indices, weights, self.capacity(logits.shape[0]),
                                   assigned, lse)
        scores = self.scores(logits)  # [T, E]
        indices = self.select(scores)  # [T, k]
        weights = scores.gather(1, indices)  # [T, k]
        if self.normalize:
            weights = weights / weights.sum(-1, keepdim=True).clamp_min(1e-20)
        weights = weights * self.scaling
        balance = self.balance_scores(scores)
        return self.finish(logits, balance, indices, weights, self.capacity(logits.shape[0]))

    def observe_load(self, global_counts: Tensor | None, local_counts: Tensor) -> None:
        if self.expert_bias is None or self.bias_update_rate == 0 or not self.training or in_backward():
            return
        counts = global_counts if global_counts is not None else self.reduce_counts(local_counts)
        self.pending_load += counts.float()

    @torch.no_grad()
    def apply_bias_update(self) -> None:
        """Apply the load observed since the last call (aux-loss-free balancing), then clear it."""
        if self.expert_bias is None or self.bias_update_rate == 0:
            return
        bias_update_step(self.expert_bias, self.pending_load, self.bias_update_rate)
        self.pending_load.zero_()


@_builtin
@register_router("switch")
class SwitchRouter(TopKRouter):
    """Switch Transformer: top-1 softmax with multiplicative input jitter in training, capacity 1.25."""

    def __init__(self, hidden_size: int, num_experts: int, *, jitter: float = 0.01,
                 capacity_factor: float | None = 1.25, drop_policy: str = "probs",
                 aux_loss_coeff: float = 0.01, z_loss_coeff: float = 0.0, gate_bias: bool = False,
                 balance: str = "batch"):
        super().__init__(hidden_size, num_experts, top_k=1, score="softmax", normalize=False,
                         capacity_factor=capacity_factor, drop_policy=drop_policy,
                         aux_loss_coeff=aux_loss_coeff, z_loss_coeff=z_loss_coeff, gate_bias=gate_bias,
                         balance=balance)
        check_float("jitter", jitter)
        if jitter >= 1:
            raise ValueError(f"jitter={jitter!r} is invalid; it must be in [0, 1)")
        self.jitter = float(jitter)

    def logits(self, x: Tensor) -> Tensor:
        if self.training and self.jitter > 0:
            noise = torch.empty_like(x, dtype=torch.float32).uniform_(1.0 - self.jitter, 1.0 + self.jitter)
            x = x.float() * noise
        return super().logits(x)


# The other built-ins (expert_choice, sinkhorn, hash) register themselves on import.
from moekit.moe import router_variants  # noqa: E402,F401  (import for registration)
