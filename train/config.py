"""Training configuration: preset + optional TOML file + command-line overrides, validated up front.

Precedence, lowest first:  preset (model) and section defaults  <  --config FILE  <  flags.

    preset = "mixtral-tiny"          # TOML: top-level key, or --preset
    [model]  any models.config.ModelConfig field       --model.hidden_size 64
    [train]  steps, batch_size, lr, ...                --train.lr 1e-3     (--steps, --batch-size, --seed)
    [data]   path / text, val_fraction                 --data.path tokens.bin
    [eval]   every, sequences                          --eval.every 50
    [log]    run_dir, every, tensorboard, progress     --run-dir runs/x
    [checkpoint] every, keep, async_save               --checkpoint.every 100
    [layout] dp, ep, tp, pp, fsdp, ...                 --ep 2   (resolved by moekit.train.plan.resolve_layout)

Every value is converted to its field's type (``int``, ``float``, ``bool``, ``float | None`` with
"none", tables as JSON) and checked before any work starts; errors are ``UserError`` naming the
flag, the value and what would be accepted.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from moekit.models.config import ModelConfig, preset
from moekit.train import UserError

DEFAULT_PRESET = "mixtral-tiny"
DTYPES = ("auto", "float32", "bfloat16")
DEVICES = ("auto", "cpu", "cuda")
PROGRESS = ("auto", "on", "off")
ON_NONFINITE = ("stop", "skip")  # moekit.train.guard acts on these


@dataclass
class TrainSection:
    steps: int = 400  # optimizer steps (the default run: ~3 minutes on a 2-core CPU)
    batch_size: int = 16  # global batch: sequences per optimizer step, whatever the layout
    micro_batch_size: int = 0  # sequences per forward on one rank; 0 = the whole per-rank batch (no accumulation)
    seq_len: int = 256  # tokens per sequence (<= model.max_seq_len)
    lr: float = 3e-3  # peak learning rate (AdamW)
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 20  # linear warmup from lr / warmup_steps
    weight_decay: float = 0.1  # on matrices and embeddings, not on norms
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # max global grad norm; 0 = no clipping (the norm is still logged)
    seed: int = 0  # weight init, data order, router noise
    dtype: str = "auto"  # auto = bf16 autocast on CUDA, fp32 on CPU
    device: str = "auto"  # auto = cuda when available
    init_from_hf: str = ""  # a HuggingFace folder to start from (models.hf); the model config must match it
    export_hf: str = ""  # after the last step, write the model here as a HuggingFace Mixtral folder
    on_nonfinite: str = "stop"  # non-finite loss / grad norm on any rank: stop, or skip the step (no update)
    compile: bool = False  # torch.compile each transformer block (models.parallelize step 4)
    deterministic: bool = False  # deterministic kernels (torch.use_deterministic_algorithms); see docs/training.md
    activation_checkpointing: str = "none"  # recompute in backward: none | full (blocks) | ffn (FFN/MoE only)


@dataclass
class DataSection:
    path: str = ""  # pre-tokenised token file (see moekit.train.data); "" = the embedded corpus
    text: str = ""  # a text file, tokenised as bytes (vocab 256)
    val_fraction: float = 0.05  # share of the data held out for validation


@dataclass
class EvalSection:
    every: int = 50  # validation every n steps (and after the last); 0 = only after the last
    sequences: int = 64  # validation sequences (fixed, spread over the held-out split)


@dataclass
class LogSection:
    run_dir: str = ""  # "" = runs/<preset>
    every: int = 10  # console line every n steps (metrics.jsonl gets every step)
    tensorboard: bool = True  # write <run_dir>/tensorboard when the tensorboard package is installed
    progress: str = "auto"  # progress bar: auto = when stderr is a terminal


@dataclass
class CheckpointSection:
    every: int = 100  # save every n steps and after the last; 0 = never
    keep: int = 2  # newest checkpoints kept
    async_save: bool = False  # write in the background (dcp.async_save) after a synchronous copy to CPU memory


@dataclass
class LayoutSection:
    """The [layout] settings as the user gave them: requested degrees and the knobs around them.

    Settings only, no checks: moekit.train.plan.resolve_layout turns them, with the world size, the model
    and the batch, into comm.topology's ``Layout`` (the one degrees type, which validates itself) plus the
    per-rank batch split. World size = dp * fsdp * tp * pp; ep borrows from the data-parallel ranks. 0 for
    dp means "infer from the world size"; once resolved, the trainer writes the inferred dp back here, so
    --print-config and config.json show the degrees the run used.
    """

    dp: int = 0
    ep: int = 1
    tp: int = 1
    pp: int = 1
    fsdp: int = 1
    ranks_per_node: int = 0  # 0 = torchrun's LOCAL_WORLD_SIZE; set lower to simulate several nodes
    hierarchical: str = "auto"  # EP dispatch across nodes: auto (when the EP group spans nodes) | on | off
    timeout_s: float = 600.0  # a collective that waits longer fails with an error instead of hanging
    pp_schedule: str = "1f1b"  # pipeline schedule: gpipe | 1f1b | interleaved (interleaved 1F1B)
    pp_stages_per_rank: int = 1  # virtual stages per pipeline rank (interleaved needs >= 2)
    sequence_parallel: bool = False  # with tp > 1: norms, residual and MoE tokens split over the sequence
    pp_microbatches: int = 0  # micro-batches per step through the pipeline; 0 = 2 * pp (or the accumulation count)


@dataclass
class TrainConfig:
    preset: str = DEFAULT_PRESET
    model: ModelConfig = field(default_factory=lambda: preset(DEFAULT_PRESET))
    train: TrainSection = field(default_factory=TrainSection)
    data: DataSection = field(default_factory=DataSection)
    eval: EvalSection = field(default_factory=EvalSection)
    log: LogSection = field(default_factory=LogSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    layout: LayoutSection = field(default_factory=LayoutSection)

    @property
    def run_dir(self) -> str:
        return self.log.run_dir or f"runs/{self.preset}"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "") -> "TrainConfig":
        cfg = new_config(d.get("preset", DEFAULT_PRESET))
        for section, values in d.items():
            if section != "preset":
                if not isinstance(values, dict):
                    raise UserError(f"config: {section!r} must be a [table] of settings, got {values!r}")
                # model.router first: choosing a router resets router_options (see set_value)
                for key, value in sorted(values.items(), key=lambda kv: kv[0] != "router"):
                    set_value(cfg, f"{section}.{key}", value, source=f"{source}{section}.{key}")
        return cfg


SECTIONS = tuple(f.name for f in dataclasses.fields(TrainConfig) if f.name != "preset")


def new_config(preset_name: str) -> TrainConfig:
    try:
        model = preset(preset_name)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    return TrainConfig(preset=preset_name, model=model)


# ---------------------------------------------------------------------------------------------------
# Typed assignment: one path for TOML values and command-line strings
# ---------------------------------------------------------------------------------------------------


def set_value(cfg: TrainConfig, dotted: str, value: Any, source: str = "") -> None:
    """Assign ``section.key`` (or ``model.router_options.key``), converting ``value`` to the field type."""
    where = source or f"--{dotted}"
    parts = dotted.split(".")
    if parts[0] not in SECTIONS or len(parts) < 2:
        raise UserError(f"{where}: unknown setting {dotted!r}; settings are <section>.<key> with section one of "
                        f"{list(SECTIONS)}")
    section = getattr(cfg, parts[0])
    hints = typing.get_type_hints(type(section))
    key = parts[1]
    if key not in hints:
        raise UserError(f"{where}: {type(section).__name__} has no field {key!r}; fields: {sorted(hints)}")
    if len(parts) > 2:  # a key inside a table field, e.g. model.router_options.jitter
        if typing.get_origin(hints[key]) is not dict or len(parts) != 3:
            raise UserError(f"{where}: {parts[0]}.{key} is not a table; use --{parts[0]}.{key} VALUE")
        getattr(section, key)[parts[2]] = _literal(value)
        return
    value = convert(value, hints[key], where)
    if dotted == "model.router":  # a new router family drops the old one's options (ModelConfig.set_router)
        cfg.model.set_router(value)
        return
    setattr(section, key, value)


def convert(value: Any, tp, where: str) -> Any:
    """Convert a TOML value or a command-line string to type ``tp``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType) and type(None) in args:
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            return None
        return convert(value, next(a for a in args if a is not type(None)), where)
    if origin is dict:
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                raise UserError(f"{where}: expected a JSON object such as '{{\"jitter\": 0.0}}', got {value!r}") from None
        if not isinstance(value, dict):
            raise UserError(f"{where}: expected a table of options, got {value!r}")
        return dict(value)
    converter = _CONVERTERS.get(tp)
    if converter is None:
        raise AssertionError(f"no converter for field type {tp!r}")
    try:
        return converter(value)
    except (TypeError, ValueError):
        raise UserError(f"{where}: expected {_TYPE_NAMES[tp]}, got {value!r}") from None


