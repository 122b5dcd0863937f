"""What a run reports besides its records: console lines, progress bar, MFU, memory, TensorBoard, Weights &
Biases, GPU telemetry.

Optional packages (tensorboard, nvidia-ml-py) are used when installed and skipped silently otherwise;
``Monitor.describe()`` says which are active so a missing one is visible in the first lines of a run.
Weights & Biases (``wandb``, the ``wandb`` extra) is used only when asked for (``wandb=True``), and a
missing package or a failed ``wandb.init`` is then an error; ``WANDB_MODE=offline`` writes the run under
``<run_dir>/wandb`` without a network (``wandb sync`` uploads it later).

Per step the loop calls ``Monitor.step(metrics, load)`` with the per-layer summaries of
``moe.collect_load`` ({layer name: LoadSummary}). It adds ``loadstats.load_metrics`` to the metrics
(balance_loss, z_loss, cv, dead_experts) and sends to TensorBoard and W&B:

    every step                  the metrics' numbers (loss, aux_loss, balance_loss, z_loss, imbalance, ...)
    every ``load_every`` steps  per MoE layer: <stat>/<layer> for stat in imbalance, cv, dropped, dead_experts,
                                saturated_experts, balance_loss, z_loss (the unweighted router terms),
                                sequence_imbalance (routers with balance="sequence")
    every ``image_every`` steps and the last: expert_load/share, the [layers x experts] share of each
                                layer's tokens as an image, and expert_load/<layer>, a histogram of the
                                experts' load relative to the mean (1 = fair share)
"""
from __future__ import annotations

import os
import sys
import time

import numpy as np
import torch

from moekit.train import UserError
from moekit.train.loadstats import layer_load_stats, load_metrics

# Dense bf16 tensor-core peaks (FLOP/s) by device-name substring, most specific first. MFU is only
# reported for bf16 runs on a listed device: a made-up peak would make the number meaningless.
BF16_PEAK_FLOPS = {  # dense bf16 tensor-core peak per GPU, matched on the device name (longest key wins)
    "H200": 989e12, "H100 PCIe": 756e12, "H100 NVL": 835e12, "H100": 989e12, "GH200": 989e12, "B200": 2250e12,
    "A100": 312e12, "A10G": 70e12, "A10": 125e12, "L40S": 362e12, "L40": 181e12, "L4": 121e12, "RTX 4090": 165e12,
}


def peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    if device.type != "cuda" or dtype != torch.bfloat16:
        return None
    name = torch.cuda.get_device_name(device)
    return peak_for_name(name)


def peak_for_name(name: str) -> float | None:
    """"NVIDIA H100 NVL" is an H100 NVL, not an H100 SXM: the longest matching key decides."""
    matches = [k for k in BF16_PEAK_FLOPS if k in name]
    return BF16_PEAK_FLOPS[max(matches, key=len)] if matches else None


def peak_memory_gb(device: torch.device) -> float:
    """Peak allocated tensor memory on CUDA; peak resident set size of the process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    try:
        import resource
    except ImportError:  # not POSIX (Windows): no portable peak-RSS without extra packages
        return 0.0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**30 if sys.platform == "darwin" else peak / 2**20  # macOS reports bytes, Linux KiB


class GpuTelemetry:
    """Utilisation, power and temperature through nvidia-ml-py (``pynvml``), when present."""

    def __init__(self, device: torch.device):
        self.handle = None
        if device.type != "cuda":
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nvml = pynvml
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
        except Exception:  # package missing, or no NVML driver library: telemetry is optional
            self.handle = None

    def read(self) -> dict:
        if self.handle is None:
            return {}
        n, h = self.nvml, self.handle
        return {"gpu_util": n.nvmlDeviceGetUtilizationRates(h).gpu, "gpu_power_w": n.nvmlDeviceGetPowerUsage(h) / 1e3,
                "gpu_temp_c": n.nvmlDeviceGetTemperature(h, n.NVML_TEMPERATURE_GPU)}


LAYER_STATS = {"imbalance": "imbalance", "cv": "cv", "dropped": "dropped", "dead": "dead_experts",
               "saturated": "saturated_experts", "balance_loss": "balance_loss", "z_loss": "z_loss",
               "sequence_imbalance": "sequence_imbalance"}


def layer_scalars(load: dict) -> dict[str, float]:
    """{"<stat>/<layer>": value} of one step's per-layer load statistics (tags grouped by statistic)."""
    out = {}
    for name, row in layer_load_stats(load).items():
        for key, tag in LAYER_STATS.items():
            if key in row:
                out[f"{tag}/{name}"] = row[key]
    return out


