"""The ordered recipe that turns a built single-device model into its share of a parallel layout.

    1. tensor parallel        DTensor parallelize_module: attention heads and dense MLPs column/row-wise;
                              MoE layers split their tokens over the TP ranks (comm.tensor_parallel)
       context parallel       each rank holds its zigzag share of every sequence; attention gathers the
                              keys and values (comm.context_parallel)
    2. expert parallel        experts -> DTensor shards over the EP group, EP dispatchers, global-batch
                              balancing over the stage's ranks (comm.expert_parallel)
    3. torch.compile          each block (models.compile); the MoE layer's data-dependent middle stays eager
    4. activation checkpoint  whole blocks, only their FFN / MoE part, or op level (below)
    5. FSDP                   fully_shard experts (over the ranks holding the same experts), then each
                              block, then the root (comm.fsdp)

The order matters: TP before FSDP so FSDP shards the TP-local weights (2-D DTensors); EP before FSDP for
the same reason on the experts; TP and EP before compile (their dispatchers and count reducers are read
at trace time); compile before activation checkpointing (torchtitan does the reverse): the checkpoint then
wraps the compiled block and its recompute replays the same graphs, while a checkpoint inside a traced
region meets the MoE graph break and dynamo silently runs the whole block eagerly; both wrap the block's
forward before FSDP's hooks go around it.
Pipeline parallelism splits the model into stages before this recipe runs on each stage (models.pipeline).
The model code itself never changes: every step swaps a strategy object (``MoELayer.token_split``,
``.dispatcher``, ``Router.count_reducer``) or a parameter (DESIGN.md), or, for compile and activation
checkpointing, the class of a module: as FSDP's ``fully_shard`` does, it becomes a subclass that
overrides ``forward`` (a compiled router also keeps two bookkeeping methods eager), so parameter names,
state-dict and checkpoint keys and hooks stay, and ``print(model)`` shows what was applied
(``CheckpointedCompiledBlock``, ``EagerMoELayer``, ...).
Every layout starts from the same numbers: either the weights are initialised in full from the seed before
this runs, or (the trainer's way) the model is parallelised on the meta device, moved with ``to_empty`` and each
rank fills what it holds with models.init.init_weights, whose values depend on the seed, the name and the
position only.
"""
from __future__ import annotations

import functools
import threading
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._pytree import tree_map
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from moekit.comm.all_to_all import Traffic
from moekit.comm.context_parallel import apply_context_parallel, check_context_parallel
from moekit.comm.expert_parallel import apply_expert_parallel
from moekit.comm.grad_sync import gradient_roles
from moekit.comm.topology import Topology
from moekit.moe.layer import set_aux_loss_scale
from moekit.moe.recompute import marked as recompute_marked


@dataclass
class Parallelized:
    topology: Topology | None
    traffic: Traffic  # all-to-all bytes per link class, for the training log
    fsdp: bool  # gradients are reduced by fully_shard (comm.grad_sync needs to know)
    # parameter name -> "dense" | "moe" | "expert": which ranks hold partial sums of its gradient
    # (comm.grad_sync.sync_gradients(model, topology, grad_roles, fsdp))
    grad_roles: dict[str, str]
    # comm.context_parallel's strategy when cp > 1: ``context.shard(tokens)`` is this rank's share of a batch
    context: object = None


