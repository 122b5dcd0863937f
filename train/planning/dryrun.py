"""``train.py --dry-run [--world-size N]``: plan a layout of N ranks in one CPU process, then exit.

    1. validate   degrees against the world size and the model (heads / tp, experts / ep, layers / pp,
                  batch / data-parallel ranks): any error is one line and exit status 2
    2. build      a fake process group of N ranks (no peers, collectives return at once), every process
                  group and DeviceMesh of comm.topology, the model on the meta device (no memory), and
                  the real recipe: models.pipeline's stage split when pp > 1, then models.parallelize
    3. measure    rank 0's parameter shards as the recipe left them (DTensor: the local shard)
    4. estimate   moekit.train.planning.memory for the same rank (and every pipeline rank), side by side with the
                  measured shards; activations and all-to-all bytes come from the estimate only (a meta
                  model runs no forward). Disagreements are flagged; the peak is checked against the GPU.

A layout the recipe does not support yet (it raises LayoutError / ValueError) still gets the estimate, with
the recipe's message. Nothing here allocates parameter memory: a 688B-parameter model plans in seconds.
"""
from __future__ import annotations

import math
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from moekit.comm.topology import Layout, LayoutError, Topology
from moekit.train.planning import memory
from moekit.train.planning.memory import MemoryEstimate, Stage, Workload
from moekit.train import UserError
from moekit.train.cli import Options, parse_args
from moekit.train.config import TrainConfig

GIB = 2**30
TIGHT = 0.9  # above this share of device memory the CUDA context, NCCL buffers and fragmentation may not fit


