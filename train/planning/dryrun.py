"""``train.py --dry-run [--world-size N]``: plan a layout of N ranks in one CPU process, then exit.

    1. validate   moekit.train.plan.resolve_layout, as a real run: degrees against the world size and the
                  model (heads / tp, experts / ep, layers / pp, batch / data-parallel ranks), the batch
                  split; any error is one line and exit status 2
    2. build      a fake process group of N ranks (no peers, collectives return at once), every process
                  group and DeviceMesh of comm.topology, the model on the meta device (no memory), and
                  the real recipe: models.pipeline's stage split when pp > 1, then models.parallelize
    3. measure    rank 0's parameter shards as the recipe left them (DTensor: the local shard)
    4. estimate   moekit.train.planning.memory for the same rank (and every pipeline rank), side by side with the
                  measured shards; activations and all-to-all bytes come from the estimate only (a meta
                  model runs no forward). Disagreements are flagged; the peak is checked against the GPU, and
                  a peak above it ends the run with exit status 3 (DOES_NOT_FIT) after the full report

A layout the recipe does not support yet (it raises LayoutError / ValueError) still gets the estimate, with
the recipe's message. Nothing here allocates parameter memory: a 688B-parameter model plans in seconds.
"""
from __future__ import annotations

import math
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from moekit.comm.topology import Layout, LayoutError, Topology
from moekit.train.planning import memory
from moekit.train.planning.memory import MemoryEstimate, Stage, Workload
from moekit.train import UserError
from moekit.train.cli import Options, parse_args
from moekit.train.config import TrainConfig
from moekit.train.plan import ResolvedLayout, resolve_config
from moekit.train.upcycle import dense_read_peak

GIB = 2**30
TIGHT = 0.9  # above this share of device memory the CUDA context, NCCL buffers and fragmentation may not fit
DOES_NOT_FIT = 3  # exit status of a dry run whose peak exceeds --dry-run-gpu-gb (2 is bad input, 1 a failed run)


