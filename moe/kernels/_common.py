"""Shared plumbing for the Triton expert kernels: mode detection, validation, shared kernel pieces
(tile scheduling, gather, the K loop), launcher helpers, autotune wrapping.

Interpreter mode is decided when ``triton`` is first imported: Triton's own library functions
(``tl.cdiv``, ``tl.sum``, ``tl.cumsum``, ...) are decorated then, for the interpreter only if
``TRITON_INTERPRET=1`` was already set. :func:`interpret_mode` therefore reports how Triton *will*
run (by inspecting ``tl.cdiv``), and the CPU path additionally requires the variable to be set now,
so unsetting it turns the CPU path off again. :class:`Kernel` refuses to launch a kernel whose own
decoration disagrees with that mode (the variable changed between ``import triton`` and
``import moe.kernels``), instead of failing deep inside Triton.

Out-of-range values (one semantics for every kernel, reference and expert backend; docs/kernels.md):
  * offsets: expert e owns rows ``end[e-1]:end[e]`` with ``end[e] = clamp(max(offs[:e+1]), 0, M)``
    (``end[-1] = 0``), i.e. each end is clamped to [previous end, M]. A negative or decreasing offset
    gives an empty group, one past M stops at M; rows at or past ``end[E-1]`` belong to no expert:
    their output is 0 and they get zero gradient.
  * gather indices: a logical row whose index is outside [0, M_x) reads a zero row, and its gradient
    is dropped (x gets none from it).
The Triton kernels apply this on device (no value check, which would need a host sync), the
references with host loops: they agree for any values.
"""
from __future__ import annotations

import collections
import warnings
import contextlib
import json
import os
import re
from typing import Callable, Sequence

import torch
import triton
import triton.language as tl

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_SUPPORTED_NAMES = "float32/bfloat16/float16"

# What a launch raises when a kernel cannot be built on this machine (a compile error in this Triton
# version, a config the GPU cannot hold). moe.dispatch and models.rope catch it for their optional
# kernels (combine, RoPE) and fall back to torch, once, with a warning.
try:
    from triton.runtime.errors import TritonError as _TritonError

    BUILD_ERRORS: tuple = (_TritonError,)
except ImportError:  # pragma: no cover  (older Triton: the two it has always had)
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources

    BUILD_ERRORS = (CompilationError, OutOfResources)


def build_failure(exc: BaseException) -> str:
    """One line naming a BUILD_ERRORS exception: its type and the first line of its message."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:200] if text else ''}"


def record_build_failure(exc: BaseException, failures: list, where: str, kernel: str, fallback: str, switch: str,
                         stacklevel: int = 3) -> None:
    """After a BUILD_ERRORS exception on a Triton path with a torch twin: remember why in ``failures`` (the caller's
    list: later calls skip the kernel) and warn once that ``fallback`` (e.g. "the torch router runs") does the work
    instead, naming the ``switch`` that chooses it without the warning. ``stacklevel``: as the caller's warn would."""
    failures.append(build_failure(exc))
    warnings.warn(f"{where}: the {kernel} failed to build here ({failures[-1]}); {fallback} instead. Set {switch} = "
                  f"'never' to choose that without this warning.", stacklevel=stacklevel + 1)

# Incremented by every launcher right before it launches: tests use it to prove the Triton path (not
# the torch fallback) ran. Keys are kernel names.
LAUNCHES: collections.Counter = collections.Counter()

# Set by moe.kernels._compile_check: launchers then record (kernel, args, kwargs) instead of
# launching, and accept CPU tensors, so kernels can be compiled for a GPU target on a CPU-only box.
CAPTURE: list | None = None


