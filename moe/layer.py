"""MoELayer: router -> dispatcher -> grouped experts -> combine (+ optional shared expert).

Shape legend: B batch, S sequence, T = B*S tokens, H hidden, E experts, k slots per token.

A drop-in replacement for a dense FFN: ``forward(x [..., H]) -> [..., H]``. The router's aux loss
joins backward through the layer output (``AuxLossInjector``), so callers add nothing to their loss
and it works across pipeline stages; its value is recorded in ``layer.load`` for logging.
Two strategy slots, both plain objects that comm/ swaps for distributed ones (moe/ never imports
torch.distributed):

    token_split   which of the input's tokens this rank routes, and how the outputs come back
                  (``LocalTokens``: all of them; tensor parallelism: a 1/tp slice, all-gathered back)
    dispatcher    where the routed rows are computed (``LocalDispatcher``; expert-parallel all-to-all)

    x [..., H] --split--> [T, H] --router, dispatch, experts, combine--> [T, H] --gather--> [..., H]
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moekit.moe.dispatch import Dispatcher, LocalDispatcher
from moekit.moe.activations import get_activation
from moekit.moe.experts import GroupedExperts, available_backends
from moekit.moe.precision import compute_dtype
from moekit.moe.recompute import recomputed
from moekit.moe.load import ExpertLoad
from moekit.moe.losses import Sequences
from moekit.moe.router import Router, build_router, check_hidden_states, check_int


class TokenSplit(Protocol):
    """Which tokens of a layer's input this rank routes, and how their outputs come back.

    ``split(x [..., H], token_ids [...] | None) -> (rows [T, H], ids [T] | None, meta)``: this rank's tokens
    and their ids; ``gather(y [T, H], meta) -> [N, H]`` with N * H = x.numel(): the layer's output rows
    (the layer restores x's shape). ``meta`` is whatever gather needs; nothing is kept between the calls.
    ``parts``: how many ranks share the input's tokens (each one's aux loss is that slice's).
    ``sequences(x) -> moe.losses.Sequences``: where this rank's tokens sit among the sequences of the input
    (sequence-wise balancing).
    """

    parts: int

    def split(self, x: Tensor, token_ids: Tensor | None) -> tuple[Tensor, Tensor | None, Any]: ...

    def gather(self, y: Tensor, meta: Any) -> Tensor: ...

    def sequences(self, x: Tensor) -> Sequences: ...


def sequence_grid(x: Tensor, offset: int = 0) -> Sequences:
    """x [B, S, ..., H] as B sequences of its rows; a [T, H] input is one sequence."""
    B = x.shape[0] if x.dim() > 2 else 1
    rows = math.prod(x.shape[:-1])
    return Sequences(offset, max(rows // max(B, 1), 1), max(B, 1))


class LocalTokens:
    """Every token of the input is this rank's (the default; no communication)."""

    parts = 1

    def split(self, x: Tensor, token_ids: Tensor | None) -> tuple[Tensor, Tensor | None, None]:
        ids = None if token_ids is None else token_ids.reshape(-1)
        return x.reshape(-1, x.shape[-1]), ids, None  # [T, H], [T]

    def gather(self, y: Tensor, meta: None) -> Tensor:
        return y

    def sequences(self, x: Tensor) -> Sequences:
        return sequence_grid(x)


class AuxLossInjector(torch.autograd.Function):
    """Identity on ``out``; in backward, gives ``aux_loss`` a gradient of ``scale``.

    Equivalent to adding ``scale * aux_loss`` to the final loss, without the caller collecting it.
    """

    @staticmethod
    def forward(ctx, out: Tensor, aux_loss: Tensor, scale: float) -> Tensor:
        ctx.scale = scale
        ctx.aux_shape, ctx.aux_dtype = aux_loss.shape, aux_loss.dtype
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        grad_aux = torch.full(ctx.aux_shape, ctx.scale, dtype=ctx.aux_dtype, device=grad_out.device)
        return grad_out, grad_aux, None


class DenseMLP(nn.Module):
    """The shared expert (and a dense FFN): w_out(act(x)), optionally sigmoid-gated per token.

    SwiGLU: silu(w_gate(x)) * w_up(x); GELU / ReLU: act(w_up(x)) (no w_gate). Gate and up are separate
    Linears (not one fused [gate | up] matrix) so that tensor parallelism can shard both column-wise and
    each rank keeps matching gate and up columns.
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, activation: str = "swiglu", gate: bool = False):
        super().__init__()
        self.act = get_activation(activation)  # refuses unknown names, listing the known ones
        self.activation = activation
        self.w_gate = nn.Linear(hidden_size, ffn_hidden_size, bias=False) if self.act.gated else None
        self.w_up = nn.Linear(hidden_size, ffn_hidden_size, bias=False)
        self.w_out = nn.Linear(ffn_hidden_size, hidden_size, bias=False)
        self.gate = nn.Linear(hidden_size, 1, bias=False) if gate else None  # Qwen2-MoE shared_expert_gate

    def forward(self, x: Tensor) -> Tensor:
        dtype = compute_dtype(x)
        if dtype != x.dtype:  # autocast: one bf16 copy of x for w_up, w_gate and the gate (autocast casts per call)
            return self._mlp(x.to(dtype), lambda linear, t: linear(t))
        if dtype == self.w_up.weight.dtype:  # nothing to cast
            return self._mlp(x, lambda linear, t: linear(t))
        # x's dtype differs from the weights' and no autocast reconciles them (float64 input, or bf16 input on
        # fp32 weights): compute in x's dtype with the weights cast, the routed experts' rule (GroupedExperts)
        with torch.autocast(x.device.type, enabled=False):
            return self._mlp(x, lambda linear, t: _cast_linear(linear, t, dtype))

    def _mlp(self, x: Tensor, apply) -> Tensor:
        """The MLP with ``apply(linear, t)`` as each projection."""
        up = apply(self.w_up, x)  # [..., F]
        h = self.act.combine(apply(self.w_gate, x), up) if self.act.gated else self.act.unit(up)  # [..., F]
        y = apply(self.w_out, h)  # [..., H]
        return y if self.gate is None else torch.sigmoid(apply(self.gate, x)) * y


def _cast_linear(linear: nn.Module, t: Tensor, dtype: torch.dtype) -> Tensor:
    """``linear(t)`` with its weights cast to ``dtype``; a LoRA adapter (models.lora: duck-typed, moe imports no
    models) too."""
    y = F.linear(t, linear.weight.to(dtype))
    if hasattr(linear, "lora_a"):
        u = linear.lora_input(t, linear.lora_a.to(dtype))
        y = y + recomputed(F.linear, u, linear.lora_b.to(dtype)) * linear.lora_scale  # moe.recompute
    return y


class MoELayer(nn.Module):
    """Mixture-of-Experts FFN.

    router: a ``Router``, or a registered name (built with its defaults).
    activation: "swiglu" | "gelu" | "relu" | "swiglu_oai" (gpt-oss) for the routed and the shared experts.
    ffn_bias: per-expert biases on both projections of the routed experts (``experts.b_in`` [E, F_in],
    ``experts.b_out`` [E, H], zero-initialised; gpt-oss). Not named ``expert_bias``: that is the top-k
    router's aux-loss-free selection bias. The router's own gate bias is the router's option ``gate_bias``.
    shared_ffn_hidden_size: > 0 adds an always-on shared expert (DeepSeek / Qwen2-MoE);
    shared_expert_gate: gate it with sigmoid(x @ w_g) as Qwen2-MoE does.
    weight_on_input: top-1 routing only: each token enters its expert scaled by the router's weight and the
    expert's output is added unweighted (Llama 4), instead of the weight scaling the output.
    backend: expert compute, "auto" | "triton" | "torch" | "loop" (see moe.experts).
    dispatcher, token_split: the strategies (module docstring); None = local.
    aux_loss_scale: multiplies the aux-loss gradient; ``set_aux_loss_scale`` sets it for a training layout.
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, num_experts: int, router: Router | str,
                 activation: str = "swiglu", shared_ffn_hidden_size: int = 0, *,
                 shared_expert_gate: bool = False, backend: str = "auto", dispatcher: Dispatcher | None = None,
                 token_split: TokenSplit | None = None, ffn_bias: bool = False, weight_on_input: bool = False):
        super().__init__()
        check_int("hidden_size", hidden_size, 1)
        check_int("ffn_hidden_size", ffn_hidden_size, 1)
        check_int("num_experts", num_experts, 1)
        check_int("shared_ffn_hidden_size", shared_ffn_hidden_size, 0)
        if isinstance(router, str):
            router = build_router(router, hidden_size, num_experts)
        if not isinstance(router, Router):
            raise ValueError(f"router must be a moe.router.Router or a router name, got {type(router).__name__}")
        if (router.hidden_size, router.num_experts) != (hidden_size, num_experts):
            raise ValueError(
                f"router was built for hidden_size={router.hidden_size}, num_experts={router.num_experts} but the "
                f"layer has hidden_size={hidden_size}, num_experts={num_experts}; build them with the same values"
            )
        self.hidden_size, self.num_experts = hidden_size, num_experts
        self.router = router
        if not isinstance(ffn_bias, bool):
            raise ValueError(f"ffn_bias={ffn_bias!r} is invalid; it must be True (per-expert biases) or False")
        self.experts = GroupedExperts(num_experts, hidden_size, ffn_hidden_size, activation, backend, bias=ffn_bias)
        self.shared_expert = (
            DenseMLP(hidden_size, shared_ffn_hidden_size, activation, shared_expert_gate)
            if shared_ffn_hidden_size > 0 else None
        )
        self.dispatcher: Dispatcher = dispatcher or LocalDispatcher(num_experts)
        self.token_split: TokenSplit = token_split or LocalTokens()
        self.load = ExpertLoad(num_experts)
        self.aux_loss_scale = 1.0
        # Llama 4 (top-1): the router's weight scales the token before its expert; the output is combined with 1
        self.weight_on_input = bool(weight_on_input)

    def forward(self, x: Tensor, token_ids: Tensor | None = None, aux_weight: float = 1.0) -> Tensor:
        """x [..., H] -> [..., H]; ``token_ids`` [...]: for routers that read them (hash); ``aux_weight``
        multiplies this call's aux-loss gradient on top of ``aux_loss_scale`` (a caller whose tokens are a
        weighted share of the balancing batch: models.mtp under context parallelism)."""
        check_hidden_states("MoELayer", x, self.hidden_size)  # type, 0-d, dtype, meta: no host sync
        if x.shape[-1] != self.hidden_size:
            raise ValueError(f"MoELayer got hidden size {x.shape[-1]}, expected {self.hidden_size}")
        shape = x.shape
        sequences = None
        if getattr(self.router, "balance", "batch") == "sequence":  # the sequence of each of this rank's tokens;
            # the sequence loss is a share of whole sequences already: it undoes aux_weight (the z-loss keeps it)
            if not hasattr(self.token_split, "sequences"):
                raise ValueError(f"router balance='sequence' needs each token's sequence, but the token split "
                                 f"{type(self.token_split).__name__} has no sequences(x) method (moe.layer.TokenSplit)")
            sequences = dataclasses.replace(self.token_split.sequences(x), weight=aux_weight)
        x, token_ids, split = self.token_split.split(x, token_ids)  # this rank's tokens [T, H], ids [T]
        routing = (self.router(x, token_ids) if sequences is None
                   else self.router(x, token_ids, sequences=sequences))  # indices/weights [T, k]
        if self.training:
            self.load.record(routing)
        # Under autocast the experts compute in the autocast dtype anyway: cast before dispatch, so the
        # gathered rows (and an EP all-to-all) carry half the bytes. The router keeps the fp32 input.
        x_in = x
        if self.weight_on_input:  # expert(w x) instead of w expert(x): needs the one slot of top-1 routing
            if routing.weights.shape[-1] != 1:
                raise ValueError(f"MoELayer(weight_on_input=True) scales each token by the weight of its one expert, "
                                 f"but the router gave {routing.weights.shape[-1]} per token; route top-1")
            x_in = x * routing.weights.to(x.dtype)
            routing = dataclasses.replace(routing, weights=torch.ones_like(routing.weights))
        rows_in = x_in.to(compute_dtype(x))
        if getattr(self.dispatcher, "overlap_chunks", 1) > 1:  # EP: chunks whose all-to-alls overlap experts
            y = self.dispatcher.pipelined(rows_in, routing, self.experts)  # [T, H] (comm.overlap)
        else:
            y = self._dispatch_experts_combine(rows_in, routing)  # [T, H]
        if self.shared_expert is not None:
            y = y + self.shared_expert(x)
        if routing.aux_loss.requires_grad and torch.is_grad_enabled():
            y = AuxLossInjector.apply(y, routing.aux_loss, self.aux_loss_scale * aux_weight)
        return self.token_split.gather(y, split).view(shape)  # every token's output [..., H]

    def _dispatch_experts_combine(self, rows_in: Tensor, routing) -> Tensor:
        """[T, H] -> [T, H]: dispatch, experts, combine; ScatterMoE-style where the experts take it
        (moe.experts.FUSED_PERMUTE): the rows stay [T, H] and the first expert GEMM reads each routed row in
        place, and the last applies the routing weights so that the combine is a plain sum."""
        takes = getattr(self.experts, "takes_gather", None)
        if not (getattr(self.dispatcher, "fuses_gather", False) and takes is not None and takes(rows_in)):
            d = self.dispatcher.dispatch(rows_in, routing)  # rows [N, H], counts [E_local]
            return self.dispatcher.combine(self.experts(d.rows, d.counts), d.meta)
        d = self.dispatcher.dispatch(rows_in, routing, fuse_gather=True)  # rows: rows_in itself, gather [N]
        if getattr(self.dispatcher, "fuses_weights", False) and self.experts.takes_row_scale(rows_in):
            scale = self.dispatcher.row_weights(d.meta)  # [N] fp32
            out = self.experts(d.rows, d.counts, gather=d.gather, row_scale=scale)  # [N, H], weighted
            return self.dispatcher.combine(out, d.meta, weighted=False)
        return self.dispatcher.combine(self.experts(d.rows, d.counts, gather=d.gather), d.meta)

    def set_backend(self, name: str) -> None:
        """Switch the expert compute backend ("auto", "triton", "torch", "loop")."""
        if name not in available_backends():
            raise ValueError(f"expert backend {name!r} is unknown; use one of {available_backends()}")
        self.experts.backend = name


def set_aux_loss_scale(model: nn.Module, *, accumulation: int = 1, token_slices: int = 1,
                       microbatches: int = 1) -> None:
    """Set every MoE layer's aux-loss gradient scale for a training layout (the one place it is computed).

    The LM loss of a step is the mean over its micro-batches, so each micro-batch's aux loss counts
    1/accumulation (gradient accumulation) or 1/microbatches (a pipeline's micro-batches); under tensor
    parallelism each of the ``token_slices`` ranks routes a slice of the same tokens, and the slices' aux
    losses are averaged. Sets, not multiplies: calling it again replaces the scale.
    """
    for name, value in (("accumulation", accumulation), ("token_slices", token_slices), ("microbatches", microbatches)):
        check_int(name, value, 1)
    scale = 1.0 / token_slices / accumulation / microbatches  # divided one by one: the same bits in every layout
    for module in model.modules():
        if isinstance(module, MoELayer):
            if module.token_split.parts != token_slices:
                raise ValueError(f"set_aux_loss_scale(token_slices={token_slices}) but the MoE layers' token split "
                                 f"has {module.token_split.parts} parts; pass the tensor-parallel degree")
            module.aux_loss_scale = scale