def parallelize(model: nn.Module, topology: Topology | None, *, hierarchical: bool | None = None,
                activation_checkpointing: str = "none", compile: bool = False,
                param_dtype: torch.dtype | None = None, sequence_parallel: bool = False,
                expert_placement: dict | None = None, ep_overlap_chunks: int = 1) -> Parallelized:
    """Apply the layout to ``model`` in place (``topology=None``: one process, steps 3-4 only).

    hierarchical: None picks two-level EP dispatch when the EP group spans several nodes.
    expert_placement: {MoE layer name: comm.placement.Placement}: which experts each EP rank holds (layers
    not named: contiguous blocks); ignored without expert parallelism.
    ep_overlap_chunks: > 1 pipelines each MoE layer's EP dispatch / experts / combine in that many token chunks
    (comm.overlap); needs ep > 1.
    param_dtype: FSDP's compute dtype for parameters (bf16 on GPU); gradients are reduced in fp32.
    sequence_parallel: with tp > 1, norms / residual / MoE layers keep 1/tp of the sequence per rank.
    """
    from moekit.comm.tensor_parallel import apply_tensor_parallel, check_tensor_parallel

    traffic, fsdp, token_sliced, context = Traffic(), False, [], None
    if topology is not None:
        # 1. tensor parallel (validated first: nothing is sharded when a degree does not fit)
        check_tensor_parallel(model.config, topology.layout.tp)
        token_sliced = apply_tensor_parallel(model, topology, sequence_parallel)  # sequence-parallel norms
        # each TP rank's aux loss covers its token slice: 1/tp each (callers with several micro-batches set
        # the scale again with their count, moe.layer.set_aux_loss_scale)
        set_aux_loss_scale(model, token_slices=topology.layout.tp)
        # context parallel: RoPE positions and the attention's key/value gather (a strategy, as EP's dispatchers)
        check_context_parallel(model.config, topology.layout.cp)
        context = apply_context_parallel(model, topology)
        # 2. expert parallel (also installs the global-batch count reducer when ep == 1 and dp > 1)
        if hierarchical is None:
            hierarchical = len({topology.node_of(r) for r in topology.members("ep")}) > 1
        traffic = apply_expert_parallel(model, topology, hierarchical=hierarchical, placements=expert_placement,
                                        overlap_chunks=ep_overlap_chunks)
    # 3. torch.compile per block
    if compile:
        from moekit.models.compile import apply_compile

        apply_compile(model)
    # 4. activation checkpointing (around the compiled forwards)
    apply_activation_checkpointing(model, activation_checkpointing)
    # gradient roles, by name (before FSDP, which swaps the Parameter objects; the names stay)
    grad_roles = gradient_roles(model, token_sliced)
    # 5. FSDP
    if topology is not None and topology.layout.fsdp > 1:
        from moekit.comm.fsdp import apply_fsdp

        apply_fsdp(model, topology, param_dtype)
        fsdp = True
    if topology is not None:  # replicated experts: the norm counts one copy (on the Parameters FSDP left)
        from moekit.comm.relocate import tag_primaries

        tag_primaries(model)
    return Parallelized(topology, traffic, fsdp, grad_roles, context)


AC_MODES = ("none", "full", "ffn", "selective")


def apply_activation_checkpointing(model: nn.Module, mode: str) -> None:
    """Recompute activations in backward instead of keeping them.

    full:      every transformer block keeps only its input.
    ffn:       only the FFN / MoE sublayer is recomputed: its expert hidden states (N x 2F per layer,
               N = tokens x k) are the largest activations of an MoE block, while attention keeps its own
               (SDPA's backward needs them anyway).
    selective: op level, per block (``selective_policy``): the outputs of matmuls, attention kernels,
               functional collectives and routing decisions are kept, everything elementwise between them
               (norms, RoPE, SwiGLU, softmax, gathers) is recomputed, so backward replays no GEMM it can see.
    Each such module becomes ``Checkpointed<Class>`` / ``SelectiveCheckpointed<Class>`` (``checkpointed``):
    names and keys unchanged, its hooks stay outside the checkpoint. Recomputation replays the same routing
    (RNG state is restored, so router jitter repeats), and expert-load records skip recomputed forwards
    (moe.load.in_backward). Under expert parallelism the recomputed all-to-alls run in backward on every
    rank in the same order (selective too: moekit's all-to-all writes into its output, see the policy).
    """
    if mode not in AC_MODES:
        raise ValueError(f"activation checkpointing mode {mode!r} is unknown; use one of {list(AC_MODES)}")
    if mode == "none":
        return
    for block in (model.layers.values() if isinstance(model.layers, nn.ModuleDict) else model.layers):
        checkpointed(block.ffn if mode == "ffn" else block, selective=mode == "selective")