def interpret_mode() -> bool:
    """True when Triton launches go to the interpreter: triton was imported under TRITON_INTERPRET=1."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.cdiv, InterpretedFunction)


def interpret_requested() -> bool:
    """TRITON_INTERPRET as set right now (read by triton.knobs at each access)."""
    return bool(triton.knobs.runtime.interpret)


def why_not_triton_tensors(*tensors: torch.Tensor) -> str:
    """"" when the Triton kernels can run on these tensors, else a short reason naming the fix."""
    t0 = tensors[0]
    for t in tensors[1:]:
        if t.device != t0.device:
            return f"all tensors must be on one device, got {t0.device} and {t.device}"
        if t.dtype != t0.dtype:
            return f"all tensors must share one dtype, got {t0.dtype} and {t.dtype}"
    if t0.dtype not in SUPPORTED_DTYPES:
        return f"dtype {str(t0.dtype).removeprefix('torch.')} is not supported by the Triton kernels; use {_SUPPORTED_NAMES}"
    if t0.device.type == "cuda":
        if t0.dtype == torch.bfloat16 and torch.cuda.get_device_capability(t0.device) < (8, 0):
            return "bfloat16 Triton kernels need an sm80+ GPU; use float16 or float32 here"
        return ""
    if t0.device.type == "cpu":
        if not interpret_requested():
            return "Triton needs a CUDA device or TRITON_INTERPRET=1 (the slow CPU interpreter, for tests)"
        if not interpret_mode():
            return ("TRITON_INTERPRET=1 was set after triton was imported in compiled mode; "
                    "set it before the first `import triton`")
        return ""
    return f"Triton kernels run on CUDA tensors (or CPU under TRITON_INTERPRET=1), got device {t0.device.type}"


def check_triton_tensors(what: str, *tensors: torch.Tensor) -> None:
    if CAPTURE is not None:
        return
    reason = why_not_triton_tensors(*tensors)
    if reason:
        raise ValueError(f"{what}: {reason}")


def check_offs(offs: torch.Tensor, num_groups: int, device: torch.device, num_rows: int, what: str) -> torch.Tensor:
    """Validate the cumulative-offsets tensor's metadata and return it as contiguous int32.

    Values are not checked (that would need a sync): the kernels clamp them (module docstring). A
    wider dtype is clamped to [0, num_rows] before the cast, which leaves the clamped semantics
    unchanged but keeps e.g. 2**32 + 5 from wrapping around to 5.
    """
    if not isinstance(offs, torch.Tensor):
        raise ValueError(f"{what}: offs must be a tensor of cumulative row ends, got {type(offs).__name__}")
    if offs.dim() != 1 or offs.shape[0] != num_groups:
        raise ValueError(f"{what}: offs must be [E={num_groups}] cumulative row ends, got shape {tuple(offs.shape)}")
    if offs.dtype.is_floating_point or offs.dtype.is_complex or offs.dtype == torch.bool:
        raise ValueError(f"{what}: offs must be an integer tensor (int32), got {offs.dtype}")
    if offs.device != device:
        raise ValueError(f"{what}: offs is on {offs.device} but the operands are on {device}; move it there")
    if offs.dtype != torch.int32:  # tiny device ops, not a sync
        offs = offs.to(torch.int64).clamp(0, num_rows).to(torch.int32)
    return offs.contiguous()


def check_gather_index(gather_index: torch.Tensor | None, device: torch.device, what: str) -> None:
    if gather_index is None:
        return
    if not isinstance(gather_index, torch.Tensor) or gather_index.dim() != 1:
        raise ValueError(f"{what}: gather_index must be a 1-D int64 tensor of row indices into x")
    if gather_index.dtype != torch.int64:
        raise ValueError(f"{what}: gather_index must be int64, got {gather_index.dtype}; use .long()")
    if gather_index.device != device:
        raise ValueError(f"{what}: gather_index is on {gather_index.device}, x on {device}; move it there")


def gather_rows_ref(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x[index] where indices outside [0, len(x)) read a zero row (and pass no gradient back to x)."""
    valid = (index >= 0) & (index < x.shape[0])
    padded = torch.cat([x, x.new_zeros(1, x.shape[1])])  # row len(x) is the zero row
    return padded[torch.where(valid, index, x.shape[0])]


def dot_precision(dtype: torch.dtype, allow_tf32: bool) -> str:
    """fp32 defaults to exact-ish IEEE products so results match a float64 reference tightly."""
    return "tf32" if (dtype == torch.float32 and allow_tf32) else "ieee"


