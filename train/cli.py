"""Command line of tools/train.py: named flags (DESIGN.md), --config TOML, dotted --section.key overrides."""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from moekit.models.config import PRESETS
from moekit.train import UserError
from moekit.train.config import DEFAULT_PRESET, TrainConfig, load_toml, set_value, validate

# Named flags and the setting each one overrides; applied before dotted overrides, in this order.
FLAG_SETTINGS = {
    "steps": "train.steps", "seed": "train.seed", "batch_size": "train.batch_size", "run_dir": "log.run_dir",
    "router": "model.router", "capacity_factor": "model.capacity_factor", "init_from_hf": "train.init_from_hf",
    "export_hf": "train.export_hf", "ranks_per_node": "layout.ranks_per_node", "deterministic": "train.deterministic",
    "dp": "layout.dp", "ep": "layout.ep", "tp": "layout.tp", "pp": "layout.pp", "fsdp": "layout.fsdp",
}

EPILOG = """\
any setting: --<section>.<key> VALUE (or =VALUE), sections model, train, data, eval, log, checkpoint,
layout; e.g. --model.hidden_size 64 --train.lr 1e-3 --model.router_options.jitter 0 --eval.every 25.
--print-config shows every setting and its value. Precedence: preset < --config FILE < flags.
"""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage block: the caller prints it
        raise UserError(f"{message} (see --help)")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="train.py", description="Train a moekit MoE model: python tools/train.py, or torchrun ... tools/train.py --ep N.",
                allow_abbrev=False,
                epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", help=f"model preset (default {DEFAULT_PRESET}): {', '.join(PRESETS)}")
    p.add_argument("--config", metavar="FILE", help="TOML file with [model] [train] [data] ... tables")
    p.add_argument("--steps", help="optimizer steps")
    p.add_argument("--seed", help="seed of weight init, data order and router noise")
    p.add_argument("--batch-size", help="global batch: sequences per optimizer step, whatever the layout")
    p.add_argument("--run-dir", help="where records and checkpoints go (default runs/<preset>)")
    p.add_argument("--router", help="router name (topk, switch, expert_choice, sinkhorn, hash) or module:Class")
    p.add_argument("--capacity-factor", help="expert capacity factor; none = dropless")
    p.add_argument("--init-from-hf", metavar="DIR", help="start from a HuggingFace folder's weights (models.hf)")
    p.add_argument("--export-hf", metavar="DIR", help="after the last step, write a HuggingFace Mixtral folder")
    p.add_argument("--ranks-per-node", help="ranks sharing a node (default torchrun's LOCAL_WORLD_SIZE); "
                                            "lower it to simulate several nodes (hierarchical dispatch)")
    p.add_argument("--deterministic", action="store_const", const="true",
                   help="deterministic kernels: bitwise-identical runs (CPU; CUDA where kernels allow)")
    for name in ("dp", "ep", "tp", "pp", "fsdp"):
        p.add_argument(f"--{name}", help=f"{name} degree (default 1{'; inferred from the world size' if name == 'dp' else ''})")
    p.add_argument("--resume", nargs="?", const="latest", metavar="CHECKPOINT",
                   help="continue from the newest checkpoint of the run dir that verifies (damaged ones are "
                        "skipped, with a warning), or from CHECKPOINT; 'auto': the same, but start fresh when the "
                        "run dir has no checkpoint (for torchrun --max-restarts)")
    p.add_argument("--print-config", action="store_true", help="print the resolved config as TOML and exit")
    p.add_argument("--write-data", metavar="FILE", help="write the configured data as a token file and exit")
    p.add_argument("--dry-run", action="store_true",
                   help="build the layout's process groups (fake), meshes and sharded meta-device model in this one "
                        "process, validate it, print per-rank memory and all-to-all bytes per step, and exit")
    p.add_argument("--world-size", type=int, metavar="N", help="with --dry-run: the world size to plan for "
                                                               "(default WORLD_SIZE, or 1)")
    p.add_argument("--dry-run-gpu-gb", type=float, default=80.0, metavar="GIB",
                   help="with --dry-run: device memory to check the per-rank peak against (default 80, an H100)")
    return p


@dataclass
class Options:
    print_config: bool
    resume: str | None
    write_data: str | None
    dry_run: bool = False
    world_size: int | None = None  # --dry-run: plan for this many ranks instead of WORLD_SIZE
    gpu_gb: float = 80.0  # --dry-run: device memory (GiB) the per-rank peak is checked against


def _dotted(rest: list[str]) -> list[tuple[str, str]]:
    """['--model.hidden_size', '64', '--train.lr=1e-3'] -> [('model.hidden_size', '64'), ('train.lr', '1e-3')]."""
    out, i = [], 0
    while i < len(rest):
        arg = rest[i]
        if not arg.startswith("--") or "." not in arg.split("=", 1)[0]:
            raise UserError(f"unrecognized argument {arg!r} (see --help)")
        if "=" in arg:
            key, value = arg[2:].split("=", 1)
            i += 1
        else:
            if i + 1 >= len(rest):
                raise UserError(f"{arg} needs a value")
            key, value = arg[2:], rest[i + 1]
            i += 2
        out.append((key, value))
    return out


