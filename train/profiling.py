"""Profiling a training run (``--profile.every N``): torch.profiler traces of chosen steps, time by category, and
CUDA memory snapshots.

With ``--profile.every N`` the trainer records the ``--profile.steps`` steps that end at each multiple of N (after
``--profile.warmup`` steps the profiler runs without recording, so its start-up cost stays out of the trace). Each
rank writes, for the window ending at step s, into ``<run_dir>/profile/step_<s>/``:

    rank<r>.trace.json.gz    the chrome trace (https://ui.perfetto.dev or chrome://tracing open it gzipped)
    rank<r>.summary.json     time by category and the top operators, per recorded step
    rank<r>.summary.txt      the same as tables (torch's key_averages, sorted by self time)
    rank<r>.memory.pickle    with --profile.memory (CUDA): the caching allocator's history up to the window's end,
                             for https://pytorch.org/memory_viz

and rank 0 prints one line: the step time by category and where the trace is. With ``--profile.memory`` an
out-of-memory error also leaves ``profile/oom_step_<s>/rank<r>.memory.pickle`` (the allocations that led to it).

Time by category: GPU kernel time on CUDA, CPU op self time on the CPU, attributed by where the work was issued.
Forward: the innermost labelled region, from record_function ranges opened around modules (attention, router,
experts, norms, ...), around the MoE dispatch and combine, around the head + loss (from the final norm to the
end of the model's forward; multi-token-prediction depths count there) and around the optimizer step. Backward:
the forward op whose autograd node ran it (the profiler's sequence number links the two), so a GEMM in backward
counts where its forward ran. Communication kernels and ops (nccl, c10d) are taken by name first. Everything else
is "other". The labels exist only inside a window, and not under ``--train.compile`` (a compiled block is one graph:
hooks inside it would recompile it): there every forward op is "other" but the optimizer's and the communication's,
and the trace still shows each kernel.

``tools/bench/profile_step.py`` (a few steps of a preset, outside the trainer) categorises with the same functions.
"""
from __future__ import annotations

import gzip
import json
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn
from torch.autograd.profiler import record_function

from moekit.models.attention import Attention
from moekit.moe import DenseMLP, MoELayer, Router
from moekit.moe.experts import GroupedExperts

LABEL = "moekit/"
MODULE_CATEGORIES = (  # first match wins, innermost labelled region wins at attribution
    (Attention, "attention"), (GroupedExperts, "expert_gemm"), (Router, "router"), (nn.RMSNorm, "norm"),
    (DenseMLP, "dense_ffn"), (nn.Embedding, "embedding"), (MoELayer, "moe_other"),
)
CATEGORIES = ("attention", "expert_gemm", "router", "permute_unpermute", "norm", "dense_ffn", "moe_other",
              "embedding", "head_loss", "optimizer", "communication", "other")
OPTIMIZER_REGIONS = ("Optimizer.step#", "Optimizer.zero_grad#")
COMM_WORDS = ("nccl", "c10d::", "all_to_all", "allreduce", "all_reduce", "reduce_scatter", "allgather", "all_gather")
HEAD_LOSS = "head_loss"
MEMORY_ENTRIES = 100_000  # allocator events the CUDA memory history keeps (a ring buffer)


# ---------------------------------------------------------------------------------------------------
# Labels: record_function ranges around modules, opened and closed by hooks
# ---------------------------------------------------------------------------------------------------


class Labels:
    """record_function ranges opened in one hook and closed in another (forward pre / post hooks)."""

    def __init__(self):
        self.stack: list[tuple[str, record_function]] = []

    def push(self, category: str) -> None:
        rf = record_function(LABEL + category)
        rf.__enter__()
        self.stack.append((category, rf))

    def pop(self) -> None:
        self.stack.pop()[1].__exit__(None, None, None)

    def pop_if(self, category: str) -> None:
        """Close the innermost range if it is ``category``'s (a hook that may run where none was opened)."""
        if self.stack and self.stack[-1][0] == category:
            self.pop()

    def close_all(self) -> None:
        while self.stack:
            self.pop()


