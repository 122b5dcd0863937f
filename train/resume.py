"""Resuming with changed settings: each change is applied and reported in one line, or refused with why.

A checkpoint records the settings of the run that wrote it (meta.json "run": the resolved config and the
tokens trained so far; older checkpoints fall back to the run directory's config.json). On resume the
current settings are compared with those:

* refused (UserError before anything is built or written): what the checkpoint's data position or RNG
  streams depend on -- the seed, the sequence length, the data and its validation split (a --data.val_path added
  or dropped; one validation file for another is applied). With ``--checkpoint.exclude_from_loading data`` the
  data settings and the sequence length are applied instead (a new data phase: an annealing mix, longer
  context): the checkpoint's data position is then not loaded, and the new data is drawn in a fresh order
  keyed on the seed and the step the phase began at (meta.json "run" records that step as "data_phase", so a
  restart inside the phase continues it exactly: its data settings equal its checkpoint's). The model's
  shape is checked by moekit.train.checkpoint.check_model.
* ignored, and the checkpoint's value kept in config.json: ``train.init_from_hf``, ``train.init_from_dense``
  ``train.upcycle_granularity`` and ``train.upcycle_drop`` (the weights come from the checkpoint).
* applied, everything else: the optimizer's lr, betas, eps and weight decay and the LR schedule (steps,
  warmup, minimum) take the new values (``apply_optimizer_settings``: the restored AdamW moments stay; so
  does AdamW's implementation, fused on a GPU and foreach on CPU, whatever device wrote the checkpoint),
  the batch size (token counts continue from the recorded total), the layout (DCP reshards), logging,
  evaluation and checkpoint settings.

So config.json, written after this, records what actually runs.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from moekit.train import UserError
from moekit.train.consistency import flatten

REFUSED = {
    "train.seed": "the data order and router noise of the checkpoint follow its seed",
    "train.seq_len": "the checkpoint's data position counts windows of its sequence length",
    "data.path": "the checkpoint's data position indexes its token data",
    "data.text": "the checkpoint's data position indexes its token data",
    "data.val_fraction": "the train / validation split of the checkpoint's data position would move",
    "data.blend": "the checkpoint's data position counts windows drawn from each set of its blend",
    "data.dtype": "the checkpoint's data position indexes its token data",
    "train.optimizer": "the checkpoint's optimizer state is that optimizer's (AdamW's moments, or Muon's momentum)",
    # moekit.train.freezing: the optimizer holds state for the parameters (and expert rows) that train
    "train.trainable": "the checkpoint's optimizer state holds the parameters that trained",
    "train.freeze": "the checkpoint's optimizer state holds the parameters that trained",
    "train.train_experts": "the checkpoint's optimizer state and its frozen experts follow that selection",
    "train.lr_scale": "the checkpoint's optimizer parameter groups follow its learning-rate multipliers",
    # from one validation file to another is applied (compare); adding or dropping one is refused
    "data.val_path": "with a validation file the training data trains whole, without one its held-out blocks do not: "
                     "the checkpoint's data position counts the other set of windows",
}
VAL_PATH = "data.val_path"
# what the data position depends on besides the seed: --checkpoint.exclude_from_loading data lets them change
DATA_KEYS = ("train.seq_len", "data.path", "data.text", "data.blend", "data.dtype", "data.val_fraction", VAL_PATH)
EXCLUDE_DATA = "data"
KEPT = {"train.init_from_hf": "the resumed weights come from the checkpoint",
        "train.init_from": "the resumed weights come from the checkpoint",
        "train.init_from_dense": "the resumed weights come from the checkpoint",
        "train.upcycle_granularity": "the resumed weights come from the checkpoint",
        "train.upcycle_drop": "the resumed weights come from the checkpoint"}
# compared by checkpoint.check_model (shape-changing fields refused there, with their own message)
MODEL_PREFIX = "model."
NOT_COMPARED = {"log.run_dir"}  # a run directory may be moved or copied between attempts
HYPERPARAMETERS = ("betas", "eps", "weight_decay")
# How this run's AdamW computes (train.plan.make_optimizer: fused on a GPU, foreach on CPU): a checkpoint
# written on another device must not carry its implementation over (torch's load_state_dict would)
IMPLEMENTATION = ("foreach", "fused", "capturable")


@dataclass
class Changes:
    applied: list[tuple[str, Any, Any]] = field(default_factory=list)
    kept: list[tuple[str, Any, Any]] = field(default_factory=list)  # (key, checkpoint's value, asked for)
    refused: list[tuple[str, Any, Any]] = field(default_factory=list)
    new_data: bool = False  # the data settings changed under --checkpoint.exclude_from_loading data

    def summary(self) -> str:
        """One line for the run's log ("" when nothing changed)."""
        parts = []
        if self.applied:
            parts.append("applied " + ", ".join(f"{k} {_show(a)} -> {_show(b)}" for k, a, b in self.applied))
        if self.kept:
            parts.append("ignored " + ", ".join(f"{k}={_show(b)} ({KEPT[k]})" for k, _, b in self.kept))
        if self.new_data:
            parts.append("the checkpoint's data position is not loaded (--checkpoint.exclude_from_loading data): "
                         "the new data is drawn afresh from this step")
        return f"resuming with changed settings: {'; '.join(parts)}" if parts else ""


def _show(value: Any) -> str:
    return repr(value) if isinstance(value, str) else json.dumps(value)


def saved_run(checkpoint: Path) -> dict | None:
    """The "run" record of a checkpoint's meta.json ({"config": ..., "tokens": ...}), or for checkpoints
    written before it existed, {"config": <run dir>/config.json} when that file is there; else None."""
    try:
        meta = json.loads((checkpoint / "meta.json").read_text())
    except (OSError, ValueError):
        meta = {}
    if isinstance(meta.get("run"), dict) and isinstance(meta["run"].get("config"), dict):
        return meta["run"]
    legacy = checkpoint.parent.parent / "config.json"
    try:
        return {"config": json.loads(legacy.read_text())}
    except (OSError, ValueError):
        return None


