"""What a run derives from its configuration before building anything.

    resolve_layout   the [layout] settings + world size + model + batch -> ResolvedLayout: comm's Layout
                     (degrees, dp inferred) and the per-rank batch split; raises LayoutError only. The
                     command line's checks, the real run and ``--dry-run`` all use it (resolve_config).
    plan_run         the real run's RunPlan: device, dtype, the resolved layout, memory check
    lr_lambda, make_optimizer

The global batch of B sequences splits over the D = dp * fsdp data-parallel ranks (per_rank = B / D each),
and each rank's share into ``accum`` micro-batches of ``micro_batch`` sequences:

    B = D x per_rank,   per_rank = accum x micro_batch
    pp = 1: micro_batch = train.micro_batch_size (0 = per_rank), accum = gradient accumulation steps
    pp > 1: accum = M, the pipeline's micro-batches per step: layout.pp_microbatches, else the count that
            train.micro_batch_size implies, else 2 * pp (fewer bubbles than pp)

A batch-size ramp (train.batch_size_start, train.batch_ramp_steps; ``RunPlan.step_batch``) gives step s the
batch start + (B - start)(s - 1) / ramp_steps rounded down to a multiple of start, and B from step ramp_steps + 1
on: the same batches under every layout (start must split over the D ranks). Each rank's share runs in equal
micro-batches of the largest size that divides it and is at most micro_batch, so the memory check of the final
batch covers the ramp. Under a pipeline every step keeps the final batch's micro-batch size and runs fewer of them
(the schedule for each count is built when first needed: comm.pipeline.PipelineRunner), so the ramp's first batch
must give each data-parallel rank whole micro-batches, and every count of the ramp must suit the schedule.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from moekit.comm.context_parallel import check_context_parallel
from moekit.comm.pipeline import check_schedule
from moekit.comm.tensor_parallel import check_sequence_parallel, check_tensor_parallel
from moekit.comm.topology import Layout, LayoutError, world_size_from_env
from moekit.models.config import ModelConfig
from moekit.models.pipeline import check_pipeline_model
from moekit.models.stats import model_stats
from moekit.models.transformer import Transformer
from moekit.train import UserError
from moekit.train.config import LayoutSection, TrainConfig, TrainSection
from moekit.train.validation import residual_dtype, run_device

HIERARCHICAL = {"auto": None, "on": True, "off": False}


@dataclass(frozen=True)
class ResolvedLayout:
    """The degrees a run uses and how its global batch splits over them (see the module docstring)."""

    layout: Layout  # comm's degrees, dp inferred, validated against the world size and the model
    ranks_per_node: int  # as set; 0 = the launcher's (torchrun's LOCAL_WORLD_SIZE), checked to divide the world
    hierarchical: bool | None  # layout.hierarchical: None = auto (when the EP group spans nodes)
    per_rank: int  # sequences per step on one data-parallel rank
    micro_batch: int  # sequences per forward (per pipeline micro-batch when pp > 1)
    accum: int  # micro-batches per step: gradient accumulation, or the pipeline's M when pp > 1

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def data_parallel(self) -> int:
        """D: the ranks that each read their own share of the global batch."""
        return self.layout.data_parallel


def resolve_layout(settings: LayoutSection, world_size: int, model: ModelConfig,
                   train: TrainSection) -> ResolvedLayout:
    """Degrees against the world size and the model, then the batch split; LayoutError naming value and fix.

    ``train`` supplies the batch settings: batch_size, micro_batch_size, seq_len. Nothing is built and no
    process group is needed, so every rank (and the dry run, for any world size) refuses alike, up front.
    """
    S = settings
    if S.dp < 0:
        raise LayoutError(f"--dp={S.dp} is invalid; it must be a positive integer, or 0 to infer it from the world size")
    layout = Layout.infer(world_size, pp=S.pp, dp=S.dp or None, fsdp=S.fsdp, tp=S.tp, ep=S.ep,
                          num_experts=model.num_experts or None, cp=S.cp)
    if S.ranks_per_node < 0:
        raise LayoutError(f"--ranks-per-node={S.ranks_per_node} is invalid; it must be >= 0 (0 = torchrun's "
                          f"LOCAL_WORLD_SIZE)")
    if S.ranks_per_node and world_size % S.ranks_per_node:
        raise LayoutError(f"--ranks-per-node {S.ranks_per_node} must divide the world size {world_size}")
    check_tensor_parallel(model, layout.tp)  # heads and widths
    check_context_parallel(model, layout.cp, train.seq_len)  # the sequence's zigzag chunks
    if S.sequence_parallel:
        check_sequence_parallel(train.seq_len // layout.cp, layout.tp)
    per_rank, micro, accum = _batch_split(layout, S, train)
    check_batch_ramp(train, layout, S, micro)
    try:
        check_schedule(S.pp_schedule, layout.pp, S.pp_stages_per_rank, accum if layout.pp > 1 else None)
        if layout.pp > 1:
            check_pipeline_model(model, layout.pp * S.pp_stages_per_rank)
    except ValueError as exc:  # comm.pipeline / models.pipeline speak ValueError: one error type here
        raise LayoutError(str(exc)) from None
    if layout.pp > 1 and per_rank % accum:
        raise LayoutError(f"--pp {layout.pp}: each data-parallel rank's {per_rank} sequences do not split into "
                          f"{accum} equal micro-batches; set --layout.pp_microbatches (or --train.micro_batch_size) "
                          f"to a divisor of {per_rank}, or change --batch-size")
    if layout.pp > 1 and train.micro_batch_size and train.micro_batch_size * accum != per_rank:
        raise LayoutError(f"--train.micro_batch_size {train.micro_batch_size} x --layout.pp_microbatches {accum} != "
                          f"{per_rank} sequences per data-parallel rank; set one of them (the other follows)")
    if S.hierarchical not in HIERARCHICAL:
        raise LayoutError(f"--layout.hierarchical {S.hierarchical!r}: use auto, on or off")
    if not 0 < S.timeout_s < 1e9:  # also nan and inf, which timedelta refuses with a traceback
        raise LayoutError(f"--layout.timeout_s {S.timeout_s}: must be a number of seconds in (0, 1e9)")
    return ResolvedLayout(layout, S.ranks_per_node, HIERARCHICAL[S.hierarchical], per_rank, micro, accum)


def _batch_split(layout: Layout, S: LayoutSection, train: TrainSection) -> tuple[int, int, int]:
    """(per_rank, micro_batch, accum); the pipeline's micro-batch count is checked by the caller."""
    B, mbs, D = train.batch_size, train.micro_batch_size, layout.data_parallel
    if B % D:
        raise LayoutError(f"--batch-size {B} must split into {D} data-parallel shares (dp*fsdp), one per rank; use "
                          f"a multiple of {D}, e.g. --batch-size {D * max(1, B // D)}")
    per_rank = B // D
    if layout.pp > 1:  # the pipeline's micro-batches are the accumulation
        M = S.pp_microbatches or (max(per_rank // mbs, 1) if mbs else 2 * layout.pp)
        return per_rank, per_rank // M, M
    micro = mbs or per_rank
    if per_rank % micro:
        raise LayoutError(f"--batch-size {B} must split into {D} data-parallel shares of whole micro-batches of "
                          f"{micro} (--train.micro_batch_size); use a micro-batch size that divides {per_rank}")
    return per_rank, micro, per_rank // micro


def check_batch_ramp(train: TrainSection, layout: Layout, S: LayoutSection | None = None, micro: int = 1) -> None:
    """A ramp's batches (multiples of its first) must split over the data-parallel ranks, and under a pipeline
    into whole micro-batches of ``micro`` sequences, in counts the schedule runs (module docstring)."""
    start, D = train.batch_size_start, layout.data_parallel
    if not start:
        return
    if start % D:
        raise LayoutError(f"--train.batch_size_start {start} must split into {D} data-parallel shares (dp*fsdp), as "
                          f"every batch of the ramp (a multiple of it) does; use a multiple of {D}, e.g. "
                          f"{D * max(1, start // D)}")
    if layout.pp == 1:
        return
    if (start // D) % micro:
        raise LayoutError(f"--train.batch_size_start {start}: under --pp {layout.pp} every step of the ramp runs the "
                          f"final batch's micro-batches of {micro} sequences, and the first batch gives each of the {D} "
                          f"data-parallel ranks {start // D}; use a multiple of {D * micro}, e.g. {D * micro}")
    counts = sorted({ramped_batch(train, s) // D // micro for s in range(1, train.batch_ramp_steps + 2)})
    for count in counts:
        try:
            check_schedule(S.pp_schedule, layout.pp, S.pp_stages_per_rank, count)
        except ValueError as exc:
            raise LayoutError(f"--train.batch_size_start {start}: a step of the ramp runs {count} micro-batches of "
                              f"{micro}: {exc}") from None


@dataclass(frozen=True)
class StepBatch:
    """One step's global batch and its split (a batch-size ramp's step, or the run's own)."""

    size: int  # sequences of the global batch
    per_rank: int
    micro_batch: int
    accum: int


def ramped_batch(train: TrainSection, step: int) -> int:
    """The global batch of ``step`` (from 1) under train's ramp (module docstring); batch_size without one."""
    start, final, steps = train.batch_size_start, train.batch_size, train.batch_ramp_steps
    if not start or step > steps:
        return final
    return (start + (final - start) * (step - 1) // steps) // start * start


def micro_split(per_rank: int, micro: int) -> int:
    """The largest micro-batch that divides ``per_rank`` sequences and is at most ``micro``."""
    return next(m for m in range(min(micro, per_rank), 0, -1) if per_rank % m == 0)


def resolve_config(cfg: TrainConfig, world_size: int | None = None) -> ResolvedLayout:
    """resolve_layout for a whole config; ``world_size`` None = this launch's (torchrun's WORLD_SIZE).

    The trainer's form: a LayoutError becomes UserError (one line, exit 2)."""
    try:
        world = world_size_from_env() if world_size is None else world_size
        return resolve_layout(cfg.layout, world, cfg.model, cfg.train)
    except LayoutError as exc:
        raise UserError(str(exc)) from None


@dataclass
class RunPlan:
    """What the real run derives once: device, dtype, the resolved layout and batch split, throughput terms."""

    device: torch.device
    autocast_dtype: torch.dtype | None  # None = plain fp32
    resolved: ResolvedLayout
    tokens_per_step: int
    flops_per_token: float
    residual_dtype: torch.dtype | None = None  # the residual stream's (train.residual_dtype); None = the parameters'

    @property
    def micro_batch(self) -> int:
        return self.resolved.micro_batch

    @property
    def accum(self) -> int:
        return self.resolved.accum

    @property
    def per_rank(self) -> int:
        return self.resolved.per_rank

    def step_batch(self, train: TrainSection, step: int) -> StepBatch:
        """Step ``step``'s batch and split: the ramp's (train.batch_size_start), else the run's own."""
        r = self.resolved
        size = ramped_batch(train, step)
        if size == train.batch_size:
            return StepBatch(size, r.per_rank, r.micro_batch, r.accum)
        per_rank = size // r.data_parallel
        micro = micro_split(per_rank, r.micro_batch)
        return StepBatch(size, per_rank, micro, per_rank // micro)


def plan_run(cfg: TrainConfig, world_size: int | None = None) -> RunPlan:
    t = cfg.train
    want, dtype = run_device(t)
    if want == "cuda" and not torch.cuda.is_available():
        raise UserError("--train.device=cuda but torch sees no CUDA device; use --train.device cpu")
    device = torch.device(want)
    resolved = resolve_config(cfg, world_size)
    stats = model_stats(cfg.model, t.seq_len)
    check_memory(cfg, resolved, device, dtype, stats.params)
    return RunPlan(device, dtype, resolved, t.batch_size * t.seq_len, stats.train_flops_per_token,
                   residual_dtype(t, want, dtype))


def check_memory(cfg: TrainConfig, resolved: ResolvedLayout, device: torch.device, dtype: torch.dtype | None,
                 params: int) -> None:
    """Refuse a run whose per-rank memory estimate (weights, gradients, AdamW state and a micro-batch's
    activations: moekit.train.planning.memory, an upper bound within a few percent on measured runs) is more
    than the device has: it would die in an out-of-memory kill (on a CPU without a message) at its first step."""
    from moekit.train.planning.memory import Workload, estimate_memory

    t, L = cfg.train, resolved.layout
    wl = Workload(resolved.micro_batch, t.seq_len, "bfloat16" if dtype == torch.bfloat16 else "float32",
                  t.activation_checkpointing, device.type, resolved.accum, cfg.layout.pp_schedule,
                  cfg.layout.pp_stages_per_rank, cfg.layout.sequence_parallel, optimizer=t.optimizer,
                  residual=t.residual_dtype, ema=t.ema_decay > 0)
    est = estimate_memory(cfg.model, L, wl, ranks_per_node=resolved.ranks_per_node or None,
                          hierarchical=resolved.hierarchical)
    have = device_memory(device)
    if est.peak <= have:
        return
    state = est.params + est.grads + est.optimizer
    fix = ("a smaller --batch-size, or --train.micro_batch_size to split it into micro-batches" if state < have / 2
           else "a smaller model (mixtral-tiny, switch-tiny, deepseek-tiny), or more ranks (--ep, --fsdp) to shard it")
    raise UserError(f"{cfg.preset} ({params / 1e9:.1f}B parameters): a rank needs ~{est.peak / 2**30:,.1f} GiB "
                    f"({state / 2**30:,.1f} GiB weights, "
                    f"gradients and AdamW state; {(est.peak - state) / 2**30:,.1f} GiB activations of a micro-batch "
                    f"of {resolved.micro_batch} x {t.seq_len} tokens), but this {device.type} has "
                    f"{have / 2**30:,.1f} GiB; use {fix} (moekit-train --dry-run shows the estimate by term)")


def device_memory(device: torch.device) -> int:
    """Bytes of memory the device has (a CPU: the machine's RAM)."""
    return (torch.cuda.mem_get_info(device)[1] if device.type == "cuda"
            else os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


DECAY_SHAPES = {  # train.wsd_decay: the decay's shape over its own progress q in [0, 1], 1 at its start, 0 at its end
    "linear": lambda q: 1 - q,
    "sqrt": lambda q: 1 - math.sqrt(q),  # 1 - sqrt: the cooldown of Hagele et al. 2024
    "cosine": lambda q: 0.5 * (1 + math.cos(math.pi * q)),
}


def lr_lambda(cfg: TrainConfig):
    """The LR multiplier of step s (0-based; multiplies train.lr): linear warmup to 1 over warmup_steps, then,
    over the rest (progress p from 0 at step warmup_steps to 1 at the last step, steps - 1), down to min_lr_ratio:
    cosine, linear, constant (stays 1), or wsd (warmup-stable-decay: 1 until p reaches 1 - decay_fraction, then
    wsd_decay's shape; decay_steps n: over the last n steps, its progress (step - (steps - n)) / (n - 1) counted in
    steps, so the first of them is exactly 1 and the last the floor). The last step trains at lr * min_lr_ratio,
    however short the decay."""
    t = cfg.train
    floor, shape = t.min_lr_ratio, DECAY_SHAPES[t.wsd_decay]

    def f(step: int) -> float:
        if step < t.warmup_steps:
            return (step + 1) / t.warmup_steps
        p = min((step - t.warmup_steps) / max(t.steps - 1 - t.warmup_steps, 1), 1.0)
        if t.lr_schedule == "constant":
            return 1.0
        if t.lr_schedule == "linear":
            return floor + (1 - floor) * (1 - p)
        if t.lr_schedule == "wsd" and t.decay_steps:  # in whole steps: no rounding at the decay's first step
            q = (step - (t.steps - t.decay_steps)) / (t.decay_steps - 1)
            return 1.0 if q <= 0 else floor + (1 - floor) * shape(min(q, 1.0))
        if t.lr_schedule == "wsd":
            start = 1 - t.decay_fraction
            return 1.0 if p < start else floor + (1 - floor) * shape((p - start) / t.decay_fraction)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * p))

    return f


def make_optimizer(model: Transformer, cfg: TrainConfig, freeze=None) -> torch.optim.Optimizer:
    """``freeze``: the run's moekit.train.freezing.FreezePlan (applied to ``model``): frozen parameters get no
    optimizer state, masked expert stacks groups of their own."""
    from moekit.train.freezing import lr_scales, optimizer_groups

    t = cfg.train
    scales = lr_scales(t.lr_scale)  # --train.lr_scale: groups at lr x factor
    if t.optimizer == "muon":  # Muon on the weight matrices, AdamW on the rest (train/muon.py)
        from moekit.train.muon import Muon, muon_param_groups

        return Muon(optimizer_groups(muon_param_groups(model, t.weight_decay), freeze, model, t.lr, scales), lr=t.lr,
                    betas=(t.beta1, t.beta2), eps=t.eps, momentum=t.muon_momentum)
    decay = [p for p in model.parameters() if p.dim() >= 2]  # matrices, expert stacks, embeddings
    rest = [p for p in model.parameters() if p.dim() < 2]  # norm scales
    groups = optimizer_groups([{"params": decay, "weight_decay": t.weight_decay},
                               {"params": rest, "weight_decay": 0.0}], freeze, model, t.lr, scales)
    # foreach (a few ops over all tensors instead of ~15 per parameter: 3x less optimizer time on the CPU main
    # job) rounds exactly as the per-parameter loop does, so every layout computes the same numbers. The loop
    # stays where a parameter is a DTensor (TP, EP, FSDP): foreach ops refuse a list mixing DTensors and
    # plain tensors. torch's fused CPU kernel is faster still but rounds differently (~1e-7 per step).
    # On a GPU, torch's fused kernel is one pass over each parameter's weight, gradient and two moments:
    # ~29 GB per step for mixtral-1b, ~7 ms on an H200, where foreach took 21.6 ms in 392 kernels
    # (docs/benchmarks.md, first GPU round). It rounds like the CPU fused kernel (~1e-7 off foreach per
    # step); a sharded model keeps the per-parameter loop (the list mixes DTensors and plain tensors).
    sharded = any(hasattr(p, "to_local") for p in model.parameters())
    on_gpu = all(p.device.type == "cuda" for p in model.parameters())
    if on_gpu and not sharded:
        return torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, fused=True)
    return torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, foreach=not sharded)