def interp_bf16(dtype: torch.dtype) -> bool:
    """The INTERP_BF16 kernel flag: bf16 data in the interpreter, which gets bf16 wrong twice.

    The Triton 3.9 interpreter (1) feeds bf16 storage (uint16 bit patterns) straight to np.matmul,
    multiplying the bit patterns as integers, and (2) truncates fp32->bf16 casts where GPUs round to
    nearest even. Under the flag the kernels upcast bf16 dot operands to fp32 (exact) and round by
    hand (:func:`to_out`), so interpreter results model what the GPU computes. Never set on GPU.
    """
    return dtype == torch.bfloat16 and interpret_mode()


@triton.jit
def to_out(x, DTYPE: tl.constexpr, INTERP_BF16: tl.constexpr):
    """Cast an fp32 tile to the output dtype (rounding bf16 to nearest even by hand, see interp_bf16)."""
    if INTERP_BF16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)  # RNE: add half an ulp, ties to the even neighbour
        x = ((bits >> 16) << 16).to(tl.float32, bitcast=True)  # exact in bf16: truncation is now harmless
    return x.to(DTYPE)


# ---------------------------------------------------------------------------------------------------
# Kernel pieces shared by the GEMM kernels. Triton inlines a @triton.jit function into the kernel that
# calls it (constexpr arguments pass through), so these cost nothing at run time. They are decorated in
# the same `import moe.kernels` as the kernels, hence for the same mode (the one Kernel checks).
# ---------------------------------------------------------------------------------------------------


