"""What a run reports besides its records: console lines, progress bar, MFU, memory, TensorBoard, GPU telemetry.

Optional packages (tensorboard, nvidia-ml-py) are used when installed and skipped silently otherwise;
``Monitor.describe()`` says which are active so a missing one is visible in the first lines of a run.
"""
from __future__ import annotations

import sys
import time

import torch

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


class TensorBoard:
    def __init__(self, log_dir: str, enabled: bool):
        self.writer = None
        if enabled:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.writer = SummaryWriter(log_dir)
            except ImportError:  # the tensorboard package is optional
                self.writer = None

    def write(self, metrics: dict) -> None:
        if self.writer is None:
            return
        for k, v in metrics.items():
            if k != "step" and isinstance(v, (int, float)):
                self.writer.add_scalar(k, v, metrics["step"])

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


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
    parts = [f"step={m['step']}", f"loss={m['loss']:.4f}", f"aux_loss={m['aux_loss']:.4f}", f"lr={m['lr']:.2e}",
             f"grad_norm={m['grad_norm']:.3f}", f"tokens_per_s={m['tokens_per_s']:.0f}"]
    if m.get("mfu") is not None:
        parts.append(f"mfu={100 * m['mfu']:.1f}%")
    parts.append(f"mem_gb={m['mem_gb']:.2f}")
    if m.get("imbalance") is not None:
        parts.append(f"imbalance={m['imbalance']:.2f}/{m['imbalance_max']:.2f}")
        parts.append(f"dropped={100 * m['dropped_fraction']:.1f}%")
    if "val_loss" in m:
        parts.append(f"val_loss={m['val_loss']:.4f}")
    return " ".join(parts)


class Monitor:
    """Everything per-step output goes through: console, progress bar, TensorBoard, telemetry."""

    def __init__(self, run_dir: str, device: torch.device, total: int, start: int, log_every: int,
                 tensorboard: bool, progress: str):
        self.log_every = log_every
        self.telemetry = GpuTelemetry(device)
        self.tb = TensorBoard(f"{run_dir}/tensorboard", tensorboard)
        self.progress = Progress(total, start, progress)
        self.total = total

    def describe(self) -> str:
        on = lambda x: "on" if x else "off (not installed)"  # noqa: E731
        return f"tensorboard {on(self.tb.writer)}, gpu telemetry {on(self.telemetry.handle)}"

    def step(self, m: dict) -> dict:
        m.update(self.telemetry.read())
        self.tb.write(m)
        if m["step"] % self.log_every == 0 or m["step"] == self.total or "val_loss" in m:
            self.print(format_line(m))
        self.progress.update(m["step"], m["loss"])
        return m

    def print(self, line: str) -> None:
        self.progress.clear()
        print(line, flush=True)

    def close(self) -> None:
        self.progress.clear()
        self.tb.close()
