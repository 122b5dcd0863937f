"""The run directory's records: the files, their formats and the writers training uses (the readers, used by
moekit-heatmap and the report, are in train/record_readers.py and re-exported here).

    <run_dir>/
        config.json        the resolved TrainConfig (what --print-config shows, as JSON)
        metrics.jsonl      one object per optimizer step
        expert_load.bin    expert load, binary: a JSON header line, then one fixed-size record per written step
        expert_load.jsonl  the same record as JSON lines (moekit before the binary format; still read)
        checkpoints/       see moekit.train.checkpoint
        tensorboard/       when the tensorboard package is installed
        previous/N/        an earlier attempt's records, set aside by --resume auto when it found no checkpoint
                           (``set_aside``; N counts up, so repeated restarts never overwrite one)

metrics.jsonl keys: step, loss (LM cross-entropy over the global batch), aux_loss (router aux losses added to
the objective: sum over MoE layers of the mean over micro-batches), lr, grad_norm (before clipping),
grad_norm_by_part ({part: its norm}, moekit.train.grad_parts), tokens_per_s, tokens (seen so far), elapsed_s,
mem_gb (peak), mfu (null where the device peak is unknown), imbalance (mean over MoE layers of max/mean tokens per
expert), imbalance_max (the worst layer), dropped_fraction (dropped slots / routed slots, all layers); val_loss on
evaluation steps, and val_loss_ema with --train.ema_decay (the parameter average's loss on the same windows:
moekit.train.ema); with multi-token prediction (models.mtp) mtp_loss (the depths' mean loss) and val_mtp_loss (the
same on the validation windows, evaluation steps); gpu_* telemetry when nvidia-ml-py is present. With
moekit.train.monitor.load_metrics: balance_loss and z_loss (the routers' unweighted terms, mean over MoE layers),
sequence_imbalance (routers with balance="sequence"), cv, dead_experts.

The expert-load record, one entry per written optimizer step (every step, or every ``stride``-th):

    field     shape    meaning
    step      []       optimizer step, from 1
    tokens    [L, E]   slots expert e of MoE layer l processed in that step (all micro-batches), after
                       capacity dropping
    assigned  [L, E]   slots the router chose before dropping
    dropped   [L]      sum(assigned[l]) - sum(tokens[l])

L = MoE layers in module order (header "layers"), E = experts per layer (header "num_experts").

expert_load.bin (``ExpertLoadWriter``; read memory-mapped, so a window or an aggregate of a long run
never loads the whole record):
    bytes 0..H-1  one line of UTF-8 JSON padded with spaces to a multiple of 4096 bytes, ending in "\\n":
                  {"format": "moekit-expert-load-binary", "version": 1, "router", "top_k", "num_experts",
                   "layers", "stride", "dtype": "int32" | "int64", "record_bytes"}
    then          fixed-size little-endian records: step int64, tokens dtype[L, E], assigned dtype[L, E],
                  dropped dtype[L] (record_bytes = 8 + size(dtype) * (2 * L * E + L))
A crash mid-write leaves a partial last record; readers ignore it and a resumed run cuts it off.
Size: 61 layers x 256 experts in int32 is 125 KB per written step, so 100k steps cost 12.5 GB at stride
1, 1.25 GB at stride 10 (``auto_stride`` picks one for a budget).

expert_load.jsonl (version 1, read for older runs):
    line 1: {"format": "moekit-expert-load", "version": 1, "router": str, "top_k": int,
             "num_experts": E, "layers": [L MoE layer names, module order]}
    then:   {"step": n, "tokens": [[E ints] x L], "assigned": [[E ints] x L], "dropped": [L ints]}
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterator

import numpy as np

from moekit.train import UserError

LOAD_FORMAT, LOAD_VERSION = "moekit-expert-load", 1
BIN_FORMAT, BIN_VERSION = "moekit-expert-load-binary", 1
METRICS, EXPERT_LOAD, CONFIG = "metrics.jsonl", "expert_load.jsonl", "config.json"
EXPERT_LOAD_BIN = "expert_load.bin"
HEADER_ALIGN = 4096
LOAD_BUDGET_BYTES = 2 << 30  # auto_stride: keep a run's expert-load record under about 2 GiB


class _AppendOnly:
    """A record file opened for appending; every write is flushed at once, so a crash loses at most the
    current step. A failed write (a full disk) is an OSError naming the file, which a buffered write's
    error does not; close() then does not report the unwritten bytes again."""

    def __init__(self, path: Path, mode: str):
        self.path = path
        self._f = open(path, mode, encoding="utf-8" if "b" not in mode else None)
        self._failed = False

    def _append(self, data) -> None:
        try:
            self._f.write(data)
            self._f.flush()
        except OSError as exc:
            self._failed = True
            raise OSError(exc.errno, exc.strerror, str(self.path)) from None

    def close(self) -> None:
        try:
            self._f.close()
        except OSError:  # the unwritten data of a failed write, reported already
            if not self._failed:
                raise


class JsonlWriter(_AppendOnly):
    """Appends one JSON object per line."""

    def __init__(self, path: Path):
        super().__init__(path, "a")

    def write(self, obj: dict) -> None:
        self._append(json.dumps(obj, separators=(",", ":")) + "\n")


def truncate_after(path: Path, step: int) -> None:
    """Drop the records of steps after ``step`` (a resumed run rewrites them); keep header lines.
    ``expert_load.bin`` (by its suffix) is cut at the first record past ``step`` (and a partial last record)."""
    path = Path(path)
    if not path.exists():
        return
    if path.suffix == ".bin":
        _truncate_binary(path, step)
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


# What a run writes into its run directory from step 0 (besides checkpoints/): set aside as a whole, so a
# previous/N folder is itself a run directory the readers (moekit-heatmap, the report) can open
RUN_RECORDS = (METRICS, EXPERT_LOAD, EXPERT_LOAD_BIN, CONFIG, "tokenizer.json", "tokenizer_info.json", "tensorboard",
               "wandb", "expert_load.png", "expert_load_steps.png")
PREVIOUS = "previous"


def set_aside(run_dir: str | Path) -> str:
    """Before a fresh start in ``run_dir`` that was meant to resume (--resume auto found no checkpoint): move the
    earlier attempt's records (RUN_RECORDS) into ``run_dir/previous/N``, N one above the highest there, and return
    the warning line that says so; '' (nothing moved) when there are no metrics to keep (an empty metrics.jsonl:
    the attempt stopped before its first step)."""
    d = Path(run_dir)
    metrics = d / METRICS
    if not metrics.is_file() or metrics.stat().st_size == 0:
        return ""
    numbers = [int(p.name) for p in (d / PREVIOUS).glob("*") if p.name.isdigit()]
    dest = d / PREVIOUS / str(max(numbers, default=0) + 1)
    dest.mkdir(parents=True)
    moved = [name for name in RUN_RECORDS if (d / name).exists()]
    for name in moved:
        (d / name).rename(dest / name)
    lines = sum(1 for line in (dest / METRICS).read_bytes().splitlines() if line.strip())
    return (f"warning: --resume auto: no checkpoint in {d} to resume from, so this run starts at step 0; the earlier "
            f"attempt's records ({', '.join(moved)}; {lines} metrics line{'s' if lines != 1 else ''}) were moved to "
            f"{dest}, not deleted")


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
# The binary expert-load record
# ---------------------------------------------------------------------------------------------------


def record_dtype(layers: int, experts: int, dtype: str = "int32") -> np.dtype:
    """The fixed-size record of expert_load.bin (explicitly little-endian, unaligned)."""
    d = np.dtype(dtype).newbyteorder("<")
    return np.dtype([("step", "<i8"), ("tokens", d, (layers, experts)), ("assigned", d, (layers, experts)),
                     ("dropped", d, (layers,))])


def count_dtype(max_count: int | None) -> str:
    """int32 when every count fits (slots per step < 2**31), else int64; unknown: int64."""
    return "int32" if max_count is not None and max_count < 2**31 else "int64"


def auto_stride(layers: int, experts: int, steps: int, budget_bytes: int = LOAD_BUDGET_BYTES,
                dtype: str = "int32") -> int:
    """The smallest stride that keeps ``steps`` steps of expert-load records under ``budget_bytes``."""
    per_step = record_dtype(max(layers, 1), max(experts, 1), dtype).itemsize
    return max(1, -(-steps * per_step // max(budget_bytes, 1)))


def _read_bin_header(path: Path) -> tuple[dict, int]:
    """(header, header length in bytes) of expert_load.bin."""
    with open(path, "rb") as f:
        raw = b""
        while b"\n" not in raw:
            chunk = f.read(HEADER_ALIGN)
            if not chunk:
                raise UserError(f"{path}: no header line; not a {BIN_FORMAT} file (a write cut short?)")
            raw += chunk
            if len(raw) > 1 << 24:
                raise UserError(f"{path}: no header line in its first 16 MiB; not a {BIN_FORMAT} file")
    end = raw.index(b"\n") + 1
    try:
        head = json.loads(raw[:end].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise UserError(f"{path}: its header is not JSON; not a {BIN_FORMAT} file") from None
    if not isinstance(head, dict) or head.get("format") != BIN_FORMAT:
        raise UserError(f"{path}: header format {head.get('format') if isinstance(head, dict) else head!r}; "
                        f"expected {BIN_FORMAT!r}")
    if head.get("version") != BIN_VERSION:
        raise UserError(f"{path}: format version {head.get('version')!r}; this moekit reads {BIN_VERSION}")
    return head, end


def _bin_layout(path: Path, head: dict) -> np.dtype:
    L, E = len(head["layers"]), int(head["num_experts"])
    rec = record_dtype(L, E, head.get("dtype", "int32"))
    if head.get("record_bytes", rec.itemsize) != rec.itemsize:
        raise UserError(f"{path}: header says {head['record_bytes']} bytes per record, but {L} layers x {E} "
                        f"experts of {head.get('dtype')} take {rec.itemsize}")
    return rec


def _truncate_binary(path: Path, step: int) -> None:
    head, start = _read_bin_header(path)
    rec = _bin_layout(path, head)
    n = (path.stat().st_size - start) // rec.itemsize
    keep = 0
    if n:
        steps = _read_steps(path, start, rec, n)
        keep = int(np.searchsorted(steps, step, side="right")) if _sorted(steps) else int((steps <= step).sum())
    os.truncate(path, start + keep * rec.itemsize)


def _sorted(a: np.ndarray) -> bool:
    return a.size < 2 or bool(np.all(a[1:] > a[:-1]))


def _read_steps(path: Path, start: int, rec: np.dtype, n: int) -> np.ndarray:
    """The step of each record, 8 bytes per record read with pread: reading the field through the memory
    map would fault in (and count as this process's memory) the pages around every record."""
    out = np.empty(n, dtype=np.int64)
    fd = os.open(path, os.O_RDONLY)
    try:
        for i in range(n):
            out[i] = int.from_bytes(os.pread(fd, 8, start + i * rec.itemsize), "little", signed=True)
    finally:
        os.close(fd)
    return out


def _jsonl_chunks(path: Path, rec: np.dtype, rows: int = 256) -> Iterator[np.ndarray]:
    """The steps of an expert_load.jsonl as records of dtype ``rec``, ``rows`` at a time (a cut last line is
    skipped, as truncate_after does)."""
    buf = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f):
            if i == 0 or not line.strip():
                continue
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue
            row = np.zeros((), dtype=rec)
            row["step"], row["tokens"], row["assigned"], row["dropped"] = (r["step"], r["tokens"], r["assigned"],
                                                                           r["dropped"])
            buf.append(row)
            if len(buf) == rows:
                yield np.stack(buf)
                buf = []
    if buf:
        yield np.stack(buf)


