"""The run directory's records: writers used by training, readers used by tools/heatmap.py.

    <run_dir>/
        config.json        the resolved TrainConfig (what --print-config shows, as JSON)
        metrics.jsonl      one object per optimizer step
        expert_load.jsonl  a header object, then one object per optimizer step
        checkpoints/       see moekit.train.checkpoint
        tensorboard/       when the tensorboard package is installed

metrics.jsonl keys: step, loss (LM cross-entropy over the global batch), aux_loss (router aux losses
added to the objective: sum over MoE layers of the mean over micro-batches), lr, grad_norm (before
clipping), tokens_per_s, tokens (seen so far), elapsed_s, mem_gb (peak), mfu (null where the device
peak is unknown), imbalance (mean over MoE layers of max/mean tokens per expert), imbalance_max (the
worst layer), dropped_fraction (dropped slots / routed slots, all layers); val_loss on evaluation
steps; gpu_* telemetry when nvidia-ml-py is present.

expert_load.jsonl:
    line 1: {"format": "moekit-expert-load", "version": 1, "router": str, "top_k": int,
             "num_experts": E, "layers": [L MoE layer names, module order]}
    then:   {"step": n, "tokens": [[E ints] x L], "assigned": [[E ints] x L], "dropped": [L ints]}
tokens = slots each expert processed in that optimizer step (all micro-batches), after capacity
dropping; assigned = slots the router chose before dropping; dropped = sum(assigned) - sum(tokens).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moekit.train import UserError

LOAD_FORMAT, LOAD_VERSION = "moekit-expert-load", 1
METRICS, EXPERT_LOAD, CONFIG = "metrics.jsonl", "expert_load.jsonl", "config.json"


class JsonlWriter:
    """Appends one JSON object per line, flushed at once so a crash loses at most the current step."""

    def __init__(self, path: Path):
        self.path = path
        self._f = open(path, "a", encoding="utf-8")
        self._failed = False

    def write(self, obj: dict) -> None:
        try:
            self._f.write(json.dumps(obj, separators=(",", ":")) + "\n")
            self._f.flush()
        except OSError as exc:  # a full disk: name the file (a buffered write's error does not)
            self._failed = True
            raise OSError(exc.errno, exc.strerror, str(self.path)) from None

    def close(self) -> None:
        try:
            self._f.close()
        except OSError:  # the unwritten line of a failed write, reported already
            if not self._failed:
                raise


def truncate_after(path: Path, step: int) -> None:
    """Drop the lines of steps after ``step`` (a resumed run rewrites them); keep header lines."""
    if not path.exists():
        return
    kept = []
    for ln in path.read_text(encoding="utf-8").splitlines(keepends=True):
        try:
            record = json.loads(ln)
        except ValueError:  # a line cut short by a crash mid-write: that step is re-done anyway
            continue
        if record.get("step", 0) <= step:
            kept.append(ln if ln.endswith("\n") else ln + "\n")
    path.write_text("".join(kept), encoding="utf-8")


def load_header(layers: dict, router: str, top_k: int) -> dict:
    num_experts = len(next(iter(layers.values())).tokens_per_expert) if layers else 0
    return {"format": LOAD_FORMAT, "version": LOAD_VERSION, "router": router, "top_k": top_k,
            "num_experts": num_experts, "layers": list(layers)}


def load_line(step: int, layers: dict) -> dict:
    """One step's record from ``moe.collect_load`` summaries {name: LoadSummary}."""
    return {"step": step, "tokens": [s.tokens_per_expert for s in layers.values()],
            "assigned": [s.assigned_per_expert for s in layers.values()],
            "dropped": [s.dropped_slots for s in layers.values()]}


# ---------------------------------------------------------------------------------------------------
# Readers
# ---------------------------------------------------------------------------------------------------


@dataclass
class ExpertLoadRecord:
    router: str
    top_k: int
    layers: list[str]
    steps: np.ndarray  # [N] int
    tokens: np.ndarray  # [N, L, E] int64, kept slots per expert per step
    assigned: np.ndarray  # [N, L, E] int64
    dropped: np.ndarray  # [N, L] int64

    def window(self, first: int | None, last: int | None) -> "ExpertLoadRecord":
        lo = self.steps.min() if first is None else first
        hi = self.steps.max() if last is None else last
        sel = (self.steps >= lo) & (self.steps <= hi)
        if not sel.any():
            raise UserError(f"no expert-load records in steps {lo}..{hi} (the run has steps "
                            f"{self.steps.min()}..{self.steps.max()})")
        return ExpertLoadRecord(self.router, self.top_k, self.layers, self.steps[sel], self.tokens[sel],
                                self.assigned[sel], self.dropped[sel])


def _read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        raise UserError(f"{path}: not found; is {path.parent} a moekit run directory (moekit-train --run-dir)?")
    out = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise UserError(f"{path}:{i}: not JSON ({exc.msg})") from None
    return out


def read_metrics(run_dir: str | Path) -> list[dict]:
    return _read_jsonl(Path(run_dir) / METRICS)


def read_config(run_dir: str | Path) -> dict:
    path = Path(run_dir) / CONFIG
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{path}: not found; is {run_dir} a moekit run directory?") from None


def read_expert_load(run_dir: str | Path) -> ExpertLoadRecord:
    path = Path(run_dir) / EXPERT_LOAD
    lines = _read_jsonl(path)
    if not lines or lines[0].get("format") != LOAD_FORMAT:
        raise UserError(f"{path}: first line is not a {LOAD_FORMAT!r} header")
    head, rows = lines[0], lines[1:]
    if head.get("version") != LOAD_VERSION:
        raise UserError(f"{path}: format version {head.get('version')!r}; this moekit reads {LOAD_VERSION}")
    if not head["layers"]:
        raise UserError(f"{path}: the model has no MoE layers, so there is no expert load to show")
    if not rows:
        raise UserError(f"{path}: no steps recorded yet")
    L, E = len(head["layers"]), head["num_experts"]
    tokens = np.array([r["tokens"] for r in rows], dtype=np.int64)
    if tokens.shape[1:] != (L, E):
        raise UserError(f"{path}: records hold {tokens.shape[1:]} counts, the header says {L} layers x {E} experts")
    return ExpertLoadRecord(head["router"], head["top_k"], head["layers"], np.array([r["step"] for r in rows]),
                            tokens, np.array([r["assigned"] for r in rows], dtype=np.int64),
                            np.array([r["dropped"] for r in rows], dtype=np.int64))