def main(argv: list[str] | None = None) -> int:
    """Entry point for ``train.py --dry-run``: 0 when planned, 2 on bad input (one line on stderr)."""
    try:
        cfg, opts = parse_args(sys.argv[1:] if argv is None else argv)
        return run(cfg, opts)
    except UserError as exc:
        print(f"train.py: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2


# ---------------------------------------------------------------------------------------------------
# 1. the workload and the checks that need no process group
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    world: int
    ranks_per_node: int
    workload: Workload
    hierarchical: bool | None


def make_plan(cfg: TrainConfig) -> Plan:
    L, t = cfg.layout, cfg.train
    world = L.pp * L.dp * L.fsdp * L.tp  # cli.check_world resolved the layout against --world-size
    validate_layout(cfg)
    D = L.dp * L.fsdp
    if t.batch_size % D:
        raise UserError(f"--batch-size {t.batch_size} does not split into {D} data-parallel shares (dp*fsdp); "
                        f"use a multiple of {D}, e.g. --batch-size {D * max(1, t.batch_size // D)}")
    per_rank = t.batch_size // D
    if L.pp > 1:  # the pipeline splits the rank's share into M micro-batches
        M = L.pp_microbatches or (per_rank // t.micro_batch_size if t.micro_batch_size else 2 * L.pp)
    else:
        M = per_rank // t.micro_batch_size if t.micro_batch_size else 1
    if M < 1 or per_rank % M:
        raise UserError(f"--batch-size {t.batch_size}: the per-rank share of {per_rank} sequences does not split "
                        f"into {M} micro-batches; change --batch-size, --train.micro_batch_size or "
                        f"--layout.pp_microbatches")
    if L.pp > 1 and L.pp_schedule == "1f1b" and M < L.pp:
        raise UserError(f"--layout.pp_schedule 1f1b needs at least pp={L.pp} micro-batches per step, got {M}; "
                        f"raise --batch-size or --layout.pp_microbatches")
    device = "cpu" if t.device == "cpu" else "cuda"  # the dry run plans for the GPUs a real run gets
    dtype = {"float32": "float32", "bfloat16": "bfloat16", "auto": "bfloat16" if device == "cuda" else "float32"}
    wl = Workload(per_rank // M, t.seq_len, dtype[t.dtype], t.activation_checkpointing, device, M,
                  L.pp_schedule, L.pp_stages_per_rank, L.sequence_parallel)
    per_node = L.ranks_per_node or math.gcd(world, 8)  # default: 8 GPUs per node
    return Plan(world, per_node, wl, {"auto": None, "on": True, "off": False}[L.hierarchical])


def validate_layout(cfg: TrainConfig) -> None:
    """What the recipe would refuse, checked before building anything: UserError naming value and fix."""
    m, L = cfg.model, cfg.layout
    bad = {n: getattr(m, n) for n in ("num_heads", "num_kv_heads") if getattr(m, n) % L.tp}
    if m.num_layers > m.num_moe_layers and m.ffn_hidden_size % L.tp:
        bad["ffn_hidden_size"] = m.ffn_hidden_size
    if bad:
        values = ", ".join(f"{k}={v}" for k, v in bad.items())
        raise UserError(f"--tp {L.tp} must divide {values}: tensor parallelism shards attention heads and the "
                        f"dense FFN width; choose a tp that divides them")
    stages = L.pp * L.pp_stages_per_rank
    if m.num_layers < stages:
        raise UserError(f"--pp {L.pp}: model.num_layers={m.num_layers} is fewer than the {stages} pipeline "
                        f"stages (pp x layout.pp_stages_per_rank); each stage needs a layer: lower --pp")
    if L.pp > 1 and m.tie_embeddings:
        raise UserError("--pp: model.tie_embeddings=true shares embed.weight between the first and the last "
                        "stage; use --model.tie_embeddings false with --pp > 1")
    if L.pp_schedule not in memory.SCHEDULES:
        raise UserError(f"--layout.pp_schedule {L.pp_schedule!r}: use one of {list(memory.SCHEDULES)}")
    if (L.pp_schedule == "interleaved") != (L.pp_stages_per_rank > 1):
        raise UserError(f"--layout.pp_schedule {L.pp_schedule} with --layout.pp_stages_per_rank "
                        f"{L.pp_stages_per_rank}: interleaved needs >= 2 stages per rank, the others exactly 1")
    try:
        Layout(L.pp, L.dp, L.fsdp, L.tp, L.ep).validate(L.pp * L.dp * L.fsdp * L.tp, m.num_experts or None)
    except LayoutError as exc:
        raise UserError(str(exc)) from None


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
    stages: list[Stage] = field(default_factory=list)  # every pipeline rank's layers (the real split if built)


def part_of(name: str) -> str:
    """The moekit.train.planning.memory part a parameter belongs to, from its (single-process) name."""
    n = name.replace("_orig_mod.", "").replace("_checkpoint_wrapped_module.", "")
    for prefix, part in (("embed.", "embedding"), ("lm_head.", "head"), ("norm.", "norms")):
        if n.startswith(prefix):
            return part
    for key, part in ((".ffn.router.", "router"), (".ffn.experts.", "experts"),
                      (".ffn.shared_expert.", "shared_expert"), ("_norm.", "norms"), (".attn.", "attention"),
                      (".ffn.", "dense_ffn")):
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


def build(cfg: TrainConfig, plan: Plan) -> Built:
    from moekit.models.parallelize import parallelize
    from moekit.models.transformer import Transformer

    L, seconds = cfg.layout, {}
    t0 = time.perf_counter()
    topo = Topology(Layout(L.pp, L.dp, L.fsdp, L.tp, L.ep), 0, plan.ranks_per_node).build()
    seconds["groups and meshes"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = Transformer(cfg.model)
    seconds["meta model"] = time.perf_counter() - t0
    built = Built(topo, seconds, sum(p.numel() for p in model.parameters()),
                  stages=memory.even_stages(cfg.model, topo.layout, L.pp_stages_per_rank))
    t0 = time.perf_counter()
    try:
        if L.pp > 1:
            model = _pipeline_stage(model, topo, cfg, built)
        parallelize(model, topo, hierarchical=plan.hierarchical, sequence_parallel=L.sequence_parallel)
    except (LayoutError, ValueError, NotImplementedError) as exc:
        built.refused = " ".join(str(exc).split())
        return built
    seconds["recipe"] = time.perf_counter() - t0
    built.measured, built.tensors = local_numel(model)
    return built


def _pipeline_stage(model, topo: Topology, cfg: TrainConfig, built: Built):
    """Rank 0's stage modules from the trainer's cost-balanced split; records every rank's layers."""
    try:
        from moekit.models.pipeline import build_pipeline
    except ImportError:
        raise NotImplementedError("pipeline parallelism is not available in this checkout (models.pipeline)")
    L = cfg.layout
    pipe = build_pipeline(model, topo, L.pp_schedule, L.pp_stages_per_rank, cfg.train.seq_len)
    n = L.pp * L.pp_stages_per_rank
    built.stages = [Stage(r, tuple(i for s in range(r, n, L.pp) for i in pipe.ranges[s]), r == 0, (n - 1) % L.pp == r)
                    for r in range(L.pp)]
    return pipe.model


# ---------------------------------------------------------------------------------------------------
# 4. estimate and report
# ---------------------------------------------------------------------------------------------------


def run(cfg: TrainConfig, opts: Options) -> int:
    plan = make_plan(cfg)
    with fake_world(plan.world):
        built = build(cfg, plan)
    layout, wl = built.topology.layout, plan.workload
    estimates = [memory.estimate_memory(cfg.model, layout, wl, st, plan.ranks_per_node, plan.hierarchical)
                 for st in built.stages]
    a2a = memory.all_to_all(cfg.model, layout, wl, built.stages[0], plan.ranks_per_node, plan.hierarchical)
    print("\n".join(report(cfg, opts, plan, built, estimates, a2a)))
    return 0


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


def describe_stage(st: Stage) -> str:
    extra = (["embedding"] if st.first else []) + (["final norm + lm_head"] if st.last else [])
    return f"layers {_ranges(st.layers)}" + "".join(f" + {e}" for e in extra)


def report(cfg: TrainConfig, opts: Options, plan: Plan, built: Built, estimates: list[MemoryEstimate],
           a2a: memory.A2A) -> list[str]:
    L, wl, topo = built.topology.layout, plan.workload, built.topology
    lines = [f"dry run: {cfg.preset} ({_elements(built.model_params)} parameters) on {plan.world} ranks: "
             f"pp {L.pp} x dp {L.dp} x fsdp {L.fsdp} x tp {L.tp}, ep {L.ep} folded in the {L.data_parallel} "
             f"data-parallel ranks; {topo.num_nodes} node(s) x {plan.ranks_per_node} ranks",
             "  fake process group; " + ", ".join(f"{k} {v:.2f} s" for k, v in built.seconds.items()),
             f"  per rank: micro-batch {wl.micro_batch} x {wl.seq_len} tokens, {wl.microbatches} micro-batch(es) per "
             f"step, {wl.dtype}{' autocast' if wl.dtype != 'float32' else ''} on {wl.device}, activation "
             f"checkpointing {wl.activation_checkpointing}{_sequence_parallel(L, wl)}"]
    if built.refused:
        lines.append(f"  the recipe does not run this layout yet, so this is the estimate alone: {built.refused}")
    lines += _memory_table(built, estimates[0])
    lines += _check_shards(built, estimates[0])
    if L.pp > 1:
        for est, st in zip(estimates, built.stages):
            lines.append(f"  pipeline rank {st.index}: {describe_stage(st)}: total {gib(est.total)}, "
                         f"peak {gib(est.peak)} ({memory.in_flight(L, wl, st.index):g} micro-batch(es) in flight)")
    worst = max(estimates, key=lambda e: e.peak)
    share = worst.peak / (opts.gpu_gb * GIB)
    verdict = "fits" if share <= TIGHT else "tight (CUDA context, NCCL buffers and fragmentation need room too)" \
        if share <= 1 else "does NOT fit: raise ep / fsdp / tp / pp, lower the micro-batch or checkpoint activations"
    where = f" (pipeline rank {worst.stage})" if L.pp > 1 else ""
    lines.append(f"memory: peak {gib(worst.peak)}{where} of {opts.gpu_gb:g} GiB per GPU ({share:.0%}): {verdict}")
    lines.append(_a2a_line(a2a, wl))
    return lines


def _memory_table(built: Built, est: MemoryEstimate) -> list[str]:
    m = built.measured
    shards = sum(m.values()) if m else None

    def row(name: str, measured: int | None, estimate: int) -> str:
        return f"  {name:<22}{gib(measured) if measured is not None else '-':>14}{gib(estimate):>14}"

    st = built.stages[0]
    lines = [f"rank 0 (pipeline rank 0: {describe_stage(st)})  {'shards':>14}{'estimate':>14}",
             row("parameters (fp32)", shards and shards * 4, est.params),
             row("gradients (fp32)", shards and shards * 4, est.grads),
             row("optimizer (AdamW)", shards and shards * 8 + built.tensors * 4, est.optimizer),
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
