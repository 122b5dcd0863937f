"""Grouped experts: every expert's MLP weights as one [E, ...] tensor, computed by a swappable backend.

Shape legend: N routed rows (expert-major, contiguous per expert), E experts, H hidden, F expert FFN.

    rows [N, H]   expert 0's rows | expert 1's rows | ... | expert E-1's rows   (counts [E] long)
    w_in  [E, H, F_in]   F_in = 2F for SwiGLU, laid out [gate | up] along the last dim; F otherwise
    w_out [E, F, H]
    b_in  [E, F_in], b_out [E, H]   optional per-expert biases (``GroupedExperts(bias=True)``, gpt-oss):
                                     h = rows_e @ w_in[e] + b_in[e], y = act(h) @ w_out[e] + b_out[e]

Rows past sum(counts) belong to no expert: their output is 0 and they get zero gradient. Every backend
treats out-of-range counts alike (:func:`counts_to_offs`): a negative count is 0, and the blocks stop
at row N, so counts summing past N truncate the last blocks.

A backend is a function ``fn(rows, counts, w_in, w_out, activation) -> [N, H]`` registered under a
name with a predicate saying whether it can run for given tensors; one registered with ``bias=True`` also
takes ``b_in=``, ``b_out=`` keywords (each None or the bias), and only such backends run experts with biases. ``"loop"`` is the obvious per-expert
loop and stays the reference; ``"torch"`` uses ``torch.nn.functional.grouped_mm`` where it runs;
``"triton"`` calls ``moe.kernels`` (GPU, or CPU under ``TRITON_INTERPRET=1``). ``"auto"`` takes the
first usable of triton, torch, loop on GPU (torch first for large experts: :func:`auto_order`), and the
loop on CPU (measured fastest there).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# ACTIVATIONS is re-exported for moe.layer: moe.activations is the one table of activations
from moekit.moe.activations import ACTIVATIONS, check_activation, ffn_in_features, get_activation  # noqa: F401
from moekit.moe.kernel_choice import mode_from_env, mode_problem
# the loop backend's arithmetic; these names stay importable from here
from moekit.moe.loop_experts import LOOP_FUSED_ACTIVATIONS, loop_blocks, loop_runs_fused, swiglu_into  # noqa: F401
from moekit.moe.precision import compute_dtype


def counts_to_offs(counts: Tensor, num_rows: int) -> Tensor:
    """int32 [E] cumulative row ends (torch.nn.functional.grouped_mm's ``offs``) of per-expert row counts.

    Defines how every backend reads out-of-range counts: a negative count is 0 and the ends are
    clamped to ``num_rows``, so the result is monotone within [0, num_rows] for any counts (no int32
    wrap-around, no cumsum overflow). Device ops only: no host sync.
    """
    ends = counts.to(torch.int64).clamp(0, num_rows).cumsum(0)
    return ends.clamp_(max=num_rows).to(torch.int32)


# ---------------------------------------------------------------------------------------------------
# Backend registry
# ---------------------------------------------------------------------------------------------------

BackendFn = Callable[[Tensor, Tensor, Tensor, Tensor, str], Tensor]

# Every parameter GroupedExperts can hold, each [E, ...] with the expert on dim 0: what expert parallelism
# shards, placement moves, the guard checks and the init fills (GroupedExperts.param_names(): those present).
# LoRA adapters (``GroupedExperts.add_lora``, moe/lora_experts.py) are expert stacks too: lora_a_in [E, H, r],
# lora_b_in [E, r, F_in], lora_a_out [E, F, r], lora_b_out [E, r, H].
LORA_EXPERT_PARAMS = ("lora_a_in", "lora_b_in", "lora_a_out", "lora_b_out")
EXPERT_PARAM_NAMES = ("w_in", "w_out", "b_in", "b_out") + LORA_EXPERT_PARAMS


@dataclass(frozen=True)
class ExpertBackend:
    name: str
    fn: BackendFn
    usable: Callable[[Tensor, Tensor, Tensor], bool]  # (rows, w_in, w_out) -> can this backend run them?
    why_not: Callable[[Tensor, Tensor, Tensor], str]  # human-readable reason when not usable
    bias: bool = False  # fn takes b_in= / b_out= (per-expert biases)
    fused: bool = False  # fn takes gather_index= / gather_slots= / row_scale= (moe.experts.FUSED_PERMUTE)


_BACKENDS: dict[str, ExpertBackend] = {}


def register_backend(name: str, usable=None, why_not=None, bias: bool = False, fused: bool = False):
    """Decorator: ``@register_backend("mine", usable=lambda rows, w_in, w_out: True)``; ``bias=True`` when
    the function takes the keyword arguments ``b_in`` and ``b_out`` (per-expert biases, or None);
    ``fused=True`` when it takes ``gather_index``, ``gather_slots`` and ``row_scale`` (moe.kernels.expert_mlp's
    meaning: rows is the unpermuted source and logical row r is rows[gather_index[r]]; each output row times its
    row_scale entry, after b_out)."""

    def deco(fn: BackendFn) -> BackendFn:
        _BACKENDS[name] = ExpertBackend(
            name, fn, usable or (lambda *a: True), why_not or (lambda *a: "not usable here"), bias, fused
        )
        return fn

    return deco


def available_backends() -> list[str]:
    return sorted(_BACKENDS) + ["auto"]


# On a GPU, experts at least this large (H x F elements per expert matrix) run faster on torch's grouped
# matmul (CUTLASS) than on moekit's Triton kernels; smaller ones the other way round. Measured on an H100,
# bf16, forward+backward (docs/benchmarks.md, "Second GPU round"): Mixtral-8x7B's 4096 x 14336 layer
# 1.12x faster on torch, DeepSeek-V3's 7168 x 2048 expert MLP 1.19x faster on torch (grouped_gemm.py);
# mixtral-1b's 1024 x 3072 trained 1.11x faster on Triton (train_mfu.py), Qwen3-30B-A3B's 2048 x 768 and
# the 1536 x 256 fine-grained layers 1.14x and 1.03x faster on Triton (moe_layer.py). The threshold
# sits between 3.1M and 14.7M.
LARGE_EXPERT_ELEMENTS = 1 << 23


def auto_order(device: torch.device, w_out: Tensor | None = None) -> tuple[str, ...]:
    """Fastest first. On CPU the per-expert loop wins on every shape measured (E 8 / F 512 / top-2,
    E 64 / F 128 / top-8 and top-6, fp32 and bf16, forward and backward): its blocks stay in cache for
    the elementwise work and MKL runs each GEMM well, while torch's CPU grouped_mm was 1.1-1.45x
    slower (tools/bench/cpu_layer.py, moe_layer.py); the interpreter is for tests only. On a GPU,
    Triton first, except for large experts (``w_out`` [E, F, H] with F x H >= LARGE_EXPERT_ELEMENTS),
    where torch's grouped matmul comes first. Triton keeps less activation memory (its fused MLP
    recomputes the activation: 0.73x of the torch backend's on Mixtral-8x7B); name it to keep that."""
    if device.type != "cuda":
        return ("loop",)
    if w_out is not None and w_out.shape[-2] * w_out.shape[-1] >= LARGE_EXPERT_ELEMENTS:
        return ("torch", "triton", "loop")
    return ("triton", "torch", "loop")


def resolve_backend(name: str, rows: Tensor, w_in: Tensor, w_out: Tensor, bias: bool = False) -> ExpertBackend:
    """Return the backend that will run, raising a clear error when the named one cannot. ``bias``: the
    experts have biases, which only backends registered with bias=True compute (never dropped silently)."""
    if name == "auto":
        for cand in auto_order(rows.device, w_out):
            b = _BACKENDS.get(cand)
            if b is not None and (b.bias or not bias) and b.usable(rows, w_in, w_out):
                return b
        return _BACKENDS["loop"]
    if name not in _BACKENDS:
        raise ValueError(f"expert backend {name!r} is unknown; use one of {available_backends()}")
    b = _BACKENDS[name]
    if bias and not b.bias:
        raise ValueError(f"expert backend {name!r} does not compute expert biases (GroupedExperts(bias=True), "
                         f"MoELayer(ffn_bias=True)); use one of {sorted(n for n, c in _BACKENDS.items() if c.bias)} "
                         f"or 'auto', or build the experts without bias")
    if not b.usable(rows, w_in, w_out):
        raise ValueError(
            f"expert backend {name!r} cannot run on {rows.device.type} with dtype {rows.dtype}: "
            f"{b.why_not(rows, w_in, w_out)}; use backend='auto' or 'loop'"
        )
    return b


# ---------------------------------------------------------------------------------------------------
# Built-in backends
# ---------------------------------------------------------------------------------------------------


@register_backend("loop", bias=True)
def loop_mlp(rows: Tensor, counts: Tensor, w_in: Tensor, w_out: Tensor, activation: str,
             b_in: Tensor | None = None, b_out: Tensor | None = None) -> Tensor:
    """One matmul pair per expert over its contiguous row block: obvious, and the reference (moe/loop_experts.py).

    SwiGLU and gpt-oss's swiglu_oai, with or without biases, run as one autograd function (``_LoopGLU``)
    whose forward and backward write every expert's block into preallocated outputs and gradients (a bias goes
    into its GEMM, addmm; its gradient is a column sum); other activations compose autograd ops. Both compute the
    same per-expert matmuls. On CPU the fused path runs independent experts concurrently, one thread each, where
    the shape gains (moe/expert_threads.py); the composite runs them one after another.
    """
    ends = counts_to_offs(counts, rows.shape[0]).tolist()  # D2H sync: the row blocks drive the loop
    sizes = [end - start for start, end in zip([0] + ends[:-1], ends)]
    return loop_blocks(rows, sizes, w_in, w_out, activation, b_in, b_out)


def _grouped_mm_why_not(rows: Tensor, w_in: Tensor, w_out: Tensor) -> str:
    if not hasattr(F, "grouped_mm"):
        return f"torch {torch.__version__} has no torch.nn.functional.grouped_mm"
    if rows.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return "torch grouped_mm takes float32, bfloat16 or float16 only"
    align = 16 // rows.element_size()  # every row stride must be a multiple of 16 bytes
    widths = (rows.shape[-1], w_in.shape[-1], w_out.shape[-1], w_out.shape[-2])
    if any(w % align for w in widths):
        return f"torch grouped_mm needs H, F multiples of {align} for {rows.dtype}, got {widths}"
    if rows.device.type == "cuda" and torch.cuda.get_device_capability(rows.device) < (8, 0):
        return "torch grouped_mm needs sm80 or newer"
    return ""


class _ExpertBiasRows(torch.autograd.Function):
    """bias [E, N] -> [M, N], row r = bias[expert of r] (0 for rows no expert owns), for backends whose GEMM
    has no bias epilogue. Backward: db[e] = the column sums of grad over e's rows as one [E, M] x [M, N]
    product with the rows' one-hot expert matrix, instead of index_select's backward (index_add_: atomics
    on CUDA, run-to-run different sums). Device ops only: no host sync."""

    @staticmethod
    def forward(ctx, bias: Tensor, offs: Tensor, num_rows: int) -> Tensor:
        rows = torch.arange(num_rows, device=bias.device)
        expert = torch.searchsorted(offs.to(torch.int64), rows, right=True)  # [M] in [0, E]; E: no expert
        ctx.save_for_backward(expert)
        ctx.num_experts = bias.shape[0]
        return torch.cat([bias, bias.new_zeros(1, bias.shape[1])]).index_select(0, expert)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (expert,) = ctx.saved_tensors
        onehot = expert[None, :] == torch.arange(ctx.num_experts, device=grad.device)[:, None]  # [E, M]
        # rows no expert owns may carry grouped_mm's undefined (even NaN) gradients: 0 * NaN would spread them
        grad = torch.where((expert < ctx.num_experts)[:, None], grad, 0)
        return onehot.to(grad.dtype) @ grad, None, None


def add_expert_bias(y: Tensor, bias: Tensor | None, offs: Tensor) -> Tensor:
    """y [M, N] + bias [E, N] of each row's expert (offs: int32 cumulative row ends, counts_to_offs); rows
    past offs[-1] unchanged. None: y itself."""
    return y if bias is None else y + _ExpertBiasRows.apply(bias.to(y.dtype), offs, y.shape[0])


@register_backend(
    "torch",
    usable=lambda r, wi, wo: _grouped_mm_why_not(r, wi, wo) == "",
    why_not=_grouped_mm_why_not,
    bias=True,
)
def torch_grouped_mlp(rows: Tensor, counts: Tensor, w_in: Tensor, w_out: Tensor, activation: str,
                      b_in: Tensor | None = None, b_out: Tensor | None = None) -> Tensor:
    """torch's grouped matmul: one call per projection over all experts, no host sync; the biases are added
    per row (add_expert_bias: grouped_mm has no bias epilogue)."""
    offs = counts_to_offs(counts, rows.shape[0])  # monotone within [0, N]: grouped_mm checks no values
    owned = None
    if rows.shape[0] > 0:  # rows past offs[-1] are undefined in grouped_mm, forward and backward: mask them
        owned = (torch.arange(rows.shape[0], device=rows.device) < offs[-1])[:, None]
        rows = torch.where(owned, rows, 0)  # their gradient is then exactly 0, not grouped_mm's garbage
    h = get_activation(activation)(add_expert_bias(F.grouped_mm(rows, w_in, offs=offs), b_in, offs))
    out = add_expert_bias(F.grouped_mm(h, w_out, offs=offs), b_out, offs)
    return out if owned is None else torch.where(owned, out, 0)


def _triton_why_not(rows: Tensor, w_in: Tensor, w_out: Tensor) -> str:
    try:
        from moekit.moe import kernels
    except ImportError as exc:  # triton missing on this platform
        return f"moekit.moe.kernels cannot be imported ({exc})"
    return kernels.why_not_triton(rows, w_in, w_out)


@register_backend(
    "triton",
    usable=lambda r, wi, wo: _triton_why_not(r, wi, wo) == "",
    why_not=_triton_why_not,
    bias=True,
    fused=True,
)
def triton_mlp(rows: Tensor, counts: Tensor, w_in: Tensor, w_out: Tensor, activation: str,
               b_in: Tensor | None = None, b_out: Tensor | None = None, gather_index: Tensor | None = None,
               gather_slots: Tensor | None = None, row_scale: Tensor | None = None) -> Tensor:
    from moekit.moe import kernels

    return kernels.expert_mlp(rows, counts, w_in, w_out, activation, b_in=b_in, b_out=b_out,
                              gather_index=gather_index, gather_slots=gather_slots, row_scale=row_scale)


def _float8_why_not(rows: Tensor, w_in: Tensor, w_out: Tensor) -> str:
    from moekit.moe import float8  # imported on use: moe.float8 imports this module

    return float8.why_not_float8(rows, w_in, w_out)


@register_backend(
    "float8",
    usable=lambda r, wi, wo: _float8_why_not(r, wi, wo) == "",
    why_not=_float8_why_not,
)
def float8_mlp(rows: Tensor, counts: Tensor, w_in: Tensor, w_out: Tensor, activation: str) -> Tensor:
    """fp8 e4m3 GEMMs with rowwise scales (moe/float8.py, docs/float8.md); never chosen by "auto"."""
    from moekit.moe import float8

    return float8.float8_mlp(rows, counts, w_in, w_out, activation)


# Where MoELayer leaves the permute to the expert GEMMs (ScatterMoE-style), for a backend that takes it (triton):
#  - the gather into the first (moe.dispatch.RowGather): the kernels read each routed row from the layer input in
#    place, so the [N, H] = [T k, H] permuted copy is neither written nor kept for backward (k times the layer
#    input). The local dispatcher's permute, and expert parallelism's reorder of the received rows (flat, or
#    hierarchical: its intra-node exchange's);
#  - the combine's routing weights into the last (row_scale): its epilogue scales each row, the combine becomes a
#    plain sum that keeps no [N, H] expert outputs for the weights' gradient, which the backward kernel's epilogue
#    gives instead. The local dispatcher, and expert parallelism flat or hierarchical (the weights travel with the
#    rows, one fp32 each); an output bias (gpt-oss) is added first and scaled with its row, as the weighted combine
#    would scale it.
# "auto": CUDA tensors; "always": CPU tensors too (the Triton interpreter: tests); "never": the permuted copy and
# the weighted combine. The gathered rows cannot go through TMA descriptors (the weights still do). Unset, "never"
# for now: it has not been timed on a GPU (docs/benchmarks.md, "After the fifth round"); it starts as
# MOEKIT_FUSED_PERMUTE says.
FUSED_PERMUTE_ENV = "MOEKIT_FUSED_PERMUTE"
FUSED_PERMUTE = mode_from_env(FUSED_PERMUTE_ENV, "never")


def fused_permute_problem() -> str:
    """"" or what is wrong with FUSED_PERMUTE (set from MOEKIT_FUSED_PERMUTE): the trainer checks it at start-up."""
    return mode_problem("moe.experts.FUSED_PERMUTE", FUSED_PERMUTE, FUSED_PERMUTE_ENV)


# ---------------------------------------------------------------------------------------------------
# Module
# ---------------------------------------------------------------------------------------------------


def lora_scale(rank: int, alpha: float, rslora: bool = False) -> float:
    """LoRA adapters' output scale: alpha / rank, or alpha / sqrt(rank) for rank-stabilized LoRA (``rslora``)."""
    return float(alpha) / (math.sqrt(rank) if rslora else rank)


class GroupedExperts(nn.Module):
    """E expert MLPs stored as [E, ...] tensors so one grouped GEMM serves all of them.

    ``forward(rows [N, H], counts [E]) -> [N, H]`` where rows are expert-major (see module docstring).
    Expert parallelism shards dim 0 of every parameter (``param_names()``); initialisation always fills the
    full [E, ...] tensor from the generator first, so a shard equals the same slice of an unsharded init.
    ``bias``: per-expert biases ``b_in`` [E, F_in] and ``b_out`` [E, H] (gpt-oss), zero-initialised; off (the
    default) registers them as None: no parameters, no state-dict keys, the same numerics as before.
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        ffn_hidden_size: int,
        activation: str = "swiglu",
        backend: str = "auto",
        device=None,
        dtype=None,
        bias: bool = False,
    ):
        super().__init__()
        check_activation(activation)
        for name, v in (("num_experts", num_experts), ("hidden_size", hidden_size), ("ffn_hidden_size", ffn_hidden_size)):
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name}={v!r} must be a positive integer")
        if backend not in _BACKENDS and backend != "auto":
            raise ValueError(f"expert backend {backend!r} is unknown; use one of {available_backends()}")
        if not isinstance(bias, bool):
            raise ValueError(f"bias={bias!r} is invalid; it must be True (per-expert biases b_in, b_out) or False")
        self.num_experts, self.hidden_size, self.ffn_hidden_size = num_experts, hidden_size, ffn_hidden_size
        self.activation, self.backend, self.bias = activation, backend, bias
        f_in = ffn_in_features(activation, ffn_hidden_size)
        kw = dict(device=device, dtype=dtype)
        self.w_in = nn.Parameter(torch.empty(num_experts, hidden_size, f_in, **kw))
        self.w_out = nn.Parameter(torch.empty(num_experts, ffn_hidden_size, hidden_size, **kw))
        for name, shape in (("b_in", (num_experts, f_in)), ("b_out", (num_experts, hidden_size))):
            self.register_parameter(name, nn.Parameter(torch.empty(shape, **kw)) if bias else None)
        self.lora_rank, self.lora_scale, self.lora_sides, self.lora_dropout = 0, 0.0, (), 0.0
        for name in LORA_EXPERT_PARAMS:
            self.register_parameter(name, None)
        self.reset_parameters()

    def add_lora(self, rank: int, alpha: float, sides: tuple[str, ...] = ("in", "out"), rslora: bool = False,
                 dropout: float = 0.0) -> None:
        """Low-rank adapters on the expert projections (LoRA, Hu et al. 2021), per expert: ``w_in[e]`` acts as
        ``w_in[e] + (alpha / rank) lora_a_in[e] @ lora_b_in[e]`` and ``w_out[e]`` likewise (``sides``: which of the
        two; ``rslora``: alpha / sqrt(rank), ``lora_scale``; ``dropout``: while training each adapter reads its rows
        with elements zeroed at that rate, moe.lora_dropout). The A factors start N(0, 1/fan_in), the B factors at 0,
        so the experts compute what they did; the adapters are [E, ...] stacks like the weights (expert parallelism shards them, placement moves them).
        moe/lora_experts.py computes them without forming the merged weights."""
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
            raise ValueError(f"LoRA rank={rank!r} is invalid; it must be an integer >= 1")
        if not (isinstance(alpha, (int, float)) and math.isfinite(alpha) and alpha > 0):
            raise ValueError(f"LoRA alpha={alpha!r} is invalid; it must be a finite number > 0")
        if not sides or any(s not in ("in", "out") for s in sides):
            raise ValueError(f"LoRA sides={sides!r} is invalid; name 'in' (w_in), 'out' (w_out) or both")
        if self.lora_rank:
            raise ValueError("these experts already carry LoRA adapters")
        from moekit.moe.lora_dropout import check_dropout

        dropout = check_dropout(dropout)
        E, H, F_ = self.num_experts, self.hidden_size, self.ffn_hidden_size
        f_in = self.w_in.shape[-1]
        kw = dict(device=self.w_in.device, dtype=self.w_in.dtype)
        shapes = {"in": (("lora_a_in", (E, H, rank)), ("lora_b_in", (E, rank, f_in))),
                  "out": (("lora_a_out", (E, F_, rank)), ("lora_b_out", (E, rank, H)))}
        self.lora_rank, self.lora_scale, self.lora_sides = rank, lora_scale(rank, alpha, rslora), tuple(sides)
        self.lora_dropout = dropout
        for side in ("in", "out"):
            if side in sides:
                for name, shape in shapes[side]:
                    setattr(self, name, nn.Parameter(torch.empty(shape, **kw)))
        self.reset_lora()

    def reset_lora(self, generator: torch.Generator | None = None) -> None:
        """A factors N(0, 1/fan_in), B factors 0 (models.init fills them layout-invariantly instead)."""
        if not self.lora_rank or self.w_in.is_meta:
            return
        with torch.no_grad():
            for a, b in (("lora_a_in", "lora_b_in"), ("lora_a_out", "lora_b_out")):
                A, B = getattr(self, a), getattr(self, b)
                if A is None:
                    continue
                gen_device = generator.device if generator is not None else A.device
                std = 1.0 / math.sqrt(A.shape[1])
                A.copy_(torch.empty(A.shape, device=gen_device, dtype=A.dtype).normal_(0.0, std, generator=generator))
                B.zero_()

    def param_names(self) -> tuple[str, ...]:
        """The expert parameters this module holds, in EXPERT_PARAM_NAMES order: w_in, w_out (+ b_in, b_out)."""
        return tuple(n for n in EXPERT_PARAM_NAMES if getattr(self, n, None) is not None)

    def reset_parameters(self, std_in: float | None = None, std_out: float | None = None,
                         generator: torch.Generator | None = None) -> None:
        """Normal init: std 1/sqrt(H) into the experts, 1/sqrt(F) out unless given (models pass theirs)."""
        std_in = std_in if std_in is not None else 1.0 / math.sqrt(self.hidden_size)
        std_out = std_out if std_out is not None else 1.0 / math.sqrt(self.ffn_hidden_size)
        if self.w_in.is_meta:
            return
        with torch.no_grad():  # drawn where the generator lives, then copied: same numbers on any device
            gen_device = generator.device if generator is not None else self.w_in.device
            for w, std in ((self.w_in, std_in), (self.w_out, std_out)):
                w.copy_(torch.empty(w.shape, device=gen_device, dtype=w.dtype).normal_(0.0, std, generator=generator))
            for b in (self.b_in, self.b_out):  # biases start at 0 (nn.Linear's uniform would depend on F / H)
                if b is not None:
                    b.zero_()

    def _local_params(self) -> list[Tensor]:
        """The parameters this rank computes with. Under expert parallelism the weights may be DTensors sharded
        over experts (comm.expert_parallel): the local [E_local, ...] block. Duck-typed: moe/ never imports
        distributed."""
        return [p.to_local() if hasattr(p, "to_local") else p for p in (getattr(self, n) for n in self.param_names())]

    def _local_named(self) -> dict[str, Tensor]:
        return dict(zip(self.param_names(), self._local_params()))

    def takes_gather(self, rows: Tensor) -> bool:
        """Whether forward(..., gather=) will read these rows in place (and forward(..., row_scale=) scale them:
        takes_row_scale): FUSED_PERMUTE allows it on rows' device and the backend that
        would run on them takes it (moe.dispatch.LocalDispatcher.dispatch fuse_gather)."""
        if FUSED_PERMUTE == "never" or (FUSED_PERMUTE == "auto" and rows.device.type != "cuda") or self.lora_rank:
            return False
        if FUSED_PERMUTE not in ("auto", "always"):
            raise ValueError(fused_permute_problem())
        dtype = compute_dtype(rows)  # what forward computes in; only shape, dtype and device matter to the choice
        rows, w_in, w_out = (torch.empty((), dtype=dtype, device=t.device).expand(t.shape)
                             for t in (rows, *self._local_params()[:2]))
        return resolve_backend(self.backend, rows, w_in, w_out, bias=self.bias).fused

    def takes_row_scale(self, rows: Tensor) -> bool:
        """Whether forward(..., row_scale=) scales the output rows in the backend's last GEMM (after the output bias,
        as the weighted combine scales the biased rows): the same as takes_gather."""
        return self.takes_gather(rows)

    def forward(self, rows: Tensor, counts: Tensor, gather=None, row_scale: Tensor | None = None) -> Tensor:
        """rows [N, H] expert-major -> [N, H]. ``gather`` (moe.dispatch.RowGather, when takes_gather said so):
        rows is instead the unpermuted source [T, H], logical row r = rows[gather.index[r]], output [N, H].
        ``row_scale`` [N] (when takes_row_scale said so): output row r times row_scale[r], differentiable in it."""
        if rows.dim() != 2 or rows.shape[-1] != self.hidden_size:
            raise ValueError(f"rows must be [N, {self.hidden_size}], got {tuple(rows.shape)}")
        named = self._local_named()
        w_in = named["w_in"]
        if counts.shape != (w_in.shape[0],):
            raise ValueError(f"counts must be [{w_in.shape[0]}] (one per local expert), got {tuple(counts.shape)}")
        rows = rows.to(compute_dtype(rows))  # autocast: every backend computes in the autocast dtype
        if rows.dtype != w_in.dtype:  # e.g. fp32 master weights under bf16 autocast
            named = {n: p.to(rows.dtype) for n, p in named.items()}
        params = list(named.values())
        w_in, w_out, b_in, b_out = (named.get(n) for n in ("w_in", "w_out", "b_in", "b_out"))
        if self.lora_rank:
            if gather is not None or row_scale is not None:
                raise ValueError("experts with LoRA adapters cannot read rows in place or scale them; ask "
                                 "takes_gather / takes_row_scale first")
            from moekit.moe.lora_experts import lora_mlp

            out = lora_mlp(rows, counts, named, self.activation, self.lora_scale, self.backend,
                           dropout=self.lora_dropout if self.training else 0.0)
        else:
            out = self._backend_forward(rows, counts, w_in, w_out, b_in, b_out, gather, row_scale)
        if torch.is_grad_enabled() and not out.requires_grad and (rows.requires_grad or any(p.requires_grad for p in params)):
            # No rows reached these experts, so the backend built no graph. Tie the (empty or zero) output
            # to the weights anyway: under expert parallelism the collectives in backward must run on
            # every rank, including one whose experts received nothing (else its peers hang).
            out = out + sum(p.flatten()[:1].sum() for p in params).to(out.dtype) * 0
        return out

    def _backend_forward(self, rows, counts, w_in, w_out, b_in, b_out, gather, row_scale) -> Tensor:
        backend = resolve_backend(self.backend, rows, w_in, w_out, bias=self.bias)
        kw = dict(b_in=b_in, b_out=b_out) if self.bias else {}  # backends without bias: the original call
        if gather is not None or row_scale is not None:
            if not backend.fused:
                raise ValueError(f"expert backend {backend.name!r} cannot "
                                 f"{'read rows in place (a RowGather)' if gather is not None else 'scale its rows'}; "
                                 f"ask takes_gather / takes_row_scale first")
            if gather is not None:
                kw.update(gather_index=gather.index, gather_slots=gather.slots)
            if row_scale is not None:
                kw.update(row_scale=row_scale.to(torch.float32).contiguous())
        return backend.fn(rows, counts, w_in, w_out, self.activation, **kw)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden={self.hidden_size}, ffn={self.ffn_hidden_size}, "
                f"activation={self.activation}, backend={self.backend}" + (", bias=True" if self.bias else "")
                + (f", lora_rank={self.lora_rank}, lora_scale={self.lora_scale:g}" if self.lora_rank else "")
                + (f", lora_dropout={self.lora_dropout:g}" if self.lora_dropout else ""))