def compare(saved: dict[str, Any], current: dict[str, Any], exclude: tuple[str, ...] = ()) -> Changes:
    """Sort every setting that differs between the checkpoint's config and this run's (nested dicts). ``exclude``:
    the parts of the checkpoint this resume does not load (--checkpoint.exclude_from_loading)."""
    old, new = flatten(saved), flatten(current)
    changes = Changes()
    for key in sorted(set(old) | set(new)):
        if key in NOT_COMPARED or key not in old or key not in new or old[key] == new[key]:
            continue  # a key only one side has: a setting added or retired between moekit versions
        if key.startswith(MODEL_PREFIX) and key != "model.expert_backend":
            continue
        if key == VAL_PATH and bool(old[key]) == bool(new[key]):
            changes.applied.append((key, old[key], new[key]))  # another validation file: the training windows stay
            continue
        if key in DATA_KEYS and EXCLUDE_DATA in exclude:  # a new data phase
            changes.applied.append((key, old[key], new[key]))
            changes.new_data = True
            continue
        bucket = changes.refused if key in REFUSED else changes.kept if key in KEPT else changes.applied
        bucket.append((key, old[key], new[key]))
    return changes


def check(saved_config: dict[str, Any] | None, current: dict[str, Any], checkpoint: Path,
          exclude: tuple[str, ...] = ()) -> Changes:
    """Compare, and raise one UserError naming every refused change with its reason and the fix."""
    if saved_config is None:
        return Changes()
    changes = compare(saved_config, current, exclude)
    if changes.refused:
        why = "; ".join(f"{k} {_show(a)} -> {_show(b)}: {REFUSED[k]}" for k, a, b in changes.refused)
        keep = " ".join(f"--{k} {a}" for k, a, _ in changes.refused)
        new_data = ("; or go on with the new data from this step, its position afresh, with "
                    "--checkpoint.exclude_from_loading data" if all(k in DATA_KEYS for k, _, _ in changes.refused)
                    else "")
        raise UserError(f"cannot resume {checkpoint} with changed settings ({why}); resume with {keep}, or "
                        f"start a fresh run (a new --run-dir, or --overwrite instead of --resume){new_data}")
    return changes


def data_phase(run: dict | None, changes: Changes, step: int) -> int:
    """The step this run's data phase began at: ``step`` (the checkpoint's) when this resume changes the data,
    else the phase the checkpoint recorded (0: the run's first)."""
    if changes.new_data:
        return step
    return int((run or {}).get("data_phase", 0))


def keep_checkpoint_values(current: dict[str, Any], changes: Changes) -> dict[str, Any]:
    """``current`` with the ignored settings set back to the checkpoint's values (for config.json)."""
    out = json.loads(json.dumps(current))
    for key, old, _ in changes.kept:
        section, name = key.split(".", 1)
        out[section][name] = old
    return out


def optimizer_settings(optimizer) -> list[dict[str, Any]]:
    """Per param group: the base lr (``initial_lr``, set by the LR scheduler) and AdamW's hyperparameters."""
    keys = HYPERPARAMETERS + IMPLEMENTATION
    return [{"initial_lr": g.get("initial_lr", g["lr"]), **{k: g[k] for k in keys if k in g}}
            for g in optimizer.param_groups]


def apply_optimizer_settings(optimizer, scheduler, fresh: list[dict[str, Any]]) -> None:
    """After a checkpoint restored the optimizer and scheduler: put back this run's base lr and AdamW
    hyperparameters (``fresh``, read with ``optimizer_settings`` before loading) and recompute the current lr
    from this run's schedule at the restored step. With unchanged settings every value is recomputed
    exactly as the scheduler computed it, so a resume stays bitwise."""
    if len(fresh) != len(optimizer.param_groups):
        raise UserError(f"checkpoint's optimizer has {len(optimizer.param_groups)} parameter groups, this run "
                        f"{len(fresh)}: it was written by another moekit version; start a fresh run")
    for group, want in zip(optimizer.param_groups, fresh):
        group.update(want)
        if group.get("fused") or group.get("capturable"):
            # these kernels keep the step count on the parameter's device (torch moves it there on load
            # only when the checkpoint itself was fused): a CPU checkpoint resumed on a GPU
            for p in group["params"]:
                step = optimizer.state.get(p, {}).get("step")
                if isinstance(step, torch.Tensor) and step.device != p.device:
                    optimizer.state[p]["step"] = step.to(device=p.device, dtype=torch.float32)
    scheduler.base_lrs = [w["initial_lr"] for w in fresh]
    lrs = [base * fn(scheduler.last_epoch) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(optimizer.param_groups, lrs):
        if not math.isfinite(lr):
            raise UserError(f"the LR schedule gives lr={lr} at step {scheduler.last_epoch}; check --train.lr")
        group["lr"] = lr
    scheduler._last_lr = lrs  # what get_last_lr() reports until the next step


def tokens_at(run: dict | None, step: int, tokens_per_step: int) -> int:
    """Tokens trained before ``step``: the checkpoint's own count when it recorded one, else (older
    checkpoints) its step times the batch of the config it was written with, else of this run."""
    if run and isinstance(run.get("tokens"), int):
        return run["tokens"]
    cfg = (run or {}).get("config") or {}
    t = cfg.get("train", {})
    if isinstance(t.get("batch_size"), int) and isinstance(t.get("seq_len"), int):
        return step * t["batch_size"] * t["seq_len"]
    return step * tokens_per_step
