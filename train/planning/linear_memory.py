"""What one Gated DeltaNet layer keeps for backward (models.linear_attention; the planner's attention term of a
linear layer), counted by running the layer itself on fake tensors.

The chunked delta rule keeps a few dozen tensors whose sizes depend on the chunk count, the padding and the dtype
each step runs in, so instead of a formula the planner runs one forward of a GatedDeltaNet of the model's sizes
under torch's FakeTensorMode (shapes and dtypes only: no memory, no arithmetic) with the workload's batch, sequence
length, document masking and precision (autocast over fp32 weights, or bf16 weights), and adds up the storages autograd saves
(saved_tensors_hooks), each once, the layer's parameters excluded. The layer's input, the attention norm's output,
is among them (the projections save it, or under autocast its one bf16 copy), as the GQA term counts it.

Under context parallelism the run is one rank's: its S / cp positions as two zigzag chunks, each chunk's affine
map, the all-gathers stood in by copies of the rank's own part (``_LocalContext``).

The fake run dispatches as the CPU does. On CUDA the gated RMSNorm's fused kernel keeps its input and the rsqrt,
not the CPU composite's x * rsqrt product [T, Nv dv]: that product is subtracted there.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import warnings

import torch

from moekit.models.config import ModelConfig
from moekit.train.planning.shapes import Shapes

# the ModelConfig fields a GatedDeltaNet is built from
FIELDS = ("hidden_size", "norm_eps", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
          "linear_value_head_dim", "linear_conv_kernel", "linear_chunk", "linear_recompute")


def _local(cfg: ModelConfig, tp: int) -> ModelConfig:
    """The layer one of ``tp`` tensor-parallel ranks computes: its 1 / tp of the key and value heads (the fused
    projection's rows it reads, comm.tensor_parallel), as a layer of its own."""
    if tp == 1:
        return cfg
    return dataclasses.replace(cfg, linear_num_key_heads=cfg.linear_num_key_heads // tp,
                               linear_num_value_heads=cfg.linear_num_value_heads // tp)


def linear_attention_kept(cfg: ModelConfig, s: Shapes, tp: int = 1) -> int:
    """Bytes one Gated DeltaNet layer keeps for backward on a micro-batch of ``s`` (module docstring), on one of
    ``tp`` tensor-parallel ranks."""
    cfg = _local(cfg, tp)
    key = tuple((name, getattr(cfg, name)) for name in FIELDS)
    # a bf16 residual stream (FSDP's bf16 parameters, or train.residual_dtype under autocast) feeds a bf16 input
    kept = _saved_bytes(key, s.B, s.S, s.r == 2, s.autocast, s.documents, s.cp, s.cp_rank or 0)
    if s.autocast:  # the convolution's weight cast (3-d: not among the matmul weights memory.weight_casts counts)
        kept += (2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim + cfg.linear_num_value_heads
                 * cfg.linear_value_head_dim) * cfg.linear_conv_kernel * s.a
    if not s.cpu:  # the CUDA fused RMSNorm keeps no x * rsqrt product
        kept -= s.T * cfg.linear_num_value_heads * cfg.linear_value_head_dim * s.r
    if tp > 1 and not s.autocast:  # the convolution's weight is this rank's rows, gathered: a copy it keeps (under
        # autocast its cast, counted above, is that copy)
        kept += (2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim + cfg.linear_num_value_heads
                 * cfg.linear_value_head_dim) * cfg.linear_conv_kernel * s.w
    return kept


class _LocalContext:
    """Stands in for comm.context_parallel.ContextParallel in the fake run: rank ``index`` of ``degree``, its
    all-gathers ``degree`` copies of its own part (the shapes a real gather returns; its autograd saves nothing
    either). The rank matters: the state scan past a rank's last chunk feeds nothing there and is freed."""

    def __init__(self, degree: int, index: int):
        from moekit.comm.context_parallel import ContextParallel

        self._cp = ContextParallel(degree, index)
        self.degree = degree

    def chunks(self, local_len: int):
        return self._cp.chunks(local_len)

    def positions(self, local_len: int, device=None):
        return self._cp.positions(local_len, device)

    def gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        return self._cp._gather(t, dim, lambda x, d, group: torch.cat([x] * self.degree, d))


def linear_rule_transient(cfg: ModelConfig, s: Shapes, tp: int = 1) -> int:
    """What backward allocates again when it runs a Gated DeltaNet layer's chunks anew (model.linear_recompute): the
    chunk tensors the forward did not keep, alive while that layer's backward runs (0 without recompute, and under
    context parallelism, whose affine chunks keep theirs)."""
    if not cfg.linear_recompute or s.cp > 1:
        return 0
    cfg = _local(cfg, tp)
    whole = dict(((name, getattr(cfg, name)) for name in FIELDS), linear_recompute=False)
    kept = dict((name, getattr(cfg, name)) for name in FIELDS)
    return (_saved_bytes(tuple(whole.items()), s.B, s.S, s.r == 2, s.autocast, s.documents)
            - _saved_bytes(tuple(kept.items()), s.B, s.S, s.r == 2, s.autocast, s.documents))


def _saved_bytes(key: tuple, B: int, S: int, bf16_input: bool, autocast: bool, documents: bool = False,
                 cp: int = 1, cp_rank: int = 0) -> int:
    """The bytes of one fake forward at sequence length S (module docstring). Every kept tensor is per position,
    per rule chunk or of a fixed size, so for lengths S' = S - m U (U = 2 cp L: each rank chunk shorter by whole
    rule chunks, the same remainders) the bytes are linear in S'; long sequences are fitted from two short runs
    instead of running thousands of fake chunks (exact: tests/test_linear_attention.py)."""
    unit = 2 * cp * dict(key)["linear_chunk"]
    small = S % unit + 2 * unit
    args = (key, B, bf16_input, autocast, documents, cp, cp_rank)
    if S <= small + unit:
        return _fake_run(S, *args)
    a, b = _fake_run(small, *args), _fake_run(small + unit, *args)
    return a + (b - a) * ((S - small) // unit)


@functools.lru_cache(maxsize=128)
def _fake_run(S: int, key: tuple, B: int, bf16_input: bool, autocast: bool, documents: bool, cp: int,
              cp_rank: int) -> int:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from moekit.models.linear_attention import GatedDeltaNet

    cfg = ModelConfig(**dict(key))
    dtype = torch.bfloat16 if bf16_input else torch.float32  # the residual stream's: the layer's input
    default = torch.get_default_dtype()
    # the parameters' dtype (set as the default: a dry run's conversions would swap parameters): the input's without
    # autocast (bf16: FSDP's bf16 parameters). Under autocast
    # they are built in bf16 too: autocast then casts no weight, whose bf16 copies the planner counts apart
    # (weight_casts); the convolution's, which that count leaves out, is added by the caller
    torch.set_default_dtype(torch.bfloat16 if autocast else dtype)
    try:
        with FakeTensorMode(), torch.device("cpu"):
            layer = GatedDeltaNet(cfg)
            if cp > 1:  # this rank's S / cp positions; the documents are the whole sequence's
                layer.context_parallel = _LocalContext(cp, cp_rank)
            # not a leaf, as the attention norm's output is (autocast caches the casts of leaves only: were it one,
            # the run would miss the bf16 copy GatedDeltaNet makes of it for its four projections)
            x = torch.empty(B, S // cp, cfg.hidden_size, dtype=dtype, requires_grad=True) * 1.0
            segments = torch.zeros(B, S, dtype=torch.int32) if documents else None  # models.attention's dtype
            return _run(layer, x, autocast, segments)
    finally:
        torch.set_default_dtype(default)


@contextlib.contextmanager
def new_objects_gc():
    """Inside, ``gc.collect()`` examines only the objects made inside: the heap from before is frozen (gc.freeze), so
    collecting the garbage a forward made costs what that forward made, not a walk over every object of the process
    (torch's modules and the caller's: ~0.25 s per full collection in a process that has imported transformers,
    10 us frozen). Garbage that holds a storage made inside is made of objects made inside. A process that froze
    objects of its own keeps them frozen: then nothing is frozen here, and a collection walks everything as before."""
    ours = gc.get_freeze_count() == 0
    if ours:
        gc.freeze()
    try:
        yield
    finally:
        if ours:
            gc.unfreeze()


def _run(layer, x: torch.Tensor, autocast: bool, segments: torch.Tensor | None = None) -> int:
    """Bytes of the distinct storages autograd saves in layer(x) and still holds once the output is gone (a node
    the output does not reach is freed with its saved tensors), the parameters' excluded."""
    from torch.multiprocessing.reductions import StorageWeakRef

    params = {p.untyped_storage()._cdata for p in layer.parameters()}
    seen: dict[int, tuple[StorageWeakRef, int]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage._cdata not in params:
            seen[storage._cdata] = (StorageWeakRef(storage), storage.nbytes())
        return t

    with new_objects_gc():
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's notes on the bf16 stand-in weights: nothing for the user
            out = layer(x, segments=segments)
        held = out.grad_fn  # the graph stays; the output tensor itself is the next layer's, not this one's
        del out
        gc.collect()
    total = sum(n for ref, n in seen.values() if not ref.expired())
    del held
    return total


def linear_attention_selective(cfg: ModelConfig, s: Shapes) -> int:
    """What an op-level selective checkpoint caches of a Gated DeltaNet layer (models.parallelize.SAVED_OPS): its
    projections' outputs (wqkv, wz, wb, wa, wo); the convolution, the delta rule's batched products and every
    elementwise step are recomputed."""
    Nv, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
    C = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim + Nv * dv
    return s.T * (C + Nv * dv + 2 * Nv + cfg.hidden_size) * s.a
