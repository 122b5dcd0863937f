"""Command line of tools/train.py: named flags (DESIGN.md), --config TOML / JSON, dotted --section.key overrides."""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from moekit.models.config import PRESETS
from moekit.train import OneLineParser, UserError, program_name
from moekit.train.config import DEFAULT_PRESET, TrainConfig, load_config, set_value
from moekit.train.validation import validate

# Named flags and the setting each one overrides; applied before dotted overrides, in this order.
FLAG_SETTINGS = {
    "steps": "train.steps", "seed": "train.seed", "batch_size": "train.batch_size", "run_dir": "log.run_dir",
    "router": "model.router", "capacity_factor": "model.capacity_factor", "init_from_hf": "train.init_from_hf",
    "init_from_dense": "train.init_from_dense", "upcycle_granularity": "train.upcycle_granularity", "upcycle_drop": "train.upcycle_drop", "export_hf": "train.export_hf", "ranks_per_node": "layout.ranks_per_node", "deterministic": "train.deterministic",
    "dp": "layout.dp", "ep": "layout.ep", "tp": "layout.tp", "pp": "layout.pp", "fsdp": "layout.fsdp",
    "cp": "layout.cp",
}

EPILOG = """\
any setting: --<section>.<key> VALUE (or =VALUE), sections model, train, data, eval, log, checkpoint,
layout, profile; e.g. --model.hidden_size 64 --train.lr 1e-3 --model.router_options.aux_loss_coeff 0.02 --eval.every 25.
--print-config shows every setting and its value, --help-config what each one means.
Precedence: preset < --config FILE < flags.
"""


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog=program_name("train.py"), description="Train a moekit MoE model: moekit-train (python tools/train.py), or torchrun -m moekit.train --ep N.",
                allow_abbrev=False,
                epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", help=f"model preset (default {DEFAULT_PRESET}): {', '.join(PRESETS)}")
    p.add_argument("--config", metavar="FILE", help="TOML file with [model] [train] [data] ... tables, or a run "
                                                   "directory's config.json (JSON, the same layout)")
    p.add_argument("--steps", help="optimizer steps")
    p.add_argument("--seed", help="seed of weight init, data order and router noise")
    p.add_argument("--batch-size", help="global batch: sequences per optimizer step, whatever the layout")
    p.add_argument("--run-dir", help="where records and checkpoints go (default runs/<preset>)")
    p.add_argument("--router", help="router name (topk, switch, expert_choice, sinkhorn, hash) or module:Class")
    p.add_argument("--capacity-factor", help="expert capacity factor; none = dropless")
    p.add_argument("--init-from-hf", metavar="DIR",
                   help="start from a HuggingFace folder (mixtral, qwen2_moe, qwen3_moe, olmoe, deepseek_v3, glm4_moe, "
                        "gpt_oss, minimax_m2, ...; "
                        "docs/hf.md). Without --preset the model is the folder's config.json plus the --model.* "
                        "flags given; each rank reads only its shards. When resuming, the weights come from the "
                        "checkpoint (the folder still sets the model, which must be the checkpoint's: the same "
                        "command line serves torchrun restarts with --resume auto)")
    p.add_argument("--init-from-dense", metavar="PATH",
                   help="upcycle a dense model into this MoE model (Megatron's --moe-use-upcycling): PATH is a "
                        "HuggingFace dense folder (Llama, Qwen2, Qwen3), a moekit model file or a dense run's "
                        "checkpoint / run dir. Attention, norms and embeddings are copied, every expert starts as "
                        "the dense MLP, and at step 0 the model gives the dense model's logits. Without --preset "
                        "the sizes are the dense model's, with 8*G experts, top_k 2*G unless --model.num_experts "
                        "/ --model.top_k say otherwise. When resuming, the weights come from the checkpoint (PATH "
                        "still sets the sizes, which must be the checkpoint's)")
    p.add_argument("--upcycle-granularity", metavar="G",
                   help="with --init-from-dense: split each dense MLP of width F into G experts of F/G (granular "
                        "upcycling); num_experts and top_k must be multiples of G (default 1: every expert a copy "
                        "of the whole MLP)")
    p.add_argument("--upcycle-drop", metavar="R",
                   help="with --init-from-dense: drop-upcycling (Nakamura et al. 2025): each expert re-initialises a "
                        "random share R of its hidden units from the dense weights' mean and std, so the copies "
                        "start different and specialise sooner; the model then no longer starts at the dense "
                        "model's loss (default 0; the paper's choice: 0.5)")
    p.add_argument("--export-hf", metavar="DIR", help="after the last step, write the model as a HuggingFace folder (its own family, or the nearest that reproduces it: mixtral, qwen2_moe, qwen3_moe, olmoe, deepseek_v3, ...) with the run's tokenizer; each rank writes its own shards")
    p.add_argument("--ranks-per-node", help="ranks sharing a node (default torchrun's LOCAL_WORLD_SIZE); "
                                            "lower it to simulate several nodes (hierarchical dispatch)")
    p.add_argument("--deterministic", action="store_const", const="true",
                   help="deterministic kernels: bitwise-identical runs (CPU; CUDA where kernels allow)")
    for name in ("dp", "ep", "tp", "pp", "fsdp"):
        p.add_argument(f"--{name}", help=f"{name} degree (default 1{'; inferred from the world size' if name == 'dp' else ''})")
    p.add_argument("--cp", help="context-parallel degree (default 1): each sequence is split over this many ranks "
                                "and attention gathers the keys; for sequences too long for one device's activations")
    p.add_argument("--resume", nargs="?", const="latest", metavar="CHECKPOINT",
                   help="continue from the newest checkpoint of the run dir that verifies (damaged ones are "
                        "skipped, with a warning), or from CHECKPOINT; 'auto': the same, but start fresh when the "
                        "run dir has no checkpoint (for torchrun --max-restarts)")
    p.add_argument("--overwrite", action="store_true",
                   help="start over in a --run-dir that holds an earlier run, deleting its checkpoints and records "
                        "(without it such a directory is refused: --resume continues it)")
    p.add_argument("--print-config", action="store_true", help="print the resolved config as TOML and exit")
    p.add_argument("--help-config", nargs="?", const="all", metavar="SECTION",
                   help="explain every setting (--section.key, type, default, meaning), or one section's "
                        "(model, train, data, eval, log, checkpoint, layout, profile), and exit")
    p.add_argument("--write-data", metavar="FILE", help="write the configured data as a token file and exit")
    p.add_argument("--dry-run", action="store_true",
                   help="build the layout's process groups (fake), meshes and sharded meta-device model in this one "
                        "process, validate it, print per-rank memory and all-to-all bytes per step, and exit: status 0 "
                        "when the per-rank peak fits --dry-run-gpu-gb, 3 when it does NOT fit, 2 on a bad layout")
    p.add_argument("--world-size", type=int, metavar="N", help="with --dry-run: the world size to plan for "
                                                               "(default WORLD_SIZE, or 1)")
    p.add_argument("--dry-run-gpu-gb", type=float, default=None, metavar="GIB",
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
    overwrite: bool = False  # a fresh run may replace an earlier run in its run directory


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


# The flags that do one thing and exit instead of training: at most one per command.
EXITS = ("help_config", "print_config", "write_data", "dry_run")


def _check_modes(args: argparse.Namespace) -> None:
    """At most one of EXITS; --world-size / --dry-run-gpu-gb only with --dry-run; a non-empty --write-data."""
    given = [f"--{name.replace('_', '-')}" for name in EXITS if getattr(args, name) not in (None, False)]
    if len(given) > 1:
        raise UserError(f"{' and '.join(given)} each do one thing and exit; give one of them")
    if args.write_data is not None and not args.write_data.strip():
        raise UserError("--write-data needs a file name (the token file to write)")
    if args.overwrite and given:
        raise UserError(f"--overwrite with {given[0]}: {given[0]} writes no run, so there is nothing to overwrite; "
                        f"drop --overwrite")
    if args.overwrite and args.resume is not None:
        given = "--resume" if args.resume == "latest" else f"--resume {args.resume}"
        raise UserError(f"--overwrite and {given}: --resume continues the run in --run-dir, "
                        f"--overwrite deletes it and starts over; give one of them")
    for flag, value in (("--world-size", args.world_size), ("--dry-run-gpu-gb", args.dry_run_gpu_gb)):
        if value is not None and not args.dry_run:
            raise UserError(f"{flag} {value}: only with --dry-run (it plans a layout; a real run takes the world "
                            f"size from torchrun and measures the device)")


def parse_args(argv: list[str], world_size: int | None = None) -> tuple[TrainConfig, Options]:
    """Resolve and validate the whole config; raises UserError before any work on bad input. ``world_size``: the
    ranks the layout is checked against (default --world-size with --dry-run, else torchrun's WORLD_SIZE)."""
    args, rest = build_parser().parse_known_args(argv)
    _check_modes(args)
    if args.help_config is not None:  # before anything is validated: it explains the settings
        from moekit.train.confighelp import describe

        cfg = TrainConfig.from_dict({"preset": args.preset} if args.preset else {})
        print(describe(cfg, args.help_config))
        raise SystemExit(0)
    overrides = _dotted(rest)
    file_values = load_config(args.config) if args.config is not None else {}
    if args.preset is not None:
        file_values["preset"] = args.preset
    cfg = TrainConfig.from_dict(file_values, source=f"{args.config}: " if args.config is not None else "")
    for attr, setting in FLAG_SETTINGS.items():
        value = getattr(args, attr)
        if value is not None:
            set_value(cfg, setting, value, source=f"--{attr.replace('_', '-')}")
    for key, value in overrides:
        set_value(cfg, key, value)
    validate(cfg)
    if args.world_size is not None and args.world_size < 1:
        raise UserError(f"--world-size {args.world_size}: must be at least 1")
    gpu_gb = 80.0 if args.dry_run_gpu_gb is None else args.dry_run_gpu_gb
    if not gpu_gb > 0:
        raise UserError(f"--dry-run-gpu-gb {gpu_gb}: must be a positive number of GiB")
    check_layout(cfg, args.world_size if world_size is None else world_size)
    return cfg, Options(args.print_config, args.resume, args.write_data, args.dry_run, args.world_size, gpu_gb,
                        args.overwrite)


def check_layout(cfg: TrainConfig, world_size: int | None = None) -> None:
    """Resolve the layout against ``world_size`` ranks (default: torchrun's WORLD_SIZE) before any work:
    moekit.train.plan.resolve_layout's checks, then the inferred dp is written back into ``cfg.layout``
    (--print-config and config.json show it)."""
    from moekit.train.plan import resolve_config  # deferred: --help and config errors should not wait for torch

    resolved = resolve_config(cfg, world_size)
    cfg.layout.dp = resolved.layout.dp