def parse_args(argv: list[str]) -> tuple[TrainConfig, Options]:
    """Resolve and validate the whole config; raises UserError before any work on bad input."""
    args, rest = build_parser().parse_known_args(argv)
    overrides = _dotted(rest)
    file_values = load_toml(args.config) if args.config else {}
    if args.preset:
        file_values["preset"] = args.preset
    cfg = TrainConfig.from_dict(file_values, source=f"{args.config}: " if args.config else "")
    for attr, setting in FLAG_SETTINGS.items():
        value = getattr(args, attr)
        if value is not None:
            set_value(cfg, setting, value, source=f"--{attr.replace('_', '-')}")
    for key, value in overrides:
        set_value(cfg, key, value)
    validate(cfg)
    if args.world_size is not None and (not args.dry_run or args.world_size < 1):
        raise UserError(f"--world-size {args.world_size}: only with --dry-run, and at least 1 (torchrun sets the "
                        f"world size of a real run)")
    if not args.dry_run_gpu_gb > 0:
        raise UserError(f"--dry-run-gpu-gb {args.dry_run_gpu_gb}: must be a positive number of GiB")
    check_world(cfg, args.world_size)
    return cfg, Options(args.print_config, args.resume, args.write_data, args.dry_run, args.world_size,
                        args.dry_run_gpu_gb)


def world_size_from_env() -> int:
    """torchrun's WORLD_SIZE, read early only to resolve dp; comm.topology owns the launch variables."""
    raw = os.environ.get("WORLD_SIZE", "1")
    try:
        return int(raw)
    except ValueError:
        raise UserError(f"WORLD_SIZE={raw!r} is not an integer") from None


def check_world(cfg: TrainConfig, world: int | None = None) -> None:
    """Resolve the layout against ``world`` ranks (default: torchrun's WORLD_SIZE) and check it."""
    world = world_size_from_env() if world is None else world
    cfg.layout = cfg.layout.resolve(world)
    L = cfg.layout
    if cfg.model.num_experts and cfg.model.num_moe_layers and cfg.model.num_experts % L.ep:
        divisors = [d for d in range(1, cfg.model.num_experts + 1) if cfg.model.num_experts % d == 0]
        raise UserError(f"--ep {L.ep}: num_experts={cfg.model.num_experts} is not divisible by it; use one of "
                        f"{divisors}")
    if L.ranks_per_node and world % L.ranks_per_node:
        raise UserError(f"--ranks-per-node {L.ranks_per_node} must divide the world size {world}")
    from moekit.comm.tensor_parallel import check_sequence_parallel, check_tensor_parallel
    from moekit.comm.topology import LayoutError

    try:  # heads and widths, before any process group exists
        check_tensor_parallel(cfg.model, L.tp)
        if L.sequence_parallel:
            check_sequence_parallel(cfg.train.seq_len, L.tp)
    except LayoutError as exc:
        raise UserError(str(exc)) from None
    if L.pp > 1:
        check_pipeline(cfg)
    if L.hierarchical not in ("auto", "on", "off"):
        raise UserError(f"--layout.hierarchical {L.hierarchical!r}: use auto, on or off")
    if not 0 < L.timeout_s < 1e9:  # also nan and inf, which timedelta refuses with a traceback
        raise UserError(f"--layout.timeout_s {L.timeout_s}: must be a number of seconds in (0, 1e9)")


def pipeline_microbatches(cfg: TrainConfig) -> int:
    """Micro-batches per optimizer step through the pipeline (M): layout.pp_microbatches, else the
    accumulation count that train.micro_batch_size implies, else 2 * pp (fewer bubbles than pp)."""
    L, t = cfg.layout, cfg.train
    per_rank = t.batch_size // (L.dp * L.fsdp)
    if L.pp_microbatches:
        return L.pp_microbatches
    if t.micro_batch_size:
        return max(per_rank // t.micro_batch_size, 1)
    return 2 * L.pp


def check_pipeline(cfg: TrainConfig) -> None:
    """Schedule, stage count and micro-batching of a pipelined run, before any process group exists."""
    from moekit.comm.pipeline import check_schedule
    from moekit.models.pipeline import check_pipeline_model

    L, t = cfg.layout, cfg.train
    M = pipeline_microbatches(cfg)
    per_rank = t.batch_size // (L.dp * L.fsdp)
    try:
        check_schedule(L.pp_schedule, L.pp, L.pp_stages_per_rank, M)
        check_pipeline_model(cfg.model, L.pp * L.pp_stages_per_rank)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    if per_rank % M:
        raise UserError(f"--pp {L.pp}: each data-parallel rank's {per_rank} sequences do not split into {M} equal "
                        f"micro-batches; set --layout.pp_microbatches (or --train.micro_batch_size) to a divisor of "
                        f"{per_rank}, or change --batch-size")
    if t.micro_batch_size and t.micro_batch_size * M != per_rank:
        raise UserError(f"--train.micro_batch_size {t.micro_batch_size} x --layout.pp_microbatches {M} != {per_rank} "
                        f"sequences per data-parallel rank; set one of them (the other follows)")
    if t.export_hf:
        raise UserError(f"--export-hf with --pp {L.pp}: each rank holds only its stages. Save a checkpoint, then "
                        f"export it without pipeline parallelism: tools/train.py --resume CHECKPOINT --steps "
                        f"{t.steps} --export-hf {t.export_hf} (one process, or --ep / --fsdp ranks)")
