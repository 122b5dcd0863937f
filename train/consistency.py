"""Every rank must run the same settings, software and data: checked once, before training.

Ranks started with different flags (a typo in one node's launch script, a config file that differs between
nodes, another moekit or torch version, a data file that differs in content) would otherwise train
silently with diverged replicas, or hang in a collective whose shapes disagree. ``check_ranks_agree``
gathers a flat description of each rank (every resolved config value, the kernel switches its environment
set, the software versions, a fingerprint of the token data) and refuses the run with one line naming the settings that differ and
which ranks hold which value.

Settings that legitimately differ per rank are left out (none today: the run directory is a shared path
every rank names the same way, as DCP's collective checkpoints need).
"""
from __future__ import annotations

import importlib.metadata
import zlib
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from moekit.train import UserError

# values that may differ between ranks without changing the run (none yet; keep the hook explicit)
PER_RANK_KEYS: frozenset[str] = frozenset()
SHOWN = 3  # settings spelled out in the message; the rest are counted


class RanksDisagree(UserError):
    """A UserError that every rank raises alike; only rank 0 prints it (``quiet`` on the others)."""

    def __init__(self, message: str, quiet: bool):
        super().__init__(message)
        self.quiet = quiet


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"train": {"lr": 1}} -> {"train.lr": 1}; leaves are kept as they are (lists, None, scalars)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


def data_fingerprint(tokens: np.ndarray) -> str:
    """Token count and a CRC-32 of the tokens: all of them up to 256 KiB, beyond that 64 evenly spaced 4 KiB
    blocks: cheap on a memory-mapped file of any size (reads at most 256 KiB), and different for files that
    differ almost anywhere in practice (anywhere at all when they are small)."""
    flat = tokens.reshape(-1)
    n = flat.size
    block = max(1, 4096 // max(flat.itemsize, 1))
    if n <= 64 * block:  # evenly spaced blocks would leave gaps between them: read it all
        return f"{n} tokens, crc32 {zlib.crc32(np.ascontiguousarray(flat).tobytes()):08x}"
    crc = 0
    for start in np.linspace(0, max(n - block, 0), num=min(64, max(n // block, 1)), dtype=np.int64):
        crc = zlib.crc32(np.ascontiguousarray(flat[start : start + block]).tobytes(), crc)
    return f"{n} tokens, crc32 {crc:08x}"


def kernel_switches() -> dict[str, str]:
    """The compute paths chosen by environment variables, as each rank resolved them (``switch.<variable>``): the
    Triton-path switches (moe.kernel_choice) and the kernels' TMA / autotune modes. One node launched with another
    value computes its replica differently (numerics, memory; with expert parallelism, what its peers receive)."""
    from moekit.models import delta_rule, loss
    from moekit.moe import experts, precision

    out = {f"switch.{env}": value for env, value in (
        (experts.FUSED_PERMUTE_ENV, experts.FUSED_PERMUTE), (loss.LM_LOSS_ENV, loss.TRITON_LM_LOSS),
        (precision.SPLIT_ROUTER_ENV, precision.SPLIT_ROUTER), (delta_rule.DELTA_SCAN_ENV, delta_rule.TRITON_SCAN))}
    try:
        from moekit.moe.kernels._common import AUTOTUNE_ENV, autotune_mode
        from moekit.moe.kernels._tma import TMA_ENV, tma_default
    except ImportError:  # no triton here: the kernels never run
        return out
    out[f"switch.{TMA_ENV}"] = tma_default()
    try:
        out[f"switch.{AUTOTUNE_ENV}"] = autotune_mode()
    except ValueError as exc:  # a bad value is the start-up check's to report; here it must still compare
        out[f"switch.{AUTOTUNE_ENV}"] = f"invalid ({exc})"
    return out


def describe_rank(config: dict[str, Any], data: list[np.ndarray] | None = None) -> dict[str, Any]:
    """What must be equal on every rank: the resolved config, the kernel switches of the environment
    (kernel_switches), the software, the data (its token sets)."""
    try:
        version = importlib.metadata.version("moekit")
    except importlib.metadata.PackageNotFoundError:  # a checkout used without installing
        version = "not installed"
    desc = {k: v for k, v in flatten(config).items() if k not in PER_RANK_KEYS}
    desc.update(kernel_switches())
    desc["software.moekit"] = version
    desc["software.torch"] = torch.__version__
    if data is not None:
        desc["data.content"] = "; ".join(data_fingerprint(tokens) for tokens in data)
    return desc


def rank_ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> "ranks 0-2, 5"; [3] -> "rank 3"."""
    ranks = sorted(ranks)
    parts, start = [], ranks[0]
    for i, rank in enumerate(ranks):
        last_of_run = i + 1 == len(ranks) or ranks[i + 1] != rank + 1
        if last_of_run:
            parts.append(f"{start}-{rank}" if rank > start else f"{start}")
            start = ranks[i + 1] if i + 1 < len(ranks) else rank
    return ("ranks " if len(ranks) > 1 else "rank ") + ", ".join(parts)


def disagreements(descriptions: list[dict[str, Any]]) -> list[tuple[str, dict[str, list[int]]]]:
    """[(key, {repr(value): [ranks]})] for every key whose value is not the same on all ranks, in key order."""
    keys = sorted(set().union(*descriptions))
    out = []
    for key in keys:
        groups: dict[str, list[int]] = {}
        for rank, desc in enumerate(descriptions):
            value = repr(desc[key]) if key in desc else "(absent)"
            groups.setdefault(value, []).append(rank)
        if len(groups) > 1:
            out.append((key, groups))
    return out


def message(diffs: list[tuple[str, dict[str, list[int]]]], world: int) -> str:
    shown = []
    for key, groups in diffs[:SHOWN]:
        # the largest group first: usually the intended value, then the odd ranks out
        by_size = sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[1][0]))
        shown.append(f"{key} ({'; '.join(f'{rank_ranges(r)}: {v}' for v, r in by_size)})")
    more = f" and {len(diffs) - SHOWN} more ({', '.join(k for k, _ in diffs[SHOWN:])})" if len(diffs) > SHOWN else ""
    return (f"the {world} ranks were started with different settings: {', '.join(shown)}{more}; start every "
            f"rank with the same flags, config file, data and moekit/torch versions")


def check_ranks_agree(config: dict[str, Any], data: list[np.ndarray] | None = None, error: UserError | None = None,
                      group=None) -> None:
    """Collective over ``group`` (default: the world): raise RanksDisagree on every rank when any rank's
    description differs, or when setup failed on some rank (``error``: e.g. its data file is missing),
    so the others stop now instead of waiting for it in the next collective until the timeout.
    In one process: only re-raises ``error``."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        if error is not None:
            raise error
        return
    mine = {"error": str(error)} if error is not None else describe_rank(config, data)
    gathered: list[dict[str, Any] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    quiet = dist.get_rank(group) != 0  # every rank raises alike; rank 0 speaks for all
    failed = [(r, d["error"]) for r, d in enumerate(gathered) if d is not None and "error" in d]
    if failed:
        first, text = failed[0]
        others = f" (and on {rank_ranges([r for r, _ in failed[1:]])})" if len(failed) > 1 else ""
        raise RanksDisagree(f"rank {first}: {text}{others}", quiet=quiet)
    diffs = disagreements(gathered)  # type: ignore[arg-type]
    if diffs:
        raise RanksDisagree(message(diffs, len(gathered)), quiet=quiet)
