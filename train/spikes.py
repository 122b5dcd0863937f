"""Loss-spike skipping (``--train.spike_skip Z``): a step whose loss or gradient norm is more than Z standard
deviations above the mean of the last ``--train.spike_window`` good steps gets no optimizer update, as a
non-finite step under ``--train.on_nonfinite skip`` (moekit.train.guard): its gradients are dropped, the schedule
and the routers' bias updates do not move, and its batch is consumed. MoE runs spike more than dense ones (a
router that tips many tokens onto a few experts at once); one bad batch then costs a skipped step instead of a
detour of hundreds.

The statistics need a full window: the first ``spike_window`` steps of a run are never skipped. Skipped steps do not
enter the window, so a spike does not raise the bar for the next one. Every rank sees the same loss and
gradient norm (both are reduced over the ranks), and the verdict rides on the step's non-finite all-reduce, so
all ranks skip together. The window is saved with each checkpoint (meta.json's run record) and read back on
``--resume``, so a resumed run skips the same steps as an uninterrupted one; a resume onto new data
(``--checkpoint.exclude_from_loading data``) starts an empty window, as the old data's losses say nothing about
the new.

Skips in a row, spikes and non-finite steps together, stop the run after guard.MAX_CONSECUTIVE_SKIPS: a loss
that stays that high has moved, not spiked.
"""
from __future__ import annotations

import math
from collections import deque

STATE_KEY = "spike_window"  # meta.json's run record: [[loss, grad_norm], ...], oldest first


class SpikeGuard:
    def __init__(self, z: float, window: int, saved: list | None = None):
        self.z, self.window = z, window
        self.values: deque[tuple[float, float]] = deque(maxlen=window)
        for row in saved or ():
            if isinstance(row, (list, tuple)) and len(row) == 2 and all(isinstance(v, (int, float)) for v in row):
                self.values.append((float(row[0]), float(row[1])))

    def check(self, loss: float, grad_norm: float) -> tuple[str, float, str] | None:
        """(what spiked: "loss" or "gradient norm", its value, how far) or None. Non-finite values are the
        non-finite guard's."""
        if len(self.values) < self.window or not (math.isfinite(loss) and math.isfinite(grad_norm)):
            return None
        for i, (name, value) in enumerate((("loss", loss), ("gradient norm", grad_norm))):
            column = [v[i] for v in self.values]
            mean = sum(column) / len(column)
            std = math.sqrt(sum((v - mean) ** 2 for v in column) / (len(column) - 1))
            if value > mean + self.z * std:
                sigmas = (value - mean) / std if std > 0 else math.inf
                return name, value, (f"{sigmas:.1f} standard deviations above the mean {mean:.4g} of the last "
                                     f"{len(column)} steps (--train.spike_skip {self.z:g})")
        return None

    def accept(self, loss: float, grad_norm: float) -> None:
        """A step that updated the model: its values join the window."""
        self.values.append((loss, grad_norm))

    def state(self) -> list[list[float]]:
        return [list(v) for v in self.values]
