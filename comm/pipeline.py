"""Pipeline-parallel plumbing over torch.distributed.pipelining (model-agnostic).

One optimizer step on a pipeline of P ranks, K = P * v stages (v per rank), M micro-batches:

    every rank: step(args, target, M, kwargs)      args/kwargs/target: the whole batch [B, ...]
        torch splits each into M contiguous chunks along dim 0 (the trainer's micro-batching)
        first stage: forward(args_m, **kwargs_m)   other stages: forward(received, **kwargs_m)
        last stage:  loss_m = loss_fn(out_m, target_m) / M  -> backward
        gradients accumulate in the stage parameters: sum_m grad(loss_m / M), as one process does
    loss = sum_m loss_m on the last stage -> broadcast to every rank of the pipeline

Scaling: torch's schedules can instead divide gradients by M after the backward (``scale_grads``);
we divide each micro-batch loss by M and pass scale_grads=False, so that (1) the MoE aux loss, which
layers inject into backward with their ``aux_loss_scale``, is not divided a second time: the caller sets
that scale once (``moe.layer.set_aux_loss_scale(model, microbatches=M, token_slices=tp)``), as the
trainer does, (2) the arithmetic is the single-process trainer's, and (3) gradients that exist before the
step are not divided.

Schedules: gpipe (all forwards, then all backwards), 1f1b, interleaved (Interleaved 1F1B, v >= 2
stages per rank placed loop-style: stage k on pipeline rank k % P).

Stage modules give their input / output shapes statically (``io_meta``), so torch runs no
shape-probing forward: such a forward would record expert load and run EP all-to-alls on garbage.
"""
from __future__ import annotations

import re
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

# torch.distributed.pipelining class of each schedule name (imported when a pipeline is built: it pulls in
# torch._dynamo, seconds that a run without a pipeline should not pay)
SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B"}