@triton.jit
def swizzle_pid(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) in grouped launch order: GROUP_M consecutive tiles along m walk one n strip together,
    so that strip (and those m tiles' operand rows) stay hot in L2."""
    num_pid_in_group = GROUP_M * num_pid_n
    first_pid_m = (pid // num_pid_in_group) * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (pid % num_pid_in_group) % group_size_m
    pid_n = (pid % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def expert_row_bounds(OFFS, M, E, E_POW2: tl.constexpr):
    """(eids, starts, ends), each [E_POW2]: expert e owns rows starts[e]:ends[e], the offsets made
    monotone and clamped to [0, M] as the module docstring defines (ends[e] = clamp(max(offs[:e+1]),
    0, M), starts[e] = ends[e-1]). Entries e >= E are empty groups at ends[E-1]. Only offs[:E] is read.
    """
    eids = tl.arange(0, E_POW2)
    prev = tl.load(OFFS + eids - 1, mask=(eids > 0) & (eids <= E), other=0)  # offs[e-1]; 0 for e = 0
    starts = tl.minimum(tl.associative_scan(prev, 0, _max_combine), M)  # running max >= 0: ends[e-1]
    ends = tl.minimum(tl.maximum(tl.load(OFFS + eids, mask=eids < E, other=0), starts), M)
    return eids, starts, ends


@triton.jit
def expert_tile_table(OFFS, M, E, E_POW2: tl.constexpr, BLOCK_M: tl.constexpr):
    """The per-expert row-tile table of a row-tiled grouped kernel, from offs on device: (eids, starts, ends,
    tiles, tile_end), each [E_POW2]. Expert e owns rows starts[e]:ends[e] (expert_row_bounds) in ``tiles[e]``
    row tiles of BLOCK_M, the last of which ends at tile_end[e] (a cumsum). A persistent kernel builds it
    once and reads it for every tile it visits (tile_at)."""
    eids, starts, ends = expert_row_bounds(OFFS, M, E, E_POW2)
    tiles = (ends - starts + BLOCK_M - 1) // BLOCK_M
    return eids, starts, ends, tiles, tl.cumsum(tiles, 0)


@triton.jit
def tile_at(tile_id, eids, starts, ends, tiles, tile_end, M, N, E, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            GROUP_M: tl.constexpr):
    """Scalars of tile ``tile_id`` of the row_tile_grid order (GROUP_M swizzle) over expert_tile_table's table:
    (e, first_row, row_end, start, end, pid_n, owned). owned: rows first_row:row_end (at most BLOCK_M) belong
    to expert e, whose rows are start:end. Otherwise a surplus tile: first_row:row_end are rows past the last
    owned one (rows no expert owns), which its program must zero; e, start and end are then meaningless. Over every
    tile id below row_tile_grid's count, each row of [0, M) lies in exactly one tile's range, whatever offs
    holds, and every range lies in [0, M)."""
    pid_m, pid_n = swizzle_pid(tile_id, tl.cdiv(M, BLOCK_M) + E, tl.cdiv(N, BLOCK_N), GROUP_M)
    total = tl.sum(tiles, 0)
    owned = pid_m < total
    e, first_row, end = owned_row_tile(pid_m, eids, starts, ends, tiles, tile_end, BLOCK_M)
    start = tl.sum(tl.where(eids == e, starts, 0), 0)
    # owned or surplus: a few scalar selects, so every program runs the same straight-line prologue
    first_row = tl.where(owned, first_row, tl.max(ends, 0) + (pid_m - total) * BLOCK_M)
    row_end = tl.minimum(tl.where(owned, end, M), first_row + BLOCK_M)
    return e, first_row, row_end, start, end, pid_n, owned


@triton.jit
def owned_row_tile(pid_m, eids, starts, ends, tiles, tile_end, BLOCK_M: tl.constexpr):
    """(e, first_row, end) of owned row tile ``pid_m`` (below the table's tile count): its expert, its first
    row, and the expert's end row (the tile's rows are first_row:min(end, first_row + BLOCK_M))."""
    e = tl.sum((tile_end <= pid_m).to(tl.int32), 0)  # first expert whose tiles end past pid_m
    sel = eids == e
    first_tile = tl.sum(tl.where(sel, tile_end - tiles, 0), 0)
    first_row = tl.sum(tl.where(sel, starts, 0), 0) + (pid_m - first_tile) * BLOCK_M
    return e, first_row, tl.sum(tl.where(sel, ends, 0), 0)


@triton.jit
def expert_tile(OFFS, M, N, E, E_POW2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                GROUP_M: tl.constexpr):
    """This program's tile of a row-tiled grouped kernel, from offs on device (see grouped_mm.py).

    Returns (e, offs_m, m_mask, offs_n, n_mask, owned, start, end). owned: rows offs_m[m_mask] belong to
    expert e, whose rows are start:end (what a TMA descriptor over the expert is bound to). Otherwise a
    surplus program: offs_m[m_mask] are rows past the last owned one (rows no expert owns), which it must
    zero; e, start and end are then meaningless. The grid is row_tile_grid's. Every masked row lies in
    [0, M) and each row of [0, M) is written by exactly one program, whatever offs holds.
    """
    eids, starts, ends, tiles, tile_end = expert_tile_table(OFFS, M, E, E_POW2, BLOCK_M)
    e, first_row, row_end, start, end, pid_n, owned = tile_at(tl.program_id(0), eids, starts, ends, tiles, tile_end,
                                                              M, N, E, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = first_row + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return e, offs_m, offs_m < row_end, offs_n, offs_n < N, owned, start, end


@triton.jit
def gather_rows(GIDX, offs_m, m_mask, X_ROWS, HAS_GATHER: tl.constexpr):
    """(rows of x to read, their mask) for logical rows offs_m.

    HAS_GATHER: read the routed rows x[GIDX[r]] in place instead of a permuted copy of x;
    out-of-range indices read zeros, never out of bounds.
    """
    if HAS_GATHER:
        src = tl.load(GIDX + offs_m, mask=m_mask, other=0)
        a_mask = m_mask & (src >= 0) & (src < X_ROWS)
    else:
        src = offs_m
        a_mask = m_mask
    return src, a_mask


@triton.jit
def dot_acc(a, b, acc, PRECISION: tl.constexpr, INTERP_BF16: tl.constexpr):
    """acc + a @ b in fp32 (bf16 operands upcast exactly under INTERP_BF16, see interp_bf16)."""
    if INTERP_BF16:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    return acc


@triton.jit
def tile_mm(A, a_rows, a_mask, stride_am, stride_ak, B, offs_n, n_mask, stride_bk, stride_bn, K, B2_COL,
            TWO_B: tl.constexpr, PRECISION: tl.constexpr, INTERP_BF16: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The K loop of one output tile: (acc, acc2) fp32 [BLOCK_M, BLOCK_N], acc = A[a_rows] @ B[:, offs_n].

    B points at one expert's [K, N] matrix (any strides: a transposed view costs nothing). Masked-off
    rows and the k / n tails read zeros. TWO_B: acc2 = A[a_rows] @ B[:, B2_COL + offs_n] from the
    same A tile, so A is read once for both (SwiGLU's gate and up halves); otherwise acc2 stays 0.
    """
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = A + a_rows.to(tl.int64)[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = B + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
    b2_ptrs = b_ptrs + B2_COL * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        a = tl.load(a_ptrs, mask=a_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc = dot_acc(a, b, acc, PRECISION, INTERP_BF16)
        if TWO_B:
            b2 = tl.load(b2_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            acc2 = dot_acc(a, b2, acc2, PRECISION, INTERP_BF16)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
        b2_ptrs += BLOCK_K * stride_bk
    return acc, acc2


# ---------------------------------------------------------------------------------------------------
# Launcher helpers
# ---------------------------------------------------------------------------------------------------


def row_tile_grid(m: int, n: int, e: int) -> Callable:
    """Grid of the row-tiled kernels (expert_tile): an upper bound of cdiv(m, BLOCK_M) + e row tiles
    (each expert adds at most one partial tile; no host sync for the real count) x cdiv(n, BLOCK_N)."""
    return lambda meta: ((triton.cdiv(m, meta["BLOCK_M"]) + e) * triton.cdiv(n, meta["BLOCK_N"]),)


def dot_flags(dtype: torch.dtype, allow_tf32: bool) -> dict:
    """The PRECISION and INTERP_BF16 constexprs every GEMM kernel takes."""
    return dict(PRECISION=dot_precision(dtype, allow_tf32), INTERP_BF16=interp_bf16(dtype))


# Launch-path helpers in plain Python: triton.cdiv / next_power_of_2 are jit functions, ~4 us a call from
# Python, which shows on short memory-bound launches (the combine, RoPE).
def pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(n - 1, 0).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def elem_size(t) -> int:
    return t.element_size() if isinstance(t, torch.Tensor) else 4


def prune_by_smem(budget_bytes: int, b_tiles: int = 1, a_name: str = "BLOCK_M", b_name: str = "BLOCK_N",
                  k_name: str = "BLOCK_K", elem_arg: str = "X", fp32_acc_per_thread: int = 64,
                  acc_names: tuple[str, str] = ("BLOCK_M", "BLOCK_N")) -> Callable:
    """An ``early_config_prune`` dropping configs whose pipelined tiles overflow shared memory, and for
    4-byte operands also those whose accumulators overflow the registers.

    Stage footprint = (A tile + b_tiles * B tile) * element size; fp32 inputs double it, so the bf16
    configs with 4 stages would not fit for fp32 and the autotuner should not waste time on them.
    fp32 operands (IEEE products) take Triton's FMA dot, not the tensor cores, and hold more per thread:
    configs with more than ``fp32_acc_per_thread`` accumulator values per thread (``b_tiles`` accumulators
    of acc_names' tile over 32 * num_warps threads) spilled in ptxas (sm90), up to 41 KB a thread, so they
    are dropped for fp32 (docs/kernels.md, "Autotuning").
    """

    def prune(configs, named_args, **kwargs):
        elem = elem_size(named_args[elem_arg])
        kept = []
        for c in configs:
            kw = c.kwargs
            stage = (kw[a_name] * kw[k_name] + b_tiles * kw[k_name] * kw[b_name]) * elem
            if stage * c.num_stages > budget_bytes:
                continue
            per_thread = b_tiles * kw[acc_names[0]] * kw[acc_names[1]] // (32 * c.num_warps)
            if elem >= 4 and per_thread > fp32_acc_per_thread:
                continue
            kept.append(c)
        return kept or [min(configs, key=lambda c: (c.num_stages, c.kwargs[a_name] * c.kwargs[b_name]))]

    return prune


AUTOTUNE_ENV = "MOEKIT_AUTOTUNE"
AUTOTUNE_MODES = ("full", "first")


def autotune_mode() -> str:
    """``MOEKIT_AUTOTUNE``: "full" (default) times every candidate config per key and keeps the fastest;
    "first" compiles only the first candidate that fits shared memory, for runs where compile time
    matters more than speed (the GPU test tier: each candidate is a separate compile)."""
    mode = os.environ.get(AUTOTUNE_ENV, "full").strip().lower() or "full"
    if mode not in AUTOTUNE_MODES:
        raise ValueError(f"{AUTOTUNE_ENV}={mode!r} is invalid; use one of {list(AUTOTUNE_MODES)} "
                         f"(full: autotune every candidate config; first: one config, fastest to compile)")
    return mode


TUNED_ENV = "MOEKIT_KERNEL_CONFIGS"
_CONFIG_RE = re.compile(r"^\s*(\d+)x(\d+)x(\d+)\s+w(\d+)\s+s(\d+)\s*$")
KERNELS: dict[str, "Kernel"] = {}  # name -> Kernel, every one constructed (the tuned file's names are checked)
_tuned_cache: dict = {}


def parse_config(text: str, where: str = "") -> triton.Config:
    """``"128x128x64 w8 s4"`` (BLOCK_MxBLOCK_NxBLOCK_K, warps, stages; tune_kernels.py's spelling) -> a config."""
    m = _CONFIG_RE.match(text) if isinstance(text, str) else None
    if m is None:
        raise ValueError(f"{where}tile config {text!r} is not of the form 'BMxBNxBK wWARPS sSTAGES' "
                         "(e.g. '128x128x64 w8 s4', as tools/bench/tune_kernels.py prints them)")
    bm, bn, bk, w, s = map(int, m.groups())
    for name, v in (("BLOCK_M", bm), ("BLOCK_N", bn), ("BLOCK_K", bk), ("warps", w)):
        if v < 1 or v & (v - 1):
            raise ValueError(f"{where}tile config {text!r}: {name} {v} must be a power of two")
    if not 1 <= s <= 8:
        raise ValueError(f"{where}tile config {text!r}: stages {s} must be in 1..8")
    return cfg(bm, bn, bk, w, s)


def tuned_configs(name: str) -> list:
    """Extra candidate configs for kernel ``name`` from the JSON file ``MOEKIT_KERNEL_CONFIGS`` names.

    The file is tools/bench/tune_kernels.py's output (its ``"winners"``: kernel name -> config strings)
    or just that mapping. Its configs go to the front of the kernel's own list, so full autotuning times
    them alongside the defaults and ``MOEKIT_AUTOTUNE=first`` takes the first tuned one that fits. A
    missing or malformed file, a kernel name moekit does not have, or a bad config string is an error
    naming the file and the fix: a tuning result must not be silently ignored."""
    path = os.environ.get(TUNED_ENV, "").strip()
    if not path:
        return []
    if path not in _tuned_cache:
        where = f"{TUNED_ENV}={path}: "
        try:
            with open(path) as f:
                data = json.load(f)
        except OSError as exc:
            raise ValueError(f"{where}cannot read it ({exc.strerror}); point it at tune_kernels.py's JSON "
                             f"or unset {TUNED_ENV}") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}not valid JSON ({exc.msg} at line {exc.lineno}); point it at "
                             "tune_kernels.py's JSON output") from None
        table = data.get("winners", data) if isinstance(data, dict) else None
        if not isinstance(table, dict) or not all(isinstance(v, list) for v in table.values()):
            raise ValueError(f"{where}expected a mapping of kernel name -> list of configs (or tune_kernels.py's "
                             "JSON with its 'winners')")
        unknown = sorted(set(table) - set(KERNELS))
        if unknown:
            raise ValueError(f"{where}no moekit kernel is named {', '.join(unknown)}; "
                             f"the kernels are {', '.join(sorted(KERNELS))}")
        _tuned_cache[path] = {k: [parse_config(t, f"{where}{k}: ") for t in v] for k, v in table.items()}
    return list(_tuned_cache[path].get(name, []))


def _same_config(a: triton.Config, b: triton.Config) -> bool:
    return a.kwargs == b.kwargs and a.num_warps == b.num_warps and a.num_stages == b.num_stages


class Kernel:
    """A ``@triton.jit`` kernel plus its autotune configs, rebuilt for the launch-time Triton mode.

    GPU: ``triton.autotune`` over ``configs`` keyed on ``key`` (only the first that fits under
    ``MOEKIT_AUTOTUNE=first``). Interpreter: the single small ``interpret_config`` (autotuning there
    would only multiply the run time of the tests). ``with kernel.pinned(config):`` launches exactly
    that config (the tuning sweep, tools/bench/tune_kernels.py, and the every-config GPU test).
    """

    def __init__(self, jitted, configs: Sequence[triton.Config], interpret_config: triton.Config,
                 key: Sequence[str], prune: Callable | None = None):
        self.jitted = jitted
        self.fn = jitted.fn  # the raw Python function, for offline compile checks
        self.name = self.fn.__name__
        self.configs = list(configs)
        self.interpret_config = interpret_config
        self.key = list(key)
        self.prune = prune
        self._pinned: triton.Config | None = None
        self._built: dict = {}  # launch-time mode (and autotune mode) -> the autotuned callable
        KERNELS[self.name] = self

    def variant(self, jitted) -> "Kernel":
        """Another kernel on this one's tiles (configs, interpreter config, autotune key, prune): a variant
        compared with it config for config, as the TMA kernels are with the pointer kernels."""
        return Kernel(jitted, self.configs, self.interpret_config, self.key, self.prune)

    def candidate_configs(self) -> list:
        """The configs the GPU autotuner chooses from: ``MOEKIT_KERNEL_CONFIGS``' tuned ones first, then
        the kernel's own list (duplicates dropped)."""
        out = []
        for c in tuned_configs(self.name) + self.configs:
            if not any(_same_config(c, d) for d in out):
                out.append(c)
        return out

    def _build(self, interpret: bool):
        from triton.runtime.interpreter import InterpretedFunction

        if isinstance(self.jitted, InterpretedFunction) != interpret:
            raise RuntimeError(
                f"{self.name} was decorated {'for' if not interpret else 'without'} the interpreter but triton "
                f"runs {'interpreted' if interpret else 'compiled'}: TRITON_INTERPRET changed between "
                "`import triton` and `import moe.kernels`; set it before both")
        jitted = self.jitted
        if interpret:
            return triton.autotune(configs=[self.interpret_config], key=self.key)(jitted)
        if self._pinned is not None:  # exactly this config, no prune: a sweep wants to see it fail
            return triton.autotune(configs=[self._pinned], key=self.key)(jitted)
        prune = self.prune
        if autotune_mode() == "first":
            fits = self.prune or (lambda configs, named_args, **kw: configs)
            prune = lambda configs, named_args, **kw: fits(configs, named_args, **kw)[:1]  # noqa: E731
        return triton.autotune(configs=self.candidate_configs(), key=self.key,
                               prune_configs_by={"early_config_prune": prune} if prune else None)(jitted)

    @contextlib.contextmanager
    def pinned(self, config: triton.Config):
        """Launch only ``config`` inside the block (compiled mode; the interpreter keeps its own config)."""
        saved, self._pinned = self._pinned, config
        self._built.pop(False, None)
        try:
            yield self
        finally:
            self._pinned = saved
            self._built.pop(False, None)

    def __getitem__(self, grid):
        if CAPTURE is not None:
            return lambda *args, **kwargs: CAPTURE.append((self, args, kwargs))
        mode = interpret_mode()
        key = (mode, autotune_mode(), os.environ.get(TUNED_ENV, "")) if not mode and self._pinned is None else mode
        if key not in self._built:
            self._built[key] = self._build(mode)
        LAUNCHES[self.name] += 1
        return self._built[key][grid]


def cfg(bm: int, bn: int, bk: int, warps: int, stages: int, group: int = 8, **extra) -> triton.Config:
    return triton.Config(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group, **extra),
                         num_warps=warps, num_stages=stages)