class ExpertLoadWriter(_AppendOnly):
    """Appends expert-load records to ``expert_load.bin``, one every ``stride``-th optimizer step.

    ``layers``: the MoE layer names in module order (or ``moe.collect_load``'s dict). An existing file (a
    resumed run) is appended to after checking it records the same layers and experts; its partial last
    record, if any, is cut off. Without one, but with an ``expert_load.jsonl`` beside it (a run begun by an
    older moekit), that record is converted first (every step it has), so the run keeps one record.
    ``max_count``: the most slots a count can hold (tokens per step x top_k); it picks int32 or int64.

        writer = ExpertLoadWriter(run_dir / EXPERT_LOAD_BIN, collect_load(model, reset=False), "topk", 2,
                                  stride=10, max_count=tokens_per_step * top_k)
        writer.write(step, load)      # every step: writes only when step % stride == 0
    """

    def __init__(self, path: Path, layers, router: str, top_k: int, num_experts: int | None = None,
                 stride: int = 1, max_count: int | None = None, migrate: bool = True):
        if stride < 1:
            raise ValueError(f"stride {stride}: must be a positive integer")
        self.path, self.stride = Path(path), stride
        names = list(layers)
        if num_experts is None:
            num_experts = len(next(iter(layers.values())).tokens_per_expert) if isinstance(layers, dict) and layers \
                else 0
        if self.path.exists() and self.path.stat().st_size > 0:
            head, start = _read_bin_header(self.path)
            if head["layers"] != names or head["num_experts"] != num_experts:
                raise UserError(f"{self.path}: records {len(head['layers'])} MoE layers x {head['num_experts']} "
                                f"experts, this model has {len(names)} x {num_experts}; use a new --run-dir")
            self.header = head
            self.rec = _bin_layout(self.path, head)
            size = self.path.stat().st_size
            whole = start + (size - start) // self.rec.itemsize * self.rec.itemsize
            if whole != size:  # a partial record from a crash mid-write
                os.truncate(self.path, whole)
        else:
            dtype = count_dtype(max_count)
            self.rec = record_dtype(len(names), num_experts, dtype)
            self.header = {"format": BIN_FORMAT, "version": BIN_VERSION, "router": router, "top_k": top_k,
                           "num_experts": num_experts, "layers": names, "stride": stride, "dtype": dtype,
                           "record_bytes": self.rec.itemsize}
            text = json.dumps(self.header, separators=(",", ":")).encode("utf-8")
            size = -(-(len(text) + 1) // HEADER_ALIGN) * HEADER_ALIGN
            tmp = self.path.with_name(self.path.name + ".partial")
            with open(tmp, "wb") as f:
                f.write(text + b" " * (size - len(text) - 1) + b"\n")
                old = self.path.with_name(EXPERT_LOAD)
                migrate = migrate and old.exists()
                if migrate:  # an older moekit's run, resumed: its steps move into the binary record
                    for chunk in _jsonl_chunks(old, self.rec):
                        f.write(chunk.tobytes())
            os.replace(tmp, self.path)
            if migrate:
                old.unlink()
        self.limit = np.iinfo(self.rec["tokens"].base).max
        super().__init__(self.path, "ab")

    def due(self, step: int) -> bool:
        return step % self.stride == 0

    def write(self, step: int, load: dict, force: bool = False) -> bool:
        """Record ``step`` from ``moe.collect_load`` summaries {name: LoadSummary} when it is due (or
        ``force``); returns whether it was written."""
        if not (force or self.due(step)):
            return False
        s = list(load.values())
        self.write_counts(step, [x.tokens_per_expert for x in s], [x.assigned_per_expert for x in s],
                          [x.dropped_slots for x in s])
        return True

    def write_counts(self, step: int, tokens, assigned, dropped) -> None:
        """One record from arrays: tokens and assigned [L, E], dropped [L]."""
        row = np.zeros((), dtype=self.rec)
        row["step"] = step
        for name, value in (("tokens", tokens), ("assigned", assigned), ("dropped", dropped)):
            arr = np.asarray(value, dtype=np.int64)
            if arr.size == 0 and row[name].size == 0:  # a model without MoE layers: the step alone
                continue
            if arr.shape != row[name].shape:
                raise ValueError(f"{name}: shape {arr.shape}, the record holds {row[name].shape}")
            if arr.size and (arr.max() > self.limit or arr.min() < 0):
                raise ValueError(f"{name}: a count of {arr.max()} does not fit {self.header['dtype']} (pass "
                                 f"max_count when creating {self.path})")
            row[name] = arr
        self.write_rows(row.reshape(1))

    def write_rows(self, rows: np.ndarray) -> None:
        """Append records already in this file's record dtype (tools/bench, conversions)."""
        self._append(np.ascontiguousarray(rows, dtype=self.rec).tobytes())


_READERS = ("ExpertLoadRecord", "convert_jsonl", "expert_load_path", "load_rows", "parse_window", "read_config",
            "read_expert_load", "read_metrics")


def __getattr__(name: str):
    """The readers (moekit-heatmap, the report, moekit-placement) live in train/record_readers.py, which
    imports this module; they are re-exported here on first use, so either module may be imported first."""
    if name in _READERS:
        from moekit.train import record_readers

        return getattr(record_readers, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