def check_schedule(schedule: str, pp: int, stages_per_rank: int, microbatches: int | None = None) -> None:
    """ValueError naming the value and the fix for a schedule torch cannot run (its own requirements)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"layout.pp_schedule={schedule!r} is unknown; use one of {list(SCHEDULES)}")
    for name, v in (("pp", pp), ("layout.pp_stages_per_rank", stages_per_rank)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name}={v!r} is invalid; it must be a positive integer")
    if schedule == "interleaved" and stages_per_rank < 2:
        raise ValueError(f"layout.pp_schedule=interleaved needs layout.pp_stages_per_rank >= 2 (got "
                         f"{stages_per_rank}); raise it, or use layout.pp_schedule 1f1b or gpipe")
    if schedule != "interleaved" and stages_per_rank != 1:
        raise ValueError(f"layout.pp_schedule={schedule} runs one stage per rank, but layout.pp_stages_per_rank="
                         f"{stages_per_rank}; use layout.pp_schedule interleaved or layout.pp_stages_per_rank 1")
    if microbatches is None:
        return
    if not isinstance(microbatches, int) or isinstance(microbatches, bool) or microbatches < 1:
        raise ValueError(f"layout.pp_microbatches={microbatches!r} is invalid; it must be a positive integer")
    if schedule == "1f1b" and microbatches < pp:
        raise ValueError(f"layout.pp_schedule=1f1b needs at least pp={pp} micro-batches per step, got "
                         f"{microbatches}; raise layout.pp_microbatches (and the batch) or use gpipe")
    rounds = max(1, microbatches // pp)  # torch's Interleaved 1F1B runs micro-batches in equal rounds
    if schedule == "interleaved" and microbatches % rounds:
        good = [m for m in range(pp, 4 * pp + 1) if m % max(1, m // pp) == 0]
        raise ValueError(f"layout.pp_schedule=interleaved needs the micro-batch count to split into rounds of "
                         f"~pp={pp}: {microbatches} is not a multiple of {rounds}; use e.g. one of {good}")


def stage_ids_of(pp_rank: int, pp: int, stages_per_rank: int) -> list[int]:
    """The stages pipeline rank ``pp_rank`` runs: loop-style, stage k on rank k % pp (torch's placement)."""
    return [pp_rank + i * pp for i in range(stages_per_rank)]


class PipelineRunner:
    """This rank's stages + the schedule that runs one step's micro-batches through the pipeline.

    stages: this rank's stage modules, in ``stage_ids`` order; each has ``io_meta(*micro_args)`` ->
    (example inputs, example outputs) meta tensors for one micro-batch (static stage shapes).
    loss_fn(output, target) -> the mean loss of one micro-batch.
    group: the pipeline's process group, ranks in stage order.
    """

    def __init__(self, stages: Sequence[nn.Module], stage_ids: list[int], num_stages: int, group, schedule: str,
                 loss_fn: Callable[[Tensor, Tensor], Tensor], device: torch.device):
        pp = dist.get_world_size(group)
        check_schedule(schedule, pp, len(stages))
        assert stage_ids == stage_ids_of(dist.get_rank(group), pp, len(stages)) and num_stages == pp * len(stages)
        self.stages, self.stage_ids, self.num_stages = list(stages), stage_ids, num_stages
        self.group, self.schedule, self.loss_fn, self.device = group, schedule, loss_fn, device
        self.last_rank = (num_stages - 1) % pp  # group rank that holds the last stage (computes the loss)
        self._cache: dict[tuple, object] = {}

    def _schedule_for(self, train: bool, microbatches: int, args: tuple):
        """The schedule for this mode and micro-batch shape, built once and reused (stage shapes are
        static; every rank asks for the same keys in the same order). One training schedule is kept: a
        batch-size ramp's steps run growing micro-batch counts, each once it is reached."""
        micro = tuple(a.tensor_split(microbatches)[0] for a in args)  # one micro-batch: its shapes
        key = (train, microbatches, tuple((tuple(a.shape), a.dtype) for a in micro))
        if key not in self._cache:
            if train:  # a batch-size ramp moves to another count for good: the earlier step's schedule goes
                for old in [k for k in self._cache if k[0]]:
                    del self._cache[old]
            self._cache[key] = self._build_schedule(train, microbatches, micro)
        return self._cache[key]

    def _build_schedule(self, train: bool, microbatches: int, micro: tuple):
        from torch.distributed import pipelining

        stages = []
        for module, sid in zip(self.stages, self.stage_ids):
            inputs, outputs = module.io_meta(*micro)
            stages.append(pipelining.PipelineStage(module, sid, self.num_stages, self.device, input_args=inputs,
                                                   output_args=outputs, group=self.group))

        def loss_fn(output: Tensor, target: Tensor) -> Tensor:  # see the module docstring: scale_grads=False
            return self.loss_fn(output, target) / microbatches

        name = self.schedule if train or self.schedule == "interleaved" else "gpipe"  # eval: no 1F1B minimum
        cls = getattr(pipelining, SCHEDULES[name])
        return cls(stages if name == "interleaved" else stages[0], microbatches, loss_fn=loss_fn, scale_grads=False)

    def _run(self, train: bool, args: tuple, target: Tensor, microbatches: int, kwargs: dict | None) -> Tensor:
        if train:
            check_schedule(self.schedule, dist.get_world_size(self.group), len(self.stages), microbatches)
        elif not isinstance(microbatches, int) or microbatches < 1:
            raise ValueError(f"microbatches={microbatches!r} is invalid; it must be a positive integer")
        B = args[0].shape[0]
        if B % microbatches:
            raise ValueError(f"a batch of {B} sequences does not split into {microbatches} equal micro-batches; "
                             f"make the per-rank batch a multiple of layout.pp_microbatches")
        schedule = self._schedule_for(train, microbatches, args)
        losses: list[Tensor] = []
        run = schedule.step if train else schedule.eval
        run(*args, target=target, losses=losses, return_outputs=False, **(kwargs or {}))
        # the last stage holds each micro-batch's loss / M: their sum is the mean micro-batch loss
        zero = torch.zeros((), device=self.device)  # ranks without the last stage: replaced by the broadcast
        loss = torch.stack([x.detach().float() for x in losses]).sum() if losses else zero
        return broadcast_from(loss, self.last_rank, self.group)

    def step(self, args: tuple, target: Tensor, microbatches: int, kwargs: dict | None = None) -> Tensor:
        """Forward + backward of one step's micro-batches; returns the mean micro-batch loss on every rank.
        MoE layers must already scale their aux loss by 1/microbatches (see the module docstring)."""
        return self._run(True, args, target, microbatches, kwargs)

    def evaluate(self, args: tuple, target: Tensor, microbatches: int = 1, kwargs: dict | None = None) -> Tensor:
        """Forward-only pass; the mean micro-batch loss on every rank."""
        return self._run(False, args, target, microbatches, kwargs)


def broadcast_from(value: Tensor, group_src: int, group) -> Tensor:
    """``value`` of group rank ``group_src`` on every rank of ``group`` (a new tensor)."""
    out = value.detach().clone().contiguous()
    dist.broadcast(out, group=group, group_src=group_src)
    return out


def _natural_key(name: str) -> list:
    """'layers.10.ffn' after 'layers.2.ffn': module order of a model whose layers are numbered."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def gather_load(load: dict, group) -> dict:
    """Merge the {layer name: LoadSummary} dicts of every rank of ``group`` (the pipeline) onto each of
    them, ordered by layer number, so one record holds every MoE layer of the model. Collective."""
    parts: list[dict | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, load, group=group)
    merged = {}
    for part in parts:
        for name, summary in part.items():
            assert name not in merged, f"MoE layer {name} is on two pipeline stages"
            merged[name] = summary
    return {name: merged[name] for name in sorted(merged, key=_natural_key)}