class Checkpointed:
    """Mixin: ``forward`` runs the class's own forward under ``torch.utils.checkpoint`` while training.

    It wraps whatever forward comes next in the class order, a compiled one included (models.compile), so
    the recompute in backward replays the same compiled graphs.
    """

    # torch.utils.checkpoint's options beyond use_reentrant: none, so that a checkpoint dynamo traces (a dense
    # FFN's, inside a compiled block) stays one it can trace; SelectiveCheckpointed adds its context_fn
    checkpoint_options: dict = {}

    def forward(self, *args, **kwargs):
        forward = super().forward
        if not (torch.is_grad_enabled() and self.training):  # eval / no_grad: nothing to save anyway
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **self.checkpoint_options, **kwargs)


# ---------------------------------------------------------------------------------------------------
# Op-level selective checkpointing: which ops' outputs a checkpointed block keeps
# ---------------------------------------------------------------------------------------------------


def _ops(*names: str) -> frozenset:
    """The OpOverloads ``namespace.op.overload`` that this torch build has (newer ones are skipped)."""
    found = set()
    for name in names:
        space, op, overload = name.split(".")
        packet = getattr(getattr(torch.ops, space), op, None) if hasattr(torch.ops, space) else None
        if packet is not None and hasattr(packet, overload):
            found.add(getattr(packet, overload))
    return frozenset(found)


# Kept: recomputing them costs a GEMM (or attention, or a collective) per element kept; all else is
# memory-bound. Routing decisions (top-k; the dispatch sort, [T, k]; with a capacity the [T, E] priority
# sort) are small and kept, so the replayed routing is the forward's by construction. Not bmm: SDPA's math
# fallback (CPU MLA, Dqk != Dv) computes its [B, N, S, S] scores with it, what the fused kernels avoid keeping.
SAVED_OPS = _ops(
    "aten.mm.default", "aten.addmm.default",
    "aten._grouped_mm.default", "aten._scaled_mm.default", "aten._scaled_grouped_mm.default",
    "aten._scaled_dot_product_flash_attention.default", "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_cudnn_attention.default", "aten._scaled_dot_product_flash_attention_for_cpu.default",
    "aten._scaled_dot_product_fused_attention_overrideable.default",
    "_c10d_functional.all_to_all_single.default", "_c10d_functional.all_gather_into_tensor.default",
    "_c10d_functional.reduce_scatter_tensor.default", "_c10d_functional.all_reduce.default",
    "aten.topk.default", "aten.sort.default", "aten.sort.stable",
)


def selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Keep the outputs of ``SAVED_OPS``, recompute the rest (torch.utils.checkpoint's SAC policy).

    Why these: recomputing a kept [M, n] matmul output would cost 2K flops per element (K its inner
    dimension), an elementwise op a few; so backward replays only memory-bound work. In an MoE block that
    means keeping the experts' first GEMM output [N, 2F] (N = T x k), the largest activation, when the
    dispatcher sees it: dropping it too would recompute 2/3 of the expert FLOPs, which is what "ffn" mode
    trades. The SwiGLU output [N, F], the gathered rows [N, H], norms and RoPE are what selective drops.

    An op that writes into a tensor it was given (``out=``, in place) is always recomputed: its cached
    result would not be written into the buffer the recompute allocates (and SAC refuses a cached tensor
    mutated later). So the loop backend's SwiGLU experts (``moe.loop_experts._LoopGLU``: ``torch.mm(..., out=)``
    into preallocated h, a) and Triton kernels (raw launches, invisible to the dispatcher) are recomputed
    whole, like "ffn" does, while the torch backend's ``_grouped_mm`` outputs, [N, 2F] and [N, H], are kept.
    (A compiled graph's out= matmuls are kept all the same, by copy: ``KeepCompiledMatmuls``.)
    moekit's EP all-to-all (``dist.all_to_all_single`` into a preallocated output, an autograd Function)
    is not a functional collective: it re-runs in backward with its count exchange, on every rank in the
    same order, as under "full"; a functional one (``_c10d_functional.all_to_all_single``) would be kept.

    A matmul called through ``moe.recompute.recomputed`` is recomputed too: a LoRA adapter's expansion u B^T, r deep
    (2r flops per element, memory-bound like the add it feeds) and as wide as its projection, whose output (or the
    sum with it) is kept already; keeping it as well doubled a projection's cache with an adapter.

    SAC hands cached outputs back by (op, call index): code that runs in the real forward only (expert-load
    records, the router's load observation, skipped when ``in_backward()``) must not call a kept op.
    """
    schema = getattr(op, "_schema", None)
    if op in SAVED_OPS and not (schema is not None and schema.is_mutable) and not recompute_marked():
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


# Profiler annotations carry no tensors, and FSDP's hooks on modules inside a block (the experts) issue a
# different number of them in the forward and in the recompute, which SAC's per-op replay counters refuse
# ("invocation index ... not found in storage"); the same exclusion was proposed upstream (pytorch PR 196862).
ANNOTATION_OPS = _ops("profiler._record_function_enter.default", "profiler._record_function_enter_new.default",
                      "profiler._record_function_exit.default", "profiler._record_function_exit._RecordFunction")


class SkipAnnotations:
    """Mixin for SAC's two dispatch modes: profiler annotations run as they come, uncounted."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in ANNOTATION_OPS:
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


# ---------------------------------------------------------------------------------------------------
# Compiled blocks: their matmuls are inductor's out= calls, kept by copy
# ---------------------------------------------------------------------------------------------------

# How inductor's compiled code runs the matmuls it does not generate itself (extern_kernels.mm / addmm / bmm /
# baddbmm into a buffer the graph allocated)
OUT_MATMULS = _ops("aten.mm.out", "aten.addmm.out", "aten.bmm.out", "aten.baddbmm.out")
_region = threading.local()


def in_compiled_code() -> bool:
    """Whether the op running now comes from a compiled forward of models.compile (``compiled_region``), not from
    eager code it calls back into (the MoE layer's eager middle)."""
    return getattr(_region, "compiled", False)


def compiled_region(forward, compiled: bool):
    """``forward`` run with ``in_compiled_code()`` set to ``compiled`` (models.compile wraps the compiled forwards
    with True and the MoE layer's eager one, which they call, with False). Outside dynamo: models.compile wraps a
    compiled function, or puts this inside a ``torch._dynamo.disable``."""

    @functools.wraps(forward)
    def run(*args, **kwargs):
        if torch.compiler.is_compiling():  # called from a traced region: nothing to mark
            return forward(*args, **kwargs)
        before = getattr(_region, "compiled", False)
        _region.compiled = compiled
        try:
            return forward(*args, **kwargs)
        finally:
            _region.compiled = before

    return run


# Functional collectives in a compiled graph: their result is ready only after the graph's wait_tensor on it, so
# the copy is taken there
COLLECTIVE_OPS = _ops("_c10d_functional.all_to_all_single.default", "_c10d_functional.all_gather_into_tensor.default",
                      "_c10d_functional.reduce_scatter_tensor.default", "_c10d_functional.all_reduce.default")
WAIT_OPS = _ops("_c10d_functional.wait_tensor.default")
_PENDING = object()  # a kept collective's place until its wait


def _copy(out):
    return tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, out)


LOW_RANK = 16  # an out= matmul this deep or less, with an output at least twice as wide, is a low-rank expansion


def _low_rank_expansion(args) -> bool:
    """Whether a compiled graph's matmul (mat1 [.., M, K], mat2 [.., K, N] its last two arguments) is a low-rank
    expansion such as a LoRA adapter's u B^T (K = r): 2K FLOPs per element, cheaper to recompute than its copy is
    to keep and write back. moe.recompute marks these in eager code; the mark does not reach compiled graphs, so
    their shape names them there: K <= LOW_RANK (LoRA's common ranks 4-16; a projection's K is its input width, in
    the hundreds at least, even MLA's latent ranks) and N >= 2K. Larger ranks are kept by copy (correct, larger)."""
    if len(args) < 2 or not all(isinstance(t, torch.Tensor) and t.dim() >= 2 for t in args[-2:]):
        return False
    k, n = args[-2].shape[-1], args[-1].shape[-1]
    return k <= LOW_RANK and n >= 2 * k


def _kept_in_compiled_code(func, args=()) -> str:
    """What selective keeps of ``func`` called by a compiled graph: "out" (an ``OUT_MATMULS`` call other than a
    low-rank expansion: a copy of its result, written back into the recompute's buffer), "copy" (an op ``selective_policy``
    keeps: a copy, handed back), "collective" (a functional collective: its result copied at its wait, handed back
    without communicating), or "" (recomputed)."""
    if func in OUT_MATMULS:
        return "" if _low_rank_expansion(args) else "out"
    if func in COLLECTIVE_OPS:
        return "collective"
    return "copy" if selective_policy(None, func) == CheckpointPolicy.MUST_SAVE else ""


class KeepCompiledMatmuls:
    """Mixin for SAC's caching mode: what a compiled forward's ops would leave in the cache is kept as a copy.

    A compiled graph writes each matmul into a buffer it allocated (inductor's extern out= calls) and reuses its
    buffers, those of the ops it calls back into eager (attention kernels, top-k) included, once their last reader
    has run. So SAC can neither keep a matmul's buffer nor hand a cached tensor back in place of one
    (``selective_policy`` recomputes every out= op: under compile that was every projection of the block, as
    "full" does), and a kept reference to another op's output could be overwritten before backward reads it
    (context parallelism's compiled attention trained on such values: a wrong loss from the second step). In
    compiled code this keeps a copy of each result the policy would keep (the eager selective's bytes) and
    ``ReplayCompiledMatmuls`` hands them back (matmuls: written into the recompute's buffer); one copy each way,
    memory-bound, instead of a GEMM. A functional collective's result (``COLLECTIVE_OPS``: tensor or context
    parallelism's gathers) is copied when the graph waits for it (it is not ready before), and the recompute gets
    the copy without communicating, as eager SAC hands back its cached collective."""

    kept: list
    pending: dict  # storage of a kept collective's result -> its place in ``kept``, until the graph's wait

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        what = _kept_in_compiled_code(func, args) if in_compiled_code() else None
        if what is None:
            return super().__torch_dispatch__(func, types, args, kwargs)
        out = func(*args, **(kwargs or {}))
        if what == "collective":
            self.pending[out.untyped_storage().data_ptr()] = len(self.kept)
            self.kept.append(_PENDING)
            self.collectives += 1
        elif what:
            self.kept.append(_copy(out))
        elif func in WAIT_OPS and self.pending:
            at = self.pending.pop(args[0].untyped_storage().data_ptr(), None)
            if at is not None:
                self.kept[at] = _copy(out)
        return out


class ReplayCompiledMatmuls:
    """Mixin for SAC's recompute mode: the copies ``KeepCompiledMatmuls`` kept, in call order (the same graphs, so
    the same calls and shapes); an out= matmul's written into the buffer the recompute passes."""

    kept: list

    def __enter__(self):
        self.replayed = self.communicated = 0
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        what = _kept_in_compiled_code(func, args) if in_compiled_code() else None
        if what is None:
            return super().__torch_dispatch__(func, types, args, kwargs)
        if not what or not self.kept:  # recomputed, or the forward ran no compiled code (dynamo skipped its frames)
            return func(*args, **(kwargs or {}))
        value = self.kept[self.replayed] if self.replayed < len(self.kept) else None
        if value is _PENDING:  # a collective the forward's graph never waited for: run it again (every rank alike)
            self.kept[self.replayed] = None
            self.replayed += 1
            self.communicated += 1
            return func(*args, **(kwargs or {}))
        out = (kwargs or {}).get("out", args[-1]) if what == "out" else None
        if value is None or (out is not None and value.shape != out.shape):
            raise RuntimeError(f"selective checkpointing: the recompute's compiled call {self.replayed} ({func}) is not "
                               f"the one the forward kept: the forward ran other graphs, or backward ran twice through "
                               f"this checkpoint")
        self.kept[self.replayed] = None  # freed as the recompute goes, as SAC frees its cache
        self.replayed += 1
        if out is None:
            return value
        out.copy_(value)
        return out


def selective_contexts():
    """``checkpoint``'s ``context_fn`` for op-level selective checkpointing (a fresh cache per call)."""
    caching, cached = create_selective_checkpoint_contexts(selective_policy)
    for mode, mixin in ((caching, KeepCompiledMatmuls), (cached, ReplayCompiledMatmuls)):
        mode.__class__ = subclass(mixin, subclass(SkipAnnotations, type(mode)))
    caching.kept = cached.kept = []
    caching.pending, caching.collectives = {}, 0
    _untrace_handlers()
    return caching, cached


@functools.cache
def _untrace_handlers() -> None:
    """Once, when a checkpoint first runs (importing this module imports no dynamo): the modes' handlers untraced."""
    for mixin in (KeepCompiledMatmuls, ReplayCompiledMatmuls, SkipAnnotations):
        untrace_dispatch(mixin)


def untrace_dispatch(cls: type) -> None:
    """Dynamo never traces ``cls.__torch_dispatch__`` nor what it calls: the ops of a compiled forward reach the SAC
    modes with dynamo's frame hook on, which took this file's handlers (not torch's, which it skips) for user code
    and compiled them, once per argument pattern, up to its recompile limit. Marked on the code object, no wrapper
    (a ``torch.compiler.disable`` wrapper cost every dispatched op: ~5% of an eager selective step on CPU); where
    this torch lacks the mark, the wrapper."""
    fn = cls.__dict__["__torch_dispatch__"]
    try:
        from torch._C._dynamo.eval_frame import set_code_exec_strategy
        from torch._dynamo.types import FrameAction, FrameExecStrategy
    except ImportError:
        cls.__torch_dispatch__ = torch.compiler.disable(fn)
        return
    set_code_exec_strategy(fn.__code__, FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP))


