"""A running average of the parameters (--train.ema_decay): the exponential moving average DeepSeek-V3 keeps to
judge the model as it would be after the learning rate decays, without decaying it.

    ema <- ema + (1 - decay^every) (param - ema)        every ``every`` steps from step ``start`` on

It starts as a copy of the weights at its first update and is measured at every evaluation (metrics.jsonl
``val_loss_ema``: the validation loss with the averaged weights in place of the trained ones).

Where it lives: in the optimizer's state, one more tensor per parameter (``optimizer.state[p]["ema"]``), in the
parameter's dtype and layout, as AdamW's moments are. So it needs nothing of its own to be
    - sharded: a DTensor shaped like its parameter (TP, EP, FSDP shards; a pipeline rank holds its stages' only);
    - checkpointed and resumed under any other layout (DCP reshards the optimizer state: ``optim.state.<name>.ema``);
    - moved with its expert when the rebalancer moves experts (comm.relocate moves every state tensor shaped like the
      weights), and saved in logical expert order.
It costs 4 bytes per fp32 parameter on the device (AdamW's moments take 8), and one pass over the parameters per
update (``--train.ema_every`` n: one pass in n steps, each weighing decay^n).

A parameter's entry is created only once the optimizer has state for it (after its first gradient): torch's optimizers
create their state when it is empty, so an entry put there first would stop them from doing so.

Reading the average back: ``moekit-eval --ema``, ``moekit-generate --ema`` and ``moekit-convert moekit-to-hf --ema``
load a checkpoint's averaged weights instead of its trained ones (``read_template``).
"""
from __future__ import annotations

import contextlib
import math

import torch
from torch.distributed.tensor import DTensor

KEY = "ema"  # the optimizer-state entry of each parameter
RUN_KEY = "ema"  # the checkpoint's meta.json "run" record: {"decay", "every", "start"}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def half_life(decay: float, every: int = 1) -> float:
    """Steps after which a weight's share of the average has halved."""
    return every * math.log(0.5) / math.log(decay ** every)


def describe(decay: float, every: int, start: int) -> str:
    when = f"from step {start}" if start > 1 else "from the first step"
    cadence = f", updated every {every} steps" if every > 1 else ""
    return (f"parameter EMA: decay {decay:g} (half-life {half_life(decay, every):,.0f} steps){cadence}, {when}; "
            f"val_loss_ema at each evaluation")


class ParameterEMA:
    """The average of ``optimizer``'s parameters (module docstring); ``update(step)`` after each optimizer step,
    ``swapped()`` around an evaluation of the averaged weights."""

    def __init__(self, optimizer: torch.optim.Optimizer, decay: float, every: int = 1, start: int = 0):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"ema decay {decay} must be in (0, 1)")
        self.optimizer, self.decay, self.every, self.start = optimizer, decay, max(int(every), 1), int(start)
        self.params = [p for group in optimizer.param_groups for p in group["params"]]

    @property
    def started(self) -> bool:
        """Whether any parameter has an average (the same on every rank: updates happen at the same steps)."""
        return any(KEY in self.optimizer.state.get(p, {}) for p in self.params)

    def due(self, step: int) -> bool:
        return step >= self.start and step % self.every == 0

    def pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(average, parameter) local tensors of every parameter that has an average."""
        out = []
        for p in self.params:
            state = self.optimizer.state.get(p)
            if state and KEY in state:
                out.append((_local(state[KEY]), _local(p)))
        return out

    @torch.no_grad()
    def update(self, step: int) -> bool:
        """After the optimizer step of ``step``: fold the weights into the average (or start it) if it is due."""
        if not self.due(step):
            return False
        ema, weights = [], []
        for p in self.params:
            state = self.optimizer.state.get(p)
            if not state:  # the optimizer has not made its own state yet (module docstring)
                continue
            if KEY not in state:  # the average starts at the current weights
                state[KEY] = p.detach().clone(memory_format=torch.preserve_format)
                continue
            ema.append(_local(state[KEY]))
            weights.append(_local(p))
        if ema:  # one fused pass over every tensor (torch groups them by device and dtype)
            torch._foreach_lerp_(ema, weights, 1.0 - self.decay ** self.every)
        return True

    @contextlib.contextmanager
    def swapped(self):
        """The averaged weights in the parameters (and the trained ones in the average) for the block's duration,
        swapped back after it, whatever happens; one parameter's worth of extra memory at a time."""
        pairs = self.pairs()
        _swap(pairs)
        try:
            yield
        finally:
            _swap(pairs)

    def record(self) -> dict:
        """meta.json's "run" record of a checkpoint that holds the average."""
        return {"decay": self.decay, "every": self.every, "start": self.start}


@torch.no_grad()
def _swap(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for ema, p in pairs:
        kept = p.clone()
        p.copy_(ema)
        ema.copy_(kept)


def prime(optimizer: torch.optim.Optimizer) -> None:
    """Before a checkpoint's state is loaded (train.checkpoint.load): an average entry for every parameter the
    optimizer has state for, so the load template asks DCP for the stored ones. The optimizer's state must have been
    created first (get_optimizer_state_dict does that with a zero step)."""
    with torch.no_grad():
        for group in optimizer.param_groups:
            for p in group["params"]:
                state = optimizer.state.get(p)
                if state and KEY not in state:
                    state[KEY] = p.detach().clone(memory_format=torch.preserve_format)


def drop_unstored(optim_sd: dict, stored: set[str]) -> None:
    """Remove from a load template's optimizer state (get_optimizer_state_dict's form, under the "optim" key) the
    average entries the checkpoint does not hold (``stored``: its DCP keys); those averages start afresh at their
    next update."""
    states = optim_sd.get("state", {})
    for name, state in list(states.items()):
        if KEY in state and f"optim.state.{name}.{KEY}" not in stored:  # a copy: the dict may be the optimizer's own
            states[name] = {k: v for k, v in state.items() if k != KEY}


def stored_keys(path) -> set[str]:
    """Every DCP key of a checkpoint (its metadata only)."""
    import torch.distributed.checkpoint as dcp

    return set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)


def read_template(model: torch.nn.Module, model_sd: dict, path) -> dict:
    """The DCP template that reads checkpoint ``path``'s averaged weights into ``model_sd`` (``model``'s state dict:
    its tensors are filled in place): each parameter from ``optim.state.<name>.ema``, buffers (and any parameter the
    optimizer never updated, so never averaged) from ``model.<name>``. ValueError when the checkpoint holds no
    average at all."""
    stored = stored_keys(path)
    averaged = {n for n, _ in model.named_parameters() if f"optim.state.{n}.{KEY}" in stored}
    if not averaged:
        raise ValueError("it holds no parameter EMA (the run was trained without --train.ema_decay); drop --ema to "
                         "read its trained weights")
    return {"model": {n: t for n, t in model_sd.items() if n not in averaged},
            "optim": {"state": {n: {KEY: model_sd[n]} for n in sorted(averaged)}}}
