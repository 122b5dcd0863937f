"""torch.compile per transformer block, with the MoE layer's data-dependent middle left eager.

What runs compiled and what runs eagerly, per block (``apply_compile``):

    Block.forward                compiled: attn_norm -> attention -> + residual -> ffn_norm -> ... -> + residual
      ffn = DenseMLP             inside the block's graph
      ffn = MoELayer.forward     eager (one graph break): the routed path below depends on the data
        router                   compiled on its own: fixed shapes [T, H] -> [T, E]
          observe_load, count_reducer   eager: run-time checks (in_backward) and collectives
        load.record              eager: Python-side counters, skipped during checkpoint recompute
        dispatch -> experts -> combine  eager: rows per expert vary every step; host syncs (.tolist),
                                        all-to-alls with host-known splits under expert parallelism
        shared_expert            compiled on its own
        aux-loss injection       eager (see "Why the MoE forward stays eager")

Every compiled graph sees shapes fixed by the batch ([B, S, H] and [T, E]), never the routing, so
changing routing never recompiles. A new batch shape (eval, a short last batch) compiles once more,
then ``dynamic=None`` (torch's automatic dynamic shapes) marks that dim dynamic. All blocks run the
same code, so one set of graphs serves every layer (guards are on module types and attributes).

Why the MoE forward stays eager:
  1. The per-expert row counts are data: traced, they become guards (and 0/1 always specialise), so a
     traced loop over experts recompiles whenever some expert sees a count it has not seen before.
  2. Expert-load records and the aux-loss-free bias update decide at run time whether they run inside
     a checkpoint recompute (``moe.load.in_backward``); traced, that check would be frozen at trace time.
  3. torch (2.13) drops the aux-loss gradient when a graph starts after the combine: AOTAutograd
     regenerates the graph output ``AuxLossInjector.apply(y).view(shape)`` as a view of the input y,
     bypassing the autograd.Function (the pytorch#102970 family). Silent: only the router gradient is
     off. Keeping the injection eager avoids it.

Order with activation checkpointing: call ``apply_compile`` BEFORE
``models.parallelize.apply_activation_checkpointing``, so the checkpoint wraps the compiled forward and
the recompute in backward replays the same compiled graphs. Compiling a block whose forward is already
a checkpoint would put ``checkpoint`` inside the traced region, which dynamo can only trace whole; the
MoE's graph break makes it give up and the block silently runs eagerly. So when ``apply_compile`` finds
a block's forward already wrapped, it compiles the block's parts one by one underneath the wrapper
(attention, norms, dense FFN; the MoE as above) and warns: correct, but the residual adds run eagerly
and the norms are not fused with their neighbours. Checkpointing only the FFN ("ffn") composes in either
order. Expert and tensor parallelism go first (their dispatchers, count reducer and token split are
kept eager here); FSDP after (its hooks stay outside the compiled forward).
"""
from __future__ import annotations

import warnings

import torch
from torch import nn

from moekit.moe.load import moe_layers

_COMPILED = "_moekit_compiled"  # marks a module whose forward apply_compile replaced
_EAGER = "_moekit_eager"  # marks a function wrapped by _eager (so wrapping twice is a no-op)


def apply_compile(model: nn.Module, **options) -> None:
    """Compile each block of ``model.layers`` in place (state-dict keys unchanged).

    options: passed to ``torch.compile`` (backend="inductor", mode, dynamic, options, ...).
    ``fullgraph=True`` is refused: the MoE layer breaks the graph on purpose.
    Blocks already compiled are left alone, so calling it twice is harmless.
    """
    if options.get("fullgraph"):
        raise ValueError("apply_compile(fullgraph=True) cannot work: MoE blocks break the graph on purpose "
                         "around the data-dependent dispatch; leave fullgraph unset")
    layers = getattr(model, "layers", None)
    if isinstance(layers, nn.ModuleDict):  # a pipeline stage: blocks keyed by their index in the full model
        named = list(layers.items())
    elif isinstance(layers, nn.ModuleList):
        named = [(str(i), block) for i, block in enumerate(layers)]
    else:
        raise ValueError(f"apply_compile needs a model whose `layers` hold the blocks (ModuleList or ModuleDict), "
                         f"got {type(model).__name__}.layers = {type(layers).__name__}")
    wrapped = []
    for key, block in named:
        if getattr(block, _COMPILED, False):
            continue
        for _, moe in moe_layers(block):
            _keep_moe_eager(moe, options)
        if "forward" in vars(block):  # replaced on the instance: whole-block activation checkpointing
            wrapped.append(f"layers.{key}")
            for child in block.children():
                if not getattr(child, _COMPILED, False):
                    _compile_forward(child, options)
            setattr(block, _COMPILED, True)
        else:
            _compile_forward(block, options)
    if wrapped:
        warnings.warn(f"{len(wrapped)} blocks ({wrapped[0]}, ...) already had their forward wrapped (activation "
                      f"checkpointing?), so their parts were compiled one by one; call apply_compile before "
                      f"apply_activation_checkpointing for one graph per block", stacklevel=2)


def _keep_moe_eager(moe: nn.Module, options: dict) -> None:
    """MoELayer.forward runs eagerly; its router and shared expert get their own compiled graphs."""
    router = moe.router
    _eager(router, "observe_load", "reads in_backward() and updates router state per real forward")
    if getattr(router, "count_reducer", None) is not None:  # installed by expert parallelism (a collective)
        router.count_reducer = _eager_fn(router.count_reducer, "all-reduces counts over the data-parallel group")
    _compile_forward(router, options)
    if getattr(moe, "shared_expert", None) is not None:
        _compile_forward(moe.shared_expert, options)
    _eager(moe, "forward", "data-dependent dispatch, host syncs, expert-load records")
    setattr(moe, _COMPILED, True)  # its forward is ours now: not a foreign wrapper


def _compile_forward(module: nn.Module, options: dict) -> None:
    # The bound forward, not module.compile(): module.compile() compiles __call__, which would put a
    # later activation-checkpoint wrapper (it replaces module.forward) inside the compiled region.
    module.forward = torch.compile(module.forward, **options)
    setattr(module, _COMPILED, True)


def _eager(obj, name: str, why: str) -> None:
    setattr(obj, name, _eager_fn(getattr(obj, name), why))


def _eager_fn(fn, why: str):
    if getattr(fn, _EAGER, False):
        return fn
    # recursive=True: nothing called from fn is traced either, except functions compiled explicitly
    # (the router inside the eager MoE forward).
    wrapped = torch._dynamo.disable(fn, reason=why)
    setattr(wrapped, _EAGER, True)
    return wrapped