class SelectiveCheckpointed(Checkpointed):
    """Mixin: as ``Checkpointed``, keeping the outputs ``selective_policy`` chooses."""

    checkpoint_options = {"context_fn": selective_contexts}


def checkpointed(module: nn.Module, selective: bool = False) -> nn.Module:
    """Activation-checkpoint ``module`` in place: its class becomes ``Checkpointed<Class>`` (``selective``:
    ``SelectiveCheckpointed<Class>``). Idempotent: a module checkpointed already keeps its mode."""
    if not isinstance(module, Checkpointed):
        module.__class__ = subclass(SelectiveCheckpointed if selective else Checkpointed, type(module))
    return module


_SUBCLASSES: dict[tuple, type] = {}


def subclass(mixin: type, cls: type, attrs=None, key=()) -> type:
    """``<mixin><cls>``, the class with ``mixin`` before ``cls``; ``attrs(cls)`` -> its own attributes.
    One class per (mixin, cls, key): every module given the same treatment has the same class, which
    torch.compile guards on."""
    k = (mixin, cls, key)
    if k not in _SUBCLASSES:
        own = {"__module__": mixin.__module__, **(attrs(cls) if attrs else {})}
        _SUBCLASSES[k] = type(f"{mixin.__name__}{cls.__name__}", (mixin, cls), own)
    return _SUBCLASSES[k]