def _to_int(v) -> int:
    if isinstance(v, bool) or isinstance(v, float):
        raise TypeError
    return int(v, 10) if isinstance(v, str) else int(v)


def _to_float(v) -> float:
    if isinstance(v, bool):
        raise TypeError
    return float(v)


def _to_bool(v) -> bool:
    if isinstance(v, bool):
        return v
    table = {"true": True, "1": True, "yes": True, "on": True, "false": False, "0": False, "no": False, "off": False}
    if isinstance(v, str) and v.lower() in table:
        return table[v.lower()]
    raise ValueError


def _to_str(v) -> str:
    if not isinstance(v, str):
        raise TypeError
    return v


_CONVERTERS = {int: _to_int, float: _to_float, bool: _to_bool, str: _to_str}
_TYPE_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def _literal(value: Any) -> Any:
    """A router option from the command line: JSON literal if it parses (1, 0.5, true, "x"), else the string."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


# ---------------------------------------------------------------------------------------------------
# Validation: everything that can be checked without data or a device
# ---------------------------------------------------------------------------------------------------


def _require(ok: bool, msg: str) -> None:
    if not ok:
        raise UserError(msg)


def validate(cfg: TrainConfig) -> TrainConfig:
    """Every section but [layout], whose degrees need the world size: moekit.train.plan.resolve_layout."""
    t = cfg.train
    for name in ("steps", "batch_size", "seq_len"):
        _require(getattr(t, name) >= 1, f"--train.{name}={getattr(t, name)} is invalid; it must be a positive integer")
    for name in ("micro_batch_size", "warmup_steps", "seed"):
        _require(getattr(t, name) >= 0, f"--train.{name}={getattr(t, name)} is invalid; it must be >= 0")
    _require(t.seed < 2**63, f"--train.seed={t.seed} is invalid; it must be < 2**63 (torch seeds are 64-bit)")
    _require(math.isfinite(t.lr) and t.lr > 0, f"--train.lr={t.lr} is invalid; the learning rate must be > 0")
    _require(0 <= t.min_lr_ratio <= 1, f"--train.min_lr_ratio={t.min_lr_ratio} is invalid; it must be in [0, 1]")
    for name in ("beta1", "beta2"):
        _require(0 <= getattr(t, name) < 1, f"--train.{name}={getattr(t, name)} is invalid; it must be in [0, 1)")
    for name in ("weight_decay", "grad_clip", "eps"):
        v = getattr(t, name)
        _require(math.isfinite(v) and v >= 0, f"--train.{name}={v} is invalid; it must be a finite number >= 0")
    _require(t.dtype in DTYPES, f"--train.dtype={t.dtype!r} is invalid; choose one of {list(DTYPES)}")
    _require(t.device in DEVICES, f"--train.device={t.device!r} is invalid; choose one of {list(DEVICES)}")
    _require(t.activation_checkpointing in ("none", "full", "ffn"),
             f"--train.activation_checkpointing={t.activation_checkpointing!r} is invalid; choose none, full or ffn")
    _require(t.on_nonfinite in ON_NONFINITE,
             f"--train.on_nonfinite={t.on_nonfinite!r} is invalid; choose one of {list(ON_NONFINITE)}")
    _require(not t.init_from_hf or os.path.isdir(t.init_from_hf),
             f"--init-from-hf {t.init_from_hf}: not a directory (expected a HuggingFace model folder)")
    _require(0 < cfg.data.val_fraction < 0.5,
             f"--data.val_fraction={cfg.data.val_fraction} is invalid; it must be in (0, 0.5)")
    _require(not (cfg.data.path and cfg.data.text), "--data.path and --data.text are both set; choose one data source")
    _require(cfg.eval.every >= 0 and cfg.eval.sequences >= 1,
             f"eval.every={cfg.eval.every} must be >= 0 and eval.sequences={cfg.eval.sequences} >= 1")
    _require(cfg.log.every >= 1, f"--log.every={cfg.log.every} is invalid; it must be a positive integer")
    _require(cfg.log.progress in PROGRESS, f"--log.progress={cfg.log.progress!r} is invalid; choose one of {list(PROGRESS)}")
    _require(cfg.checkpoint.every >= 0 and cfg.checkpoint.keep >= 1,
             f"checkpoint.every={cfg.checkpoint.every} must be >= 0 and checkpoint.keep={cfg.checkpoint.keep} >= 1")
    validate_model(cfg)
    return cfg


def validate_model(cfg: TrainConfig) -> None:
    """ModelConfig checks, then a meta-device build: router options fail here, before any work."""
    import torch  # deferred: --help and config errors should not wait for torch

    from moekit.models.transformer import Transformer

    m = cfg.model
    for f in dataclasses.fields(m):  # torch takes sizes as int64: refuse absurd ones before building anything
        v = getattr(m, f.name)
        if isinstance(v, int) and not isinstance(v, bool) and abs(v) > 2**40:
            raise UserError(f"--model.{f.name}={v} is too large (limit 2**40); use a realistic size")
    if m.capacity_factor is not None and m.capacity_factor < 0:
        raise UserError(f"--capacity-factor={m.capacity_factor} is invalid; it must be > 0, or none for dropless")
    try:
        m.validate()
        _require(cfg.train.seq_len <= m.max_seq_len,
                 f"--train.seq_len={cfg.train.seq_len} exceeds model.max_seq_len={m.max_seq_len}")
        with torch.device("meta"):
            Transformer(m)
    except ValueError as exc:
        raise UserError(f"model config ({cfg.preset}, router {m.router!r}): {exc}") from None


# ---------------------------------------------------------------------------------------------------
# TOML in and out
# ---------------------------------------------------------------------------------------------------


def load_toml(path: str) -> dict[str, Any]:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        try:
            import tomli as tomllib
        except ImportError:
            raise UserError(f"--config {path}: reading TOML on Python {sys.version_info[0]}.{sys.version_info[1]} "
                            f"needs the tomli package (pip install tomli), or Python >= 3.11") from None
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise UserError(f"--config {path}: file not found") from None
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"--config {path}: invalid TOML ({exc})") from None


def to_toml(cfg: TrainConfig) -> str:
    """The resolved config as TOML that --config reads back to the same config (None is "none")."""
    lines = [f"preset = {json.dumps(cfg.preset)}"]
    for section in SECTIONS:
        lines.append(f"\n[{section}]")
        for key, value in dataclasses.asdict(getattr(cfg, section)).items():
            lines.append(f"{key} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"


def _toml_value(v: Any) -> str:
    if v is None:
        return '"none"'
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + "}"
    if isinstance(v, float):
        return repr(v) if math.isfinite(v) else ("inf" if v > 0 else "-inf")
    return json.dumps(v)