def main(argv: list[str] | None = None) -> int:
    """Entry point for ``train.py --dry-run``: 0 when planned and the peak fits (or is tight), DOES_NOT_FIT (3)
    when it exceeds the device memory (the whole report is printed first), 2 on bad input (one line on stderr)."""
    try:
        cfg, opts = parse_args(sys.argv[1:] if argv is None else argv)
        return run(cfg, opts)
    except UserError as exc:
        print(f"train.py: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2


# ---------------------------------------------------------------------------------------------------
# 1. the resolved layout (every check that needs no process group) and the workload
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DryRunPlan:
    """What the dry run plans for: the resolution the real run would make, and a GPU workload per rank."""

    resolved: ResolvedLayout  # moekit.train.plan.resolve_layout, exactly as a real run of this world size
    ranks_per_node: int  # layout.ranks_per_node, else 8 GPUs per node (or fewer ranks)
    workload: Workload

    @property
    def world(self) -> int:
        return self.resolved.world_size

    @property
    def hierarchical(self) -> bool | None:
        return self.resolved.hierarchical


def _stream(layout: Layout, wl: Workload) -> str:
    """", bf16 residual stream" where the run's residual stream is bf16 (train.residual_dtype: the planner's Shapes.r),
    ", fp32 residual stream" where it is fp32 under bf16 autocast; nothing for plain fp32."""
    if wl.dtype == "float32":
        return ""
    from moekit.train.planning.shapes import FP32, residual_bytes

    return ", fp32 residual stream" if residual_bytes(wl, layout) == FP32 else ", bf16 residual stream"


def plan_dry_run(cfg: TrainConfig, world_size: int | None = None) -> DryRunPlan:
    """``world_size`` None = WORLD_SIZE, or 1 (parse_args resolved --world-size into the degrees already)."""
    L, t = cfg.layout, cfg.train
    resolved = resolve_config(cfg, world_size)
    device = "cpu" if t.device == "cpu" else "cuda"  # the dry run plans for the GPUs a real run gets
    dtype = {"float32": "float32", "bfloat16": "bfloat16", "auto": "bfloat16" if device == "cuda" else "float32"}
    wl = Workload(resolved.micro_batch, t.seq_len, dtype[t.dtype], t.activation_checkpointing, device, resolved.accum,
                  L.pp_schedule, L.pp_stages_per_rank, L.sequence_parallel, document_mask=cfg.data.document_mask,
                  optimizer=t.optimizer, residual=t.residual_dtype, ema=t.ema_decay > 0,
                  trainable=trainable_shares(cfg))
    per_node = resolved.ranks_per_node or math.gcd(resolved.world_size, 8)  # default: 8 GPUs per node
    return DryRunPlan(resolved, per_node, wl)


def trainable_shares(cfg: TrainConfig) -> tuple[tuple[str, float], ...]:
    """Partial training (moekit.train.freezing): each part's share of elements that train, or () when all do. Expert
    stacks that train some experts (--train.train_experts) count whole: their gradient and state are whole tensors."""
    from moekit.models.transformer import Transformer, meta_device
    from moekit.train import freezing

    if not freezing.requested(cfg):
        return ()
    with meta_device():
        model = Transformer(cfg.model)
    from moekit.models.lora import is_adapter
    from moekit.train.planning.memory import LORA_SHARE

    fp = freezing.plan(model, cfg)
    total: dict[str, int] = {}
    trained: dict[str, int] = {}
    for name, p in model.named_parameters():
        part = LORA_SHARE if is_adapter(name) else part_of(name)  # LoRA adapters: a share of their own
        total[part] = total.get(part, 0) + p.numel()
        trained[part] = trained.get(part, 0) + (p.numel() if name in fp.trainable else 0)
    return tuple((part, trained[part] / total[part]) for part in sorted(total) if total[part])


# ---------------------------------------------------------------------------------------------------
# 2-3. fake process group, topology, meta model, the real recipe, rank 0's shards
# ---------------------------------------------------------------------------------------------------


@contextmanager
def fake_world(world: int):
    """A process group of ``world`` ranks in this process, this one rank 0; collectives do nothing."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise UserError("--dry-run plans in one process; run it with python, not under torchrun")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


@dataclass
class Built:
    topology: Topology
    seconds: dict[str, float]
    model_params: int  # the whole model's parameters
    measured: dict[str, int] | None = None  # rank 0's local parameter elements by part
    tensors: int = 0  # rank 0's parameter tensors
    refused: str = ""  # the recipe's message when it does not support the layout yet
    replicas: int = 0  # redundant expert slots over the EP group (--layout.expert_replicas / a placement file)
    dense_peak: int = 0  # --init-from-dense: host memory a rank holds at most while it upcycles (by slices)
    stages: list[Stage] = field(default_factory=list)  # every pipeline rank's layers (the real split if built)
    optimizer: tuple[str, int] = ("AdamW", 0)  # the run's optimizer and its state bytes on rank 0's shards
    trained: int = 0  # rank 0's parameter elements that train (all but frozen ones: moekit.train.freezing)
    freeze: str = ""  # partial training's summary line (FreezePlan.describe), or ""


def part_of(name: str) -> str:
    """The moekit.train.planning.memory part a parameter belongs to, from its (single-process) name."""
    from moekit.models.init import canonical_name

    n = canonical_name(name)
    for prefix, part in (("embed.", "embedding"), ("lm_head.", "head"), ("norm.", "norms")):
        if n.startswith(prefix):
            return part
    if n.startswith("mtp.") and n.split(".")[2] == "norm":  # a depth's final norm (models.mtp)
        return "norms"
    for key, part in ((".ffn.router.", "router"), (".ffn.experts.", "experts"),
                      (".ffn.shared_expert.", "shared_expert"), ("_norm.", "norms"), (".attn.", "attention"),
                      (".ffn.", "dense_ffn"), (".enorm.", "norms"), (".hnorm.", "norms"), (".eh_proj.", "mtp")):
        if key in n:
            return part
    return "other"


def local_numel(model: torch.nn.Module) -> tuple[dict[str, int], int]:
    """Elements of every parameter shard this rank holds, by part (a DTensor counts its local shard)."""
    out, count = {}, 0
    for name, p in model.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        out[part_of(name)] = out.get(part_of(name), 0) + local.numel()
        count += 1
    return out, count


def build(cfg: TrainConfig, plan: DryRunPlan) -> Built:
    from moekit.models.parallelize import parallelize
    from moekit.models.transformer import Transformer, meta_device
    from moekit.train import freezing
    from moekit.train.rebalance import RunPlacement

    L, seconds = cfg.layout, {}
    t0 = time.perf_counter()
    topo = Topology(plan.resolved.layout, 0, plan.ranks_per_node).build()
    seconds["groups and meshes"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    with meta_device():
        model = Transformer(cfg.model)
    seconds["meta model"] = time.perf_counter() - t0
    freeze = freezing.plan(model, cfg)  # --train.trainable / freeze / train_experts, as the trainer plans it
    built = Built(topo, seconds, sum(p.numel() for p in model.parameters()),
                  stages=memory.even_stages(cfg.model, topo.layout, L.pp_stages_per_rank))
    t0 = time.perf_counter()
    try:
        if L.pp > 1:
            model = _pipeline_stage(model, topo, cfg, built)
        placement = RunPlacement.for_run(cfg, topo, model)  # as the trainer: flag, file or contiguous
        built.replicas = placement.replicas
        if cfg.train.init_from_dense:
            built.dense_peak = dense_read_peak(cfg.model, cfg.train.upcycle_granularity)
        parallelize(model, topo, hierarchical=plan.hierarchical, sequence_parallel=L.sequence_parallel,
                    expert_placement=placement.placements)
    except (LayoutError, ValueError, NotImplementedError) as exc:
        built.refused = " ".join(str(exc).split())
        return built
    seconds["recipe"] = time.perf_counter() - t0
    freezing.apply(model, freeze)  # requires_grad as the run sets it: gradients and state for those only
    built.freeze = freeze.describe() if freeze is not None else ""
    built.measured, built.tensors = local_numel(model)
    built.trained = sum((p.to_local() if hasattr(p, "to_local") else p).numel()
                        for p in model.parameters() if p.requires_grad)
    built.optimizer = optimizer_state_bytes(model, cfg.train.optimizer, cfg.train.ema_decay > 0)
    return built


def optimizer_state_bytes(model, optimizer: str, ema: bool = False) -> tuple[str, int]:
    """(name, fp32 bytes) of the optimizer state for this rank's parameter shards: AdamW's two moments and step
    scalar per tensor; Muon's momentum buffer per weight matrix and AdamW's for the rest (train.muon); ``ema``: one
    more copy of every shard (the parameter average, moekit.train.ema)."""
    local = lambda p: p.to_local().numel() if hasattr(p, "to_local") else p.numel()  # noqa: E731
    # frozen parameters (moekit.train.freezing) have no state: only those that train are counted
    average = sum(local(p) * 4 for p in model.parameters() if p.requires_grad) if ema else 0
    name = "AdamW" if optimizer != "muon" else "Muon"
    if ema:
        name += " + parameter EMA"
    if optimizer != "muon":
        params = [p for p in model.parameters() if p.requires_grad]
        return name, sum(2 * local(p) * 4 + 4 for p in params) + average
    from moekit.train.muon import muon_param_groups

    total = 0
    for group in muon_param_groups(model, 0.0):
        per = 4 if group["kind"] == "muon" else None
        total += sum(local(p) * 4 if per else 2 * local(p) * 4 + 4 for p in group["params"] if p.requires_grad)
    return name, total + average


def _pipeline_stage(model, topo: Topology, cfg: TrainConfig, built: Built):
    """Rank 0's stage modules from the trainer's cost-balanced split; records every rank's layers."""
    try:
        from moekit.models.pipeline import build_pipeline
    except ImportError:
        raise NotImplementedError("pipeline parallelism is not available in this checkout (models.pipeline)")
    L = cfg.layout
    pipe = build_pipeline(model, topo, L.pp_schedule, L.pp_stages_per_rank, cfg.train.seq_len,
                          device=torch.device("cpu"))  # the stages never run here
    n = L.pp * L.pp_stages_per_rank
    built.stages = [Stage(r, tuple(i for s in range(r, n, L.pp) for i in pipe.ranges[s]), r == 0, (n - 1) % L.pp == r)
                    for r in range(L.pp)]
    return pipe.model


# ---------------------------------------------------------------------------------------------------
# 4. estimate and report
# ---------------------------------------------------------------------------------------------------


def run(cfg: TrainConfig, opts: Options) -> int:
    """Print the report; the exit status is 0, or DOES_NOT_FIT when the worst rank's peak exceeds --dry-run-gpu-gb
    (scripts and sweeps can test it without parsing the verdict)."""
    plan = plan_dry_run(cfg, opts.world_size)
    with fake_world(plan.world):
        built = build(cfg, plan)
    layout = built.topology.layout
    wl = replace(plan.workload, expert_replicas=built.replicas or cfg.layout.expert_replicas)
    estimates = [memory.estimate_memory(cfg.model, layout, wl, st, plan.ranks_per_node, plan.hierarchical)
                 for st in built.stages]
    a2a = memory.all_to_all(cfg.model, layout, wl, built.stages[0], plan.ranks_per_node, plan.hierarchical)
    print("\n".join(report(cfg, opts, plan, built, estimates, a2a)), flush=True)
    return 0 if fits(estimates, opts) else DOES_NOT_FIT


def gib(n: float) -> str:
    return f"{n / GIB:,.2f} GiB" if n else "0"


def _elements(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M" if n >= 1e5 else str(n)


def _ranges(layers: tuple[int, ...]) -> str:
    """(0, 1, 2, 5) -> '0-2, 5'."""
    out, start = [], None
    for i, x in enumerate(layers):
        start = x if start is None else start
        if i + 1 == len(layers) or layers[i + 1] != x + 1:
            out.append(f"{start}-{x}" if x > start else str(x))
            start = None
    return ", ".join(out) or "none"


def _sequence_parallel(layout: Layout, wl: Workload) -> str:
    """The header's SP clause: only where it means something (tp > 1) or was asked for in vain."""
    if layout.tp > 1:
        return f", sequence parallel {'on' if wl.sequence_parallel else 'off'}"
    return ", sequence parallel: no effect at tp 1" if wl.sequence_parallel else ""


def context_line(layout: Layout, wl: Workload) -> str:
    """How context parallelism splits each sequence (comm.context_parallel's zigzag chunks)."""
    cp, S = layout.cp, wl.seq_len
    c = S // (2 * cp)
    return (f"  cp {cp}: each sequence's {S} positions split into {2 * cp} chunks of {c}, {S // cp} per rank (zigzag: "
            f"rank r keeps chunks r and {2 * cp - 1} - r); attention all-gathers every layer's keys and values of "
            f"the whole sequence, the rest runs on the rank's own positions; activations are those of the cp rank "
            f"that keeps the most")


def describe_stage(st: Stage, cfg=None) -> str:
    """"layers 2-3 + final norm + lm_head"; with the model ``cfg``, a last stage's embedding replica, tied head and
    MTP depths are named too (models.pipeline)."""
    tied = cfg is not None and cfg.tie_embeddings
    mtp = cfg.mtp_layers if cfg is not None else 0
    extra = ["embedding"] if st.first else []
    if st.last:
        if not st.first and (tied or mtp):
            extra.append("embedding replica")
        extra.append("final norm + " + ("tied head" if tied else "lm_head"))
        if mtp:
            extra.append(f"{mtp} MTP depth{'s' if mtp > 1 else ''}")
    return f"layers {_ranges(st.layers)}" + "".join(f" + {e}" for e in extra)


def report(cfg: TrainConfig, opts: Options, plan: DryRunPlan, built: Built, estimates: list[MemoryEstimate],
           a2a: memory.A2A) -> list[str]:
    L, wl, topo = built.topology.layout, plan.workload, built.topology
    cp, folded = (f" x cp {L.cp}", "data- and context-parallel") if L.cp > 1 else ("", "data-parallel")
    tokens = f"{wl.seq_len // L.cp} tokens (its share of each sequence)" if L.cp > 1 else f"{wl.seq_len} tokens"
    lines = [f"dry run: {cfg.preset} ({_elements(built.model_params)} parameters) on {plan.world} ranks: "
             f"pp {L.pp} x dp {L.dp} x fsdp {L.fsdp}{cp} x tp {L.tp}, ep {L.ep} folded in the {L.dp_cp} "
             f"{folded} ranks; {topo.num_nodes} node(s) x {plan.ranks_per_node} ranks",
             "  fake process group; " + ", ".join(f"{k} {v:.2f} s" for k, v in built.seconds.items()),
             f"  per rank: micro-batch {wl.micro_batch} x {tokens}, {wl.microbatches} micro-batch(es) per "
             f"step, {wl.dtype}{' autocast' if wl.dtype != 'float32' else ''} on {wl.device}{_stream(L, wl)}, "
             f"activation checkpointing {wl.activation_checkpointing}{_sequence_parallel(L, wl)}"
             + (", attention within documents (every call masked)" if wl.document_mask else "")]
    if L.cp > 1:
        lines.append(context_line(L, wl))
    if built.refused:
        lines.append(f"  the recipe does not run this layout yet, so this is the estimate alone: {built.refused}")
    if built.freeze:  # gradients, optimizer state and the average: for the parameters that train
        lines.append(f"  {built.freeze}")
    lines += _memory_table(built, estimates[0])
    lines += _check_shards(built, estimates[0])
    if L.pp > 1:
        for est, st in zip(estimates, built.stages):
            lines.append(f"  pipeline rank {st.index}: {describe_stage(st, cfg.model)}: total {gib(est.total)}, "
                         f"peak {gib(est.peak)} ({memory.in_flight(L, wl, st.index):g} micro-batch(es) in flight)")
    worst = max(estimates, key=lambda e: e.peak)
    share = worst.peak / (opts.gpu_gb * GIB)
    verdict = "fits" if share <= TIGHT else "tight (CUDA context, NCCL buffers and fragmentation need room too)" \
        if fits(estimates, opts) else ("does NOT fit: raise ep / fsdp / tp / pp (cp for long sequences), lower the "
                                       f"micro-batch or checkpoint activations (exit status {DOES_NOT_FIT})")
    where = f" (pipeline rank {worst.stage})" if L.pp > 1 else ""
    if built.dense_peak:  # host memory, not the device's
        lines.append(f"  init: every rank upcycles its shards from the slices of the dense model they are made of "
                     f"(no rank reads it whole; host memory at most {gib(built.dense_peak)} at once: one dense MLP or "
                     f"embedding in fp32)")
    lines.append(f"memory: peak {gib(worst.peak)}{where} of {opts.gpu_gb:g} GiB per GPU ({share:.0%}): {verdict}")
    lines.append(_a2a_line(a2a, wl))
    return lines


def fits(estimates: list[MemoryEstimate], opts: Options) -> bool:
    """Whether the worst rank's peak is within --dry-run-gpu-gb ("tight", above TIGHT of it, still fits)."""
    return max(e.peak for e in estimates) <= opts.gpu_gb * GIB


def _memory_table(built: Built, est: MemoryEstimate) -> list[str]:
    m = built.measured
    shards = sum(m.values()) if m else None

    def row(name: str, measured: int | None, estimate: int) -> str:
        return f"  {name:<22}{gib(measured) if measured is not None else '-':>14}{gib(estimate):>14}"

    st = built.stages[0]
    lines = [f"rank 0 (pipeline rank 0: {describe_stage(st)})  {'shards':>14}{'estimate':>14}",
             row("parameters (fp32)", shards and shards * 4, est.params),
             row("gradients (fp32)", shards and built.trained * 4, est.grads),
             row(f"optimizer ({built.optimizer[0]})", shards and built.optimizer[1], est.optimizer),
             row("activations", None, est.activations),
             row("total", None, est.total),
             row("peak (+ transient)", None, est.peak)]
    parts = sorted(((k, v) for k, v in est.breakdown.items() if v), key=lambda kv: -kv[1])
    lines.append("  activations and transients: " + ", ".join(f"{k} {gib(v)}" for k, v in parts))
    return lines


def _check_shards(built: Built, est: MemoryEstimate) -> list[str]:
    """Rank 0's measured parameter elements by part against the estimate's; >1% apart is flagged."""
    if built.measured is None:
        return []
    parts = sorted(set(built.measured) | set(est.param_numel))
    off = [p for p in parts if abs(built.measured.get(p, 0) - est.param_numel.get(p, 0))
           > 0.01 * max(est.param_numel.get(p, 0), 1)]
    detail = ", ".join(f"{p} {_elements(built.measured.get(p, 0))}" + (
        f" (estimate {_elements(est.param_numel.get(p, 0))})" if p in off else "") for p in parts)
    if not off:
        return [f"  parameter shards by part (elements, as the recipe left them; the estimate agrees): {detail}"]
    return [f"  MISMATCH: the recipe's shards differ from moekit.train.planning.memory's for {', '.join(off)}: {detail}; "
            f"the estimate's sharding assumptions (models/memory.py docstring) need updating"]


def _a2a_line(a2a: memory.A2A, wl: Workload) -> str:
    if a2a.dispatcher == "none":
        return "all-to-all: none (ep 1: every rank holds all experts)"
    passes = "forward + backward" + (" + recomputed forward" if wl.activation_checkpointing != "none" else "")
    return (f"all-to-all per optimizer step, one rank ({a2a.dispatcher} dispatch, EP group on {a2a.nodes} node(s) x "
            f"{a2a.ranks_per_node} ranks; {passes}): inter-node {gib(a2a.step['inter'])}, intra-node "
            f"{gib(a2a.step['intra'])} ({a2a.inter_rows:.2f} / {a2a.intra_rows:.2f} rows per token and direction)")
