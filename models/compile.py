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

How: a compiled module's class becomes ``Compiled<Class>`` (``CompiledBlock``, ``CompiledTopKRouter``,
``CompiledDenseMLP``), whose ``forward`` is ``torch.compile(Class.forward)``, and the MoE layer's becomes
``EagerMoELayer``, whose ``forward`` dynamo never traces. Only ``forward`` is compiled, not ``__call__``
(``nn.Module.compile()`` would be): hooks stay eager and outside the graphs (FSDP's, the sequence-parallel
split, the trainer's non-finite probes). Parameter names and state-dict keys do not change; ``print(model)``
shows what runs compiled. Every block of a model shares one class, so they share their graphs, and a deep
copy of a compiled model runs its own compiled forward.

Order with activation checkpointing: the checkpoint must wrap the compiled forward, so the recompute in
backward replays the same compiled graphs; a checkpoint inside the traced region is something dynamo can
only trace whole, the MoE's graph break makes it give up and the block silently runs eagerly. The recipe
compiles first (``Checkpointed<CompiledBlock>``). Given a module that already is ``Checkpointed<X>``,
``apply_compile`` puts the compiled forward beneath the checkpoint, so both orders build the same model.
Expert and tensor parallelism go first (their dispatchers, count reducer and token split are kept eager
here); FSDP after (its hooks stay outside the compiled forward).
"""
from __future__ import annotations

import torch
from torch import nn

from moekit.models.parallelize import Checkpointed, compiled_region, subclass
from moekit.moe.load import moe_layers
from moekit.moe.router import Router


class Compiled:
    """Mixin of ``Compiled<Class>``: ``forward`` is torch.compile of the class's forward (``compiled``)."""


class Eager:
    """Mixin of ``EagerMoELayer``: dynamo never traces ``forward``; the router and the shared expert it
    calls run their own compiled forwards."""


def apply_compile(model: nn.Module, **options) -> None:
    """Compile each block of ``model.layers`` in place (names and state-dict keys unchanged).

    options: passed to ``torch.compile`` (backend="inductor", mode, dynamic, options, ...).
    ``fullgraph=True`` is refused: the MoE layer breaks the graph on purpose.
    Blocks already compiled are left alone, so calling it twice is harmless.
    """
    if options.get("fullgraph"):
        raise ValueError("apply_compile(fullgraph=True) cannot work: MoE blocks break the graph on purpose "
                         "around the data-dependent dispatch; leave fullgraph unset")
    layers = getattr(model, "layers", None)
    if isinstance(layers, nn.ModuleDict):  # a pipeline stage: blocks keyed by their index in the full model
        blocks = list(layers.values())
    elif isinstance(layers, nn.ModuleList):
        blocks = list(layers)
    else:
        raise ValueError(f"apply_compile needs a model whose `layers` hold the blocks (ModuleList or ModuleDict), "
                         f"got {type(model).__name__}.layers = {type(layers).__name__}")
    for block in blocks:
        for _, moe in moe_layers(block):
            _keep_moe_eager(moe, options)
        compiled(block, options)


def _keep_moe_eager(moe: nn.Module, options: dict) -> None:
    """MoELayer.forward runs eagerly; its router and shared expert get their own compiled graphs."""
    compiled(moe.router, options)
    if moe.shared_expert is not None:
        compiled(moe.shared_expert, options)
    if not isinstance(moe, Eager):
        why = "data-dependent dispatch, host syncs, expert-load records"
        _swap(moe, Eager,  # in_compiled_code() is False in here (models.parallelize)
              lambda cls: {"forward": torch._dynamo.disable(compiled_region(cls.forward, False), reason=why)})


def compiled(module: nn.Module, options: dict) -> nn.Module:
    """Compile ``module``'s forward in place: its class becomes ``Compiled<Class>`` (idempotent).

    A router keeps its load bookkeeping eager: ``observe_load`` (reads in_backward() and updates router
    state per real forward) and the ``count_reducer`` comm/ installs (a collective).
    """
    if isinstance(module, Compiled):
        return module

    def attrs(cls: type) -> dict:
        # in_compiled_code(): selective checkpointing keeps this graph's matmuls (models.parallelize)
        own = {"forward": compiled_region(torch.compile(cls.forward, **options), True)}
        if issubclass(cls, Router):
            why = "reads in_backward() and updates router state per real forward"
            own.update(observe_load=torch._dynamo.disable(cls.observe_load, reason=why),
                       reduce_counts=_eager_reduce_counts(), reduce_sequence_counts=_eager_reduce_counts("sequence"))
        return own

    _swap(module, Compiled, attrs, key=repr(sorted(options.items())))
    return module


def _swap(module: nn.Module, mixin: type, attrs, key=()) -> None:
    """module's class -> <mixin><Class>; beneath the checkpoint when it already is ``Checkpointed<Class>``."""
    cls = type(module)
    if not isinstance(module, Checkpointed):
        module.__class__ = subclass(mixin, cls, attrs, key)
        return
    wrap = cls.__bases__[0]  # Checkpointed or SelectiveCheckpointed
    if not (isinstance(wrap, type) and issubclass(wrap, Checkpointed)):  # e.g. FSDP's class around it: too late
        raise ValueError(f"cannot compile a {cls.__name__}: apply torch.compile before FSDP (models.parallelize)")
    module.__class__ = subclass(wrap, subclass(mixin, cls.__bases__[1], attrs, key))  # Checkpointed<<mixin>X>


def _eager_reduce_counts(kind: str = "count"):
    # Router.reduce_counts (reduce_sequence_counts for kind "sequence") with the reducer call run eagerly: an
    # all-reduce over the data-parallel group (the ranks sharing the sequences). Without a reducer nothing breaks
    # the router's graph.
    run = torch._dynamo.disable(lambda reducer, counts: reducer(counts), reason="a collective over the data ranks")
    name = f"{kind}_reducer"

    def reduce_counts(self, counts):
        reducer = getattr(self, name)
        return counts if reducer is None else run(reducer, counts)

    return reduce_counts