class LabelledDispatcher:
    """Wraps a model's dispatcher so its permute and unpermute show up as labelled categories (one category
    for both by default; tools/bench/cpu_train.py splits them). Every other attribute is the wrapped one's."""

    def __init__(self, inner, dispatch_label: str = "permute_unpermute", combine_label: str = "permute_unpermute"):
        self.inner, self.dispatch_label, self.combine_label = inner, dispatch_label, combine_label

    def dispatch(self, *args, **kwargs):
        with record_function(LABEL + self.dispatch_label):
            return self.inner.dispatch(*args, **kwargs)

    def combine(self, *args, **kwargs):
        with record_function(LABEL + self.combine_label):
            return self.inner.combine(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _roots(model: nn.Module) -> list[nn.Module]:
    """The model and, under pipeline parallelism, this rank's stage modules (models.pipeline.PipelineModel)."""
    return [model, *getattr(model, "stages", ())]


def install_labels(model: nn.Module, labels: Labels, dispatch_labels: tuple[str, str] | None = None,
                   head_loss_ends_with_forward: bool = True) -> Callable[[], None]:
    """Label ``model``'s modules (MODULE_CATEGORIES), its MoE dispatchers (``dispatch_labels``: the permute's
    and the combine's category, default one "permute_unpermute") and its output head: "head_loss" opens after
    the final norm and, with ``head_loss_ends_with_forward``, closes when the model's (or its pipeline stage's)
    forward returns (otherwise the caller pops it once the loss is computed). Returns a function that removes every
    hook and wrapper again."""
    handles, wrapped = [], []
    for module in model.modules():
        category = next((c for cls, c in MODULE_CATEGORIES if isinstance(module, cls)), None)
        if category is None:
            continue
        handles.append(module.register_forward_pre_hook(lambda m, a, c=category: labels.push(c)))
        handles.append(module.register_forward_hook(lambda m, a, o: labels.pop()))
        if isinstance(module, MoELayer) and not isinstance(module.dispatcher, LabelledDispatcher):
            wrapped.append((module, module.dispatcher))
            module.dispatcher = LabelledDispatcher(module.dispatcher, *(dispatch_labels or ()))
    norms = {id(r.norm): r.norm for r in _roots(model) if isinstance(getattr(r, "norm", None), nn.Module)}
    for norm in norms.values():  # the output projection and the loss run after the final norm
        handles.append(norm.register_forward_hook(lambda m, a, o: labels.push(HEAD_LOSS)))
    if head_loss_ends_with_forward:
        for root in _roots(model):
            handles.append(root.register_forward_hook(lambda m, a, o: labels.pop_if(HEAD_LOSS)))

    def remove() -> None:
        for h in handles:
            h.remove()
        for module, inner in wrapped:
            module.dispatcher = inner
        labels.close_all()

    return remove


# ---------------------------------------------------------------------------------------------------
# Attribution: each op's self time to a category
# ---------------------------------------------------------------------------------------------------


def _label_of(event) -> str | None:
    while event is not None:
        if event.name.startswith(LABEL):
            return event.name[len(LABEL):]
        if event.name.startswith(OPTIMIZER_REGIONS):  # torch.optim's own ranges: whoever calls step()
            return "optimizer"
        if event.name.startswith("autograd::engine::evaluate_function"):
            return None  # backward: attributed through the sequence number instead
        event = event.cpu_parent
    return None


def _backward_seq(event) -> int | None:
    while event is not None:
        if event.name.startswith("autograd::engine::evaluate_function"):
            return event.sequence_nr
        event = event.cpu_parent
    return None


def attribute(events, on_gpu: bool):
    """Yield (event, category, microseconds of self time) for every op with time (on GPU: the device time
    of the kernels it launched). The category is the raw label (module docstring), "communication" or
    "other"; callers that keep a fixed set of categories map unknown labels themselves."""
    seq_category: dict[int, str] = {}
    for e in sorted(events, key=lambda e: e.time_range.start):  # forward ops: the last op that carries a
        label = _label_of(e)                                    # sequence number created that autograd node
        if label is not None and e.sequence_nr >= 0 and _backward_seq(e) is None:
            seq_category[e.sequence_nr] = label
    for e in events:
        if not str(getattr(e, "device_type", "CPU")).endswith("CPU"):
            continue  # GPU-side copies of record_function ranges: their kernels are already counted on the op
        us = e.self_device_time_total if on_gpu else e.self_cpu_time_total
        if us <= 0:
            continue
        names = [e.name.lower()] + [k.name.lower() for k in getattr(e, "kernels", [])]
        if any(w in n for n in names for w in COMM_WORDS):
            yield e, "communication", us
            continue
        label = _label_of(e)
        seq = _backward_seq(e)
        yield e, label if label is not None else seq_category.get(seq, "other") if seq is not None else "other", us


def categorize(events, on_gpu: bool) -> dict[str, float]:
    """Category (CATEGORIES) -> microseconds of self time (device time of the kernels an op launched, on GPU)."""
    totals = dict.fromkeys(CATEGORIES, 0.0)
    for _, cat, us in attribute(events, on_gpu):
        totals[cat if cat in totals else "other"] += us
    return totals


def top_ops(prof, on_gpu: bool, n: int = 15, averages=None) -> list[dict]:
    """The ``n`` operators with the most self time (``averages``: prof.key_averages(), when already made)."""
    key = "self_device_time_total" if on_gpu else "self_cpu_time_total"
    averages = prof.key_averages() if averages is None else averages
    ops = [a for a in averages if not a.key.startswith(LABEL)]  # labels would count their contents
    avgs = sorted(ops, key=lambda a: getattr(a, key), reverse=True)[:n]
    return [{"name": a.key[:80], "calls": a.count, "self_ms": getattr(a, key) / 1e3} for a in avgs]


def export_trace(prof, path: Path) -> Path:
    """The profiler's chrome trace as ``path`` + ".gz" (about 10x smaller; Perfetto and chrome://tracing read it)."""
    prof.export_chrome_trace(str(path))
    gz = path.with_name(path.name + ".gz")
    with open(path, "rb") as src, gzip.open(gz, "wb") as dst:
        shutil.copyfileobj(src, dst)
    path.unlink()
    return gz


# ---------------------------------------------------------------------------------------------------
# The trainer's profiler: which steps, and what each window writes
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Window:
    """One trace: steps ``first`` .. ``end - steps`` run the profiler unrecorded (warm-up), the last ``steps``
    up to ``end`` are recorded."""
    first: int
    end: int
    steps: int

    @property
    def warmup(self) -> int:
        return self.end - self.steps + 1 - self.first

    @property
    def recorded(self) -> range:
        return range(self.end - self.steps + 1, self.end + 1)


def window_at(step: int, every: int, steps: int, warmup: int, start_step: int = 0) -> Window | None:
    """The window that begins at ``step`` (1-based) for traces ending at each multiple of ``every``, in a run
    that resumed after ``start_step``: its warm-up shortened where the run began inside it, no window where the
    run began inside its recorded steps (a partial trace would misstate the step). None: no window begins here."""
    if every <= 0 or step <= start_step:
        return None
    end = -(-step // every) * every  # the next multiple of every, at or after step
    first_recorded = end - steps + 1
    first = max(first_recorded - warmup, start_step + 1, 1)
    if step != first or first > first_recorded:
        return None
    return Window(first, end, steps)


def windows(every: int, steps: int, warmup: int, start_step: int, last_step: int) -> list[Window]:
    """Every window a run from ``start_step`` + 1 to ``last_step`` records (for a plan, and for tests)."""
    return [w for s in range(start_step + 1, last_step + 1)
            if (w := window_at(s, every, steps, warmup, start_step)) is not None and w.end <= last_step]


class StepProfiler:
    """The trainer's side of ``[profile]``: ``begin(step)`` before a step's work, ``end(step)`` after it (before
    evaluation and checkpoints), ``report()`` once the step's records are written (rank 0 prints a finished
    window's line), ``close()`` when the run ends however it ends, ``on_error(...)`` from the failure path."""

    def __init__(self, section, run_dir: Path, rank: int, is_main: bool, device: torch.device, model: nn.Module,
                 start_step: int, last_step: int, module_labels: bool, print_fn: Callable[[str], None]):
        self.cfg, self.out = section, Path(run_dir) / "profile"
        self.rank, self.is_main, self.device, self.model = rank, is_main, device, model
        self.start_step, self.last_step = start_step, last_step
        self.module_labels, self.print = module_labels, print_fn
        self.on_gpu = device.type == "cuda"
        self.window: Window | None = None
        self.prof = None
        self.remove_labels: Callable[[], None] | None = None
        self.step_rf = None
        self.notes: list[str] = []
        self.memory = bool(section.memory) and self.on_gpu
        if self.memory:
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_ENTRIES)

    @property
    def active(self) -> bool:
        return self.prof is not None

    def begin(self, step: int) -> None:
        if self.prof is None:
            w = window_at(step, self.cfg.every, self.cfg.steps, self.cfg.warmup, self.start_step)
            if w is None or w.end > self.last_step:
                return
            self._start(w)
        self.step_rf = record_function(f"train_step#{step}")  # the run's step number in the trace
        self.step_rf.__enter__()

    def _start(self, w: Window) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.on_gpu:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.window = w
        with warnings.catch_warnings():  # "won't be using warmup": --profile.warmup 0, or a run resumed inside it
            warnings.filterwarnings("ignore", message=".*warmup.*")
            schedule = torch.profiler.schedule(wait=0, warmup=w.warmup, active=w.steps, repeat=1)
            self.prof = torch.profiler.profile(activities=activities, schedule=schedule,
                                               on_trace_ready=lambda p: self._save(p, w))
            self.prof.start()
        if self.module_labels:
            self.remove_labels = install_labels(self.model, Labels())

    def end(self, step: int) -> None:
        if self.prof is None:
            return
        if self.step_rf is not None:
            self.step_rf.__exit__(None, None, None)
            self.step_rf = None
        if self.on_gpu:
            torch.cuda.synchronize(self.device)  # the step's kernels inside its range
        self.prof.step()  # after the window's last step: on_trace_ready (_save)
        if step >= self.window.end:
            self._stop()

    def _stop(self) -> None:
        prof, self.prof = self.prof, None
        if self.remove_labels is not None:
            self.remove_labels()
            self.remove_labels = None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            prof.stop()
        self.window = None

    def close(self) -> None:
        """Stop a window the run left early (a failure, a signal, a non-finite stop): nothing is written for it."""
        if self.step_rf is not None:
            self.step_rf.__exit__(None, None, None)
            self.step_rf = None
        if self.prof is not None:
            self.prof.on_trace_ready = None
            self._stop()
        if self.memory:
            torch.cuda.memory._record_memory_history(enabled=None)
            self.memory = False

    def on_error(self, exc: BaseException, step: int, warn: Callable[[str], None]) -> Path | None:
        """With --profile.memory and an out-of-memory error at ``step``: the allocator's history that led to it,
        named in one line (``warn``); its path, or None."""
        if not self.memory or not (isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc)):
            return None
        folder = self.out / f"oom_step_{step:06d}"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"rank{self.rank}.memory.pickle"
        torch.cuda.memory._dump_snapshot(str(path))
        warn(f"rank {self.rank}: out of memory at step {step}; the allocator's history up to it: {path} (open it in "
             f"https://pytorch.org/memory_viz)")
        return path

    def _save(self, prof, w: Window) -> None:
        folder = self.out / f"step_{w.end:06d}"
        folder.mkdir(parents=True, exist_ok=True)
        trace = export_trace(prof, folder / f"rank{self.rank}.trace.json")
        totals = categorize(prof.events(), self.on_gpu)
        per_step = {c: us / 1e3 / w.steps for c, us in totals.items()}
        whole = sum(per_step.values())
        basis = "GPU kernel time" if self.on_gpu else "CPU op self time"
        averages = prof.key_averages()  # one aggregation of the trace for both tables
        ops = top_ops(prof, self.on_gpu, 20, averages)
        summary = {"steps": list(w.recorded), "warmup_steps": w.warmup, "rank": self.rank, "time_basis": basis,
                   "ms_per_step": whole, "categories_ms_per_step": per_step, "module_labels": self.module_labels,
                   "top_ops": ops, "trace": trace.name}
        if self.memory:
            memory = folder / f"rank{self.rank}.memory.pickle"
            torch.cuda.memory._dump_snapshot(str(memory))
            summary["memory_snapshot"] = memory.name
        (folder / f"rank{self.rank}.summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        sort = "self_cuda_time_total" if self.on_gpu else "self_cpu_time_total"
        lines = [f"steps {w.recorded.start}-{w.end} of rank {self.rank}: {basis}, ms per step", ""]
        lines += [f"  {c:<18} {ms:10.3f}  {ms / whole if whole else 0:6.1%}" for c, ms in per_step.items()]
        lines += ["", averages.table(sort_by=sort, row_limit=30)]
        (folder / f"rank{self.rank}.summary.txt").write_text("\n".join(lines) + "\n")
        if self.is_main:
            self.notes.append(describe(summary, trace))

    def report(self) -> None:
        for note in self.notes:
            self.print(note)
        self.notes.clear()


def plan_note(section, start_step: int, last_step: int, run_dir: Path) -> str:
    """The run's opening line for [profile]: which windows it will trace, or that it traces none."""
    planned = windows(section.every, section.steps, section.warmup, start_step, last_step)
    if not planned:
        return (f"note: --profile.every {section.every} traces no step of this run (steps {start_step + 1}-"
                f"{last_step}); lower it to profile")
    ends = ", ".join(str(w.end) for w in planned[:5]) + (" ..." if len(planned) > 5 else "")
    return (f"profile: {len(planned)} trace(s) of {section.steps} step(s) each, ending at steps {ends}, into "
            f"{Path(run_dir) / 'profile'}")


def describe(summary: dict, trace: Path) -> str:
    """The console line for a saved window (rank 0's)."""
    steps = summary["steps"]
    span = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}"
    whole = summary["ms_per_step"] or 1.0
    parts = sorted(((ms, c) for c, ms in summary["categories_ms_per_step"].items() if ms > 0), reverse=True)
    shares = ", ".join(f"{c} {ms / whole:.0%}" for ms, c in parts[:6])
    return (f"profile: {span}, {summary['ms_per_step']:.1f} ms/step of {summary['time_basis']} (rank 0): {shares}; "
            f"trace {trace} (https://ui.perfetto.dev), tables beside it")