def load_share(load: dict) -> np.ndarray:
    """[L, E] each expert's share of its layer's kept tokens in one step."""
    t = np.array([s.tokens_per_expert for s in load.values()], dtype=np.float64)
    tot = t.sum(axis=1, keepdims=True)
    return np.divide(t, tot, out=np.zeros_like(t), where=tot > 0)


def load_image(share: np.ndarray, min_size: int = 128) -> np.ndarray:
    """[H, W, 3] uint8 picture of an [L, E] share matrix (viridis when matplotlib is present, else grey),
    each cell scaled up so the picture is at least ``min_size`` pixels on its short side, at most ~1 MP."""
    L, E = share.shape
    peak = share.max() if share.size and share.max() > 0 else 1.0
    v = share / peak
    try:
        import matplotlib

        rgb = (matplotlib.colormaps["viridis"](v)[..., :3] * 255).astype(np.uint8)
    except ImportError:
        rgb = np.repeat((v * 255).astype(np.uint8)[..., None], 3, axis=2)
    ry = max(1, min(-(-min_size // max(L, 1)), 1024 // max(L, 1) or 1))
    rx = max(1, min(-(-min_size // max(E, 1)), 1024 // max(E, 1) or 1))
    return np.repeat(np.repeat(rgb, ry, axis=0), rx, axis=1)


class TensorBoard:
    """TensorBoard event files under ``log_dir`` (torch.utils.tensorboard; needs the tensorboard package)."""

    def __init__(self, log_dir: str, enabled: bool):
        self.writer = None
        self.installed = True
        if enabled:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.writer = SummaryWriter(log_dir)
            except ImportError:  # the tensorboard package is optional
                self.writer = None
                self.installed = False

    def write(self, metrics: dict) -> None:
        if self.writer is None:
            return
        for k, v in metrics.items():
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                self.writer.add_scalar(k, v, metrics["step"])

    def write_layers(self, step: int, scalars: dict[str, float]) -> None:
        if self.writer is None:
            return
        for tag, v in scalars.items():
            self.writer.add_scalar(tag, v, step)

    def write_load(self, step: int, load: dict) -> None:
        if self.writer is None:
            return
        share = load_share(load)
        self.writer.add_image("expert_load/share", load_image(share), step, dataformats="HWC")
        E = share.shape[1]
        for name, row in zip(load, share):
            self.writer.add_histogram(f"expert_load/{name}", row * E, step)  # 1 = the expert's fair share

    def flush(self) -> None:
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


WANDB_HINT = 'Weights & Biases logging needs the wandb package: pip install -e ".[wandb]" (or pip install wandb)'


class WandB:
    """A Weights & Biases run (``wandb``), logging what TensorBoard gets. ``enabled`` False: does nothing.

    The run's files go to ``<run_dir>/wandb``; WANDB_MODE (online, offline, disabled) and the other WANDB_*
    variables apply as usual. ``project``: the W&B project (default "moekit"); ``name``: the run's name
    (default the run directory's name); ``config``: the resolved TrainConfig as a dict. A resumed training
    run (``resume_step`` > 0) continues the W&B run it started (its id is kept in <run_dir>/wandb/)."""

    def __init__(self, run_dir: str, enabled: bool, project: str = "", name: str = "", config: dict | None = None,
                 resume_step: int = 0):
        self.run = None
        if not enabled:
            return
        try:
            import wandb
        except ImportError:
            raise UserError(WANDB_HINT) from None
        self.wandb = wandb
        os.makedirs(os.path.join(run_dir, "wandb"), exist_ok=True)
        id_file = os.path.join(run_dir, "wandb", "moekit-run-id")  # a resumed training run continues its W&B run
        run_id = None
        if resume_step > 0 and os.path.exists(id_file):
            with open(id_file, encoding="utf-8") as f:
                run_id = f.read().strip() or None
        try:
            self.run = wandb.init(project=project or "moekit", name=name or os.path.basename(os.path.normpath(run_dir)),
                                  dir=run_dir, config=config or {}, id=run_id, resume="allow" if run_id else None)
        except Exception as exc:  # no login, no network in online mode, a bad project name: say which, stop
            raise UserError(f"Weights & Biases: wandb.init failed ({' '.join(str(exc).split())[:300]}); log in "
                            f"(wandb login), set WANDB_MODE=offline to write the run locally, or turn it off "
                            f"(--log.wandb false)") from None
        with open(id_file, "w", encoding="utf-8") as f:
            f.write(self.run.id + "\n")

    def log(self, step: int, values: dict) -> None:
        if self.run is not None and values:
            self.run.log(values, step=step)

    def load_values(self, load: dict) -> dict:
        """The image and histograms of one step's load, as W&B media."""
        share = load_share(load)
        E = share.shape[1]
        out = {"expert_load/share": self.wandb.Image(load_image(share))}
        for name, row in zip(load, share):
            out[f"expert_load/{name}"] = self.wandb.Histogram(row * E)
        return out

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


class Progress:
    """A one-line bar on stderr, redrawn in place; only when stderr is a terminal (or forced on)."""

    def __init__(self, total: int, start: int, mode: str):
        self.total, self.start = total, start
        self.enabled = mode == "on" or (mode == "auto" and sys.stderr.isatty())
        self.t0 = time.perf_counter()

    def update(self, step: int, loss: float) -> None:
        if not self.enabled:
            return
        done = (step - self.start) / max(self.total - self.start, 1)
        elapsed = time.perf_counter() - self.t0
        eta = elapsed / done * (1 - done) if done > 0 else 0.0
        bar = "#" * int(30 * done) + "." * (30 - int(30 * done))
        sys.stderr.write(f"\r[{bar}] {step}/{self.total} loss {loss:.3f} eta {eta:4.0f}s ")
        sys.stderr.flush()

    def clear(self) -> None:
        if self.enabled:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()


def format_line(m: dict) -> str:
    """The structured console line: key=value pairs, fixed order, greppable."""
    parts = [f"step={m['step']}", f"loss={m['loss']:.4f}", f"aux_loss={m['aux_loss']:.4f}"]
    if m.get("mtp_loss") is not None:  # multi-token prediction (models.mtp)
        parts.append(f"mtp_loss={m['mtp_loss']:.4f}")
    parts += [f"lr={m['lr']:.2e}", f"grad_norm={m['grad_norm']:.3f}", f"tokens_per_s={m['tokens_per_s']:.0f}"]
    if m.get("mfu") is not None:
        parts.append(f"mfu={100 * m['mfu']:.1f}%")
    parts.append(f"mem_gb={m['mem_gb']:.2f}")
    if m.get("imbalance") is not None:
        parts.append(f"imbalance={m['imbalance']:.2f}/{m['imbalance_max']:.2f}")
        parts.append(f"dropped={100 * m['dropped_fraction']:.1f}%")
    if m.get("max_logit") is not None:  # QK-clip (--train.qk_clip): the largest attention logit, heads rescaled
        parts.append(f"max_logit={m['max_logit']:.2f} qk_clipped={m.get('qk_clipped_heads', 0)}")
    if "val_loss" in m:
        parts.append(f"val_loss={m['val_loss']:.4f}")
    if m.get("val_loss_ema") is not None:  # --train.ema_decay: the averaged weights on the same windows
        parts.append(f"val_loss_ema={m['val_loss_ema']:.4f}")
    if m.get("val_mtp_loss") is not None:
        parts.append(f"val_mtp_loss={m['val_mtp_loss']:.4f}")
    for name, r in (m.get("tasks") or {}).items():  # --eval.tasks: accuracy per character of the choice
        parts.append(f"acc_norm[{name}]={r['acc_norm']:.3f}")
    for name, r in (m.get("tasks_ema") or {}).items():  # the same with the parameter average (--train.ema_decay)
        parts.append(f"acc_norm_ema[{name}]={r['acc_norm']:.3f}")
    return " ".join(parts)


BY_SOURCE = ("val_loss_by_source", "tokens_by_source")  # metrics.jsonl's per-set dicts (a blend)


def source_scalars(m: dict) -> dict[str, float]:
    """{"<key>/<set file name>": value} for the per-set dicts of a metrics row (TensorBoard / W&B scalars); the
    full path where two sets share a file name. Also each --eval.tasks task's "tasks/<name>/acc", "acc_norm" and "correct_nll",
    and each part's gradient norm, "grad_norm/<part>" (moekit.train.grad_parts)."""
    from moekit.train.data import set_names

    out = {}
    for key in BY_SOURCE:
        values = m.get(key) or {}
        out.update((f"{key}/{name}", v) for name, v in zip(set_names(values), values.values()))
    for group in ("tasks", "tasks_ema"):  # --eval.tasks (train.task_loop), and with the parameter average
        for name, r in (m.get(group) or {}).items():
            out.update({f"{group}/{name}/{key}": r[key] for key in ("acc", "acc_norm", "correct_nll")})
    out.update((f"grad_norm/{part}", v) for part, v in (m.get("grad_norm_by_part") or {}).items())  # train.grad_parts
    return out


class Monitor:
    """Everything per-step output goes through: console, progress bar, TensorBoard, W&B, telemetry.

    ``load_every``: per-layer scalars every n steps (the expert-load record's stride is a good choice);
    ``image_every``: the load image and histograms every n steps (default 10 x load_every) and at the last.
    ``wandb``, ``wandb_project``, ``wandb_name``, ``config``: the optional Weights & Biases run (class WandB)."""

    def __init__(self, run_dir: str, device: torch.device, total: int, start: int, log_every: int,
                 tensorboard: bool, progress: str, *, load_every: int = 1, image_every: int = 0, wandb: bool = False,
                 wandb_project: str = "", wandb_name: str = "", config: dict | None = None):
        self.log_every = log_every
        self.load_every = max(1, load_every)
        self.image_every = image_every or 10 * self.load_every
        self.telemetry = GpuTelemetry(device)
        self.tb = TensorBoard(f"{run_dir}/tensorboard", tensorboard)
        self.wandb = WandB(run_dir, wandb, wandb_project, wandb_name, config, start)
        self.progress = Progress(total, start, progress)
        self.total = total
        self._window = [0.0, 0.0]  # since the last console line: tokens, seconds

    def describe(self) -> str:
        def state(active, asked=True, installed=True):
            return "on" if active else ("off (not installed)" if asked and not installed else "off")

        tb = state(self.tb.writer, installed=self.tb.installed)
        return (f"tensorboard {tb}, wandb {'on' if self.wandb.run is not None else 'off'}, gpu telemetry "
                f"{state(self.telemetry.handle, installed=False)}")

    def step(self, m: dict, load: dict | None = None) -> dict:
        """One optimizer step's output. ``load``: {layer: LoadSummary} of that step (moe.collect_load), which
        adds balance_loss, z_loss, cv and dead_experts to ``m`` and the per-layer logging (class doc)."""
        m.update(self.telemetry.read())
        step = m["step"]
        if load:
            m.update(load_metrics(load))
        self.tb.write(m)
        values = {k: v for k, v in m.items() if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
        by_source = source_scalars(m)  # a blend's per-set values, one scalar each
        if by_source:
            self.tb.write_layers(step, by_source)
            values.update(by_source)
        if load and (step % self.load_every == 0 or step == self.total):
            scalars = layer_scalars(load)
            self.tb.write_layers(step, scalars)
            values.update(scalars)
        if load and (step % self.image_every == 0 or step == self.total):
            self.tb.write_load(step, load)
            if self.wandb.run is not None:
                values.update(self.wandb.load_values(load))
        self.wandb.log(step, values)
        tps, seconds = m.get("tokens_per_s") or 0.0, m.get("step_s") or 0.0
        if tps > 0 and seconds > 0:
            self._window[0] += tps * seconds
            self._window[1] += seconds
        if step % self.log_every == 0 or step == self.total or "val_loss" in m:
            self.print(format_line(self._over_window(m)))
        self.progress.update(step, m["loss"])
        return m

    def _over_window(self, m: dict) -> dict:
        """The console line's values: tokens_per_s and mfu over every step since the last line (the steps' tokens
        over their summed time; metrics.jsonl keeps each step's own), the rest this step's."""
        tokens, seconds = self._window
        self._window = [0.0, 0.0]
        if seconds <= 0 or not m.get("tokens_per_s"):
            return m
        shown = {**m, "tokens_per_s": tokens / seconds}
        if m.get("mfu") is not None:  # proportional to tokens/s (the same FLOPs per token and peak every step)
            shown["mfu"] = m["mfu"] * shown["tokens_per_s"] / m["tokens_per_s"]
        return shown

    def print(self, line: str) -> None:
        self.progress.clear()
        print(line, flush=True)

    def close(self) -> None:
        self.progress.clear()
        self.tb.close()
        self.wandb.close()
