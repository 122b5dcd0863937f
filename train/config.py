"""Training configuration: preset + optional TOML file + command-line overrides, validated up front.

Precedence, lowest first:  preset (model) and section defaults  <  --config FILE  <  flags.
FILE is TOML, or JSON in the same layout: a run directory's config.json reproduces that run's config.

    preset = "mixtral-tiny"          # TOML: top-level key, or --preset
    [model]  any models.config.ModelConfig field       --model.hidden_size 64
    [train]  steps, batch_size, lr, ...                --train.lr 1e-3     (--steps, --batch-size, --seed)
    [data]   path / text / blend, dtype, val_fraction  --data.path tokens.bin
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
from typing import TYPE_CHECKING, Any

from moekit.models.config import PRESETS, ModelConfig, preset
from moekit.train import UserError, host_memory

if TYPE_CHECKING:
    import torch

DEFAULT_PRESET = "mixtral-tiny"
DTYPES = ("auto", "float32", "bfloat16")
DEVICES = ("auto", "cpu", "cuda")
PROGRESS = ("auto", "on", "off")
ON_NONFINITE = ("stop", "skip")  # moekit.train.guard acts on these
MAX_LR = 1.0  # AdamW's step is ~lr per weight: beyond this a run can only diverge (and 10 * lr can overflow fp32)


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
    beta1: float = 0.9  # AdamW first-moment decay
    beta2: float = 0.95  # AdamW second-moment decay
    eps: float = 1e-8  # AdamW denominator epsilon
    grad_clip: float = 1.0  # max global grad norm; 0 = no clipping (the norm is still logged)
    seed: int = 0  # weight init, data order, router noise
    dtype: str = "auto"  # auto = bf16 autocast on CUDA, fp32 on CPU
    device: str = "auto"  # auto = cuda when available
    init_from_hf: str = ""  # a HuggingFace folder to start from (models.hf); the model config must match it
    init_from_dense: str = ""  # upcycle a dense model (HF folder, moekit file, checkpoint or run dir) into this MoE
    upcycle_granularity: int = 1  # with init_from_dense: each dense MLP split into g experts of F/g (1 = copies)
    export_hf: str = ""  # after the last step, write the model here as a HuggingFace folder (models.hf.save_hf_sharded)
    on_nonfinite: str = "stop"  # non-finite loss / grad norm on any rank: stop, or skip the step (no update)
    compile: bool = False  # torch.compile each transformer block (models.parallelize step 4)
    deterministic: bool = False  # deterministic kernels (torch.use_deterministic_algorithms); see docs/training.md
    activation_checkpointing: str = "none"  # recompute: none | full (blocks) | ffn (FFN/MoE) | selective (elementwise ops)
    host_memory: str = "system"  # system (the C library's) | retain: keep freed CPU memory (moekit.train.host_memory)


@dataclass
class DataSection:
    path: str = ""  # token ids: a token file (moekit-prepare), a raw .bin (nanoGPT) or a .npy; "" = embedded corpus
    text: str = ""  # a text file, tokenised as bytes (vocab 256)
    blend: str = ""  # a weighted mixture of token files, "a.bin:0.7,b.bin:0.3" (config file: also a table / array)
    dtype: str = "uint16"  # the ids of a raw (headerless) .bin file: uint16 (nanoGPT), uint32 or uint8
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
    load_every: int = 0  # expert_load.bin and per-layer TensorBoard / W&B scalars every n steps; 0 = auto (<= ~2 GiB)
    wandb: bool = False  # also log to Weights & Biases (the wandb extra); WANDB_MODE=offline needs no network
    wandb_project: str = "moekit"  # the W&B project (--log.wandb)


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

    dp: int = 0  # data-parallel replicas; 0 = world size / (fsdp * tp * pp)
    ep: int = 1  # expert-parallel ranks (divides dp * fsdp and num_experts): each holds E / ep experts
    tp: int = 1  # tensor-parallel ranks: attention heads and dense MLP widths split, MoE tokens split
    pp: int = 1  # pipeline stages: contiguous groups of layers
    fsdp: int = 1  # fully-sharded data-parallel ranks (FSDP2: parameters, gradients, optimizer state)
    ranks_per_node: int = 0  # 0 = torchrun's LOCAL_WORLD_SIZE; set lower to simulate several nodes
    hierarchical: str = "auto"  # EP dispatch across nodes: auto (when the EP group spans nodes) | on | off
    timeout_s: float = 600.0  # a collective that waits longer fails with an error instead of hanging
    pp_schedule: str = "1f1b"  # pipeline schedule: gpipe | 1f1b | interleaved (interleaved 1F1B)
    pp_stages_per_rank: int = 1  # virtual stages per pipeline rank (interleaved needs >= 2)
    sequence_parallel: bool = False  # with tp > 1: norms, residual and MoE tokens split over the sequence
    ep_overlap_chunks: int = 1  # with ep > 1: token chunks whose EP all-to-alls overlap the other chunks' experts; 1 = off
    pp_microbatches: int = 0  # micro-batches per step through the pipeline; 0 = 2 * pp (or the accumulation count)
    # expert placement over the EP ranks (moekit.train.rebalance); default: contiguous blocks of E / ep
    expert_placement: str = ""  # a moekit-placement file: which experts each EP rank holds
    expert_replicas: int = 0  # redundant expert slots over the EP group (a multiple of ep): hot experts get copies
    rebalance_every: int = 0  # re-plan the placement from the last n steps' expert load and move the experts; 0 = never


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

    def __post_init__(self):
        # settings a config file or a flag gave (set_value), as opposed to preset and section defaults; not a
        # dataclass field, so not part of to_dict / config.json
        self.given: set[str] = set()
        self.source_note: str | None = None  # where the model architecture came from (train.modelsource)

    @property
    def run_dir(self) -> str:
        return self.log.run_dir or f"runs/{self.preset}"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "") -> "TrainConfig":
        """A config from parsed TOML / JSON (``to_dict``'s layout); ``source`` prefixes error messages."""
        name = d.get("preset", DEFAULT_PRESET)
        if not isinstance(name, str):
            raise UserError(f"{source}preset: expected a string (a preset name), got {_shown(name)}; "
                            f"presets: {', '.join(PRESETS)}")
        cfg = new_config(name)
        if "preset" in d:  # chosen, not defaulted: --init-from-hf / --init-from-dense then keep it (train.modelsource)
            cfg.given.add("preset")
        for section, values in d.items():
            if section == "preset":
                continue
            if section not in SECTIONS:
                raise UserError(f"{source}{section}: unknown setting {section!r}; the config has 'preset' and the "
                                f"sections {list(SECTIONS)}")
            if not isinstance(values, dict):
                raise UserError(f"{source}{section}: expected a [{section}] table of settings, got {_shown(values)}")
            # model.router first: choosing a router resets router_options (see set_value)
            for key, value in sorted(values.items(), key=lambda kv: kv[0] != "router"):
                set_value(cfg, f"{section}.{key}", value, source=f"{source}{section}.{key}", typed=True)
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


def set_value(cfg: TrainConfig, dotted: str, value: Any, source: str = "", typed: bool = False) -> None:
    """Assign ``section.key`` (or ``model.router_options.key``), converting ``value`` to the field type.

    ``typed``: ``value`` comes from TOML / JSON, which have numbers and booleans of their own, so a string
    is not parsed as one (``steps = "5"`` is refused; "none" still means None, as to_toml writes it)."""
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
        cfg.given.add(dotted)
        return
    if dotted == "data.blend":  # a string, or in a config file a table / array of tables
        from moekit.train.data import blend_spec

        value = blend_spec(value, where)
    value = convert(value, hints[key], where, typed)
    cfg.given.add(dotted)
    if dotted == "model.router":  # a new router family drops the old one's options (ModelConfig.set_router)
        cfg.model.set_router(value)
        return
    setattr(section, key, value)


def convert(value: Any, tp, where: str, typed: bool = False) -> Any:
    """Convert a command-line string, or (``typed``) a TOML / JSON value, to type ``tp``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType) and type(None) in args:
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            return None
        return convert(value, next(a for a in args if a is not type(None)), where, typed)
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
    if typed and isinstance(value, str) and tp is not str:
        raise UserError(f"{where}: expected {_TYPE_NAMES[tp]}, got {value!r} (a string); in a config file write "
                        f"numbers and true / false without quotes")
    try:
        return converter(value)
    except (TypeError, ValueError):
        raise UserError(f"{where}: expected {_TYPE_NAMES[tp]}, got {_shown(value)}") from None


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
_KINDS = ((bool, "a boolean"), (int, "an integer"), (float, "a number"), (list, "an array"), (dict, "a table"))


def _shown(value: Any) -> str:
    """A value as the user wrote it: strings quoted; TOML / JSON values spelled as JSON, with their kind."""
    if isinstance(value, str):
        return repr(value)
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):  # e.g. a TOML date
        text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    kind = next((k for t, k in _KINDS if isinstance(value, t)), type(value).__name__)
    return f"{text} ({kind})"


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
    _require(math.isfinite(t.lr) and 0 < t.lr <= MAX_LR,
             f"--train.lr={t.lr} is invalid; AdamW moves every weight by about lr per step, so the learning rate "
             f"must be in (0, {MAX_LR:g}] (typical: 1e-4 to 1e-2)")
    _require(0 <= t.min_lr_ratio <= 1, f"--train.min_lr_ratio={t.min_lr_ratio} is invalid; it must be in [0, 1]")
    for name in ("beta1", "beta2"):
        _require(0 <= getattr(t, name) < 1, f"--train.{name}={getattr(t, name)} is invalid; it must be in [0, 1)")
    for name in ("weight_decay", "grad_clip", "eps"):
        v = getattr(t, name)
        _require(math.isfinite(v) and v >= 0, f"--train.{name}={v} is invalid; it must be a finite number >= 0")
    _require(t.lr * t.weight_decay < 1,
             f"--train.weight_decay={t.weight_decay} with --train.lr={t.lr} is invalid; AdamW scales the weights by "
             f"1 - lr * weight_decay each step, so lr * weight_decay must be < 1 (typical weight_decay: 0 to 0.1)")
    _require(t.dtype in DTYPES, f"--train.dtype={t.dtype!r} is invalid; choose one of {list(DTYPES)}")
    _require(t.device in DEVICES, f"--train.device={t.device!r} is invalid; choose one of {list(DEVICES)}")
    _require(t.activation_checkpointing in ("none", "full", "ffn", "selective"),
             f"--train.activation_checkpointing={t.activation_checkpointing!r} is invalid; choose none, full, ffn or "
             f"selective")
    _require(t.host_memory in host_memory.MODES,
             f"--train.host_memory={t.host_memory!r} is invalid; choose one of {list(host_memory.MODES)} (system: "
             f"the C library's defaults; retain: keep freed CPU memory for reuse, see docs/training.md)")
    _require(t.on_nonfinite in ON_NONFINITE,
             f"--train.on_nonfinite={t.on_nonfinite!r} is invalid; choose one of {list(ON_NONFINITE)}")
    _require(not t.init_from_hf or os.path.isdir(t.init_from_hf),
             f"--init-from-hf {t.init_from_hf}: not a directory (expected a HuggingFace model folder)")
    validate_upcycling_flags(t)
    from moekit.train.modelsource import adopt_source_model

    cfg.source_note = adopt_source_model(cfg)  # the architecture of --init-from-hf / --init-from-dense
    validate_data(cfg)
    validate_placement(cfg)
    _require(cfg.layout.ep_overlap_chunks >= 1 and (cfg.layout.ep_overlap_chunks == 1 or cfg.layout.ep > 1),
             f"--layout.ep_overlap_chunks {cfg.layout.ep_overlap_chunks} is invalid; it must be >= 1, and > 1 only with "
             f"--ep > 1 (it overlaps the expert-parallel all-to-all; 1 = off)")
    _require(cfg.eval.every >= 0 and cfg.eval.sequences >= 1,
             f"eval.every={cfg.eval.every} must be >= 0 and eval.sequences={cfg.eval.sequences} >= 1")
    _require(cfg.log.every >= 1, f"--log.every={cfg.log.every} is invalid; it must be a positive integer")
    _require(cfg.log.load_every >= 0, f"--log.load_every={cfg.log.load_every} is invalid; it must be >= 0 (0 = auto)")
    _require(cfg.log.progress in PROGRESS, f"--log.progress={cfg.log.progress!r} is invalid; choose one of {list(PROGRESS)}")
    _require(cfg.checkpoint.every >= 0 and cfg.checkpoint.keep >= 1,
             f"checkpoint.every={cfg.checkpoint.every} must be >= 0 and checkpoint.keep={cfg.checkpoint.keep} >= 1")
    resolve_vocab(cfg)
    validate_model(cfg)
    validate_upcycling(cfg)
    return cfg


def validate_upcycling_flags(t: TrainSection) -> None:
    """--init-from-dense / --upcycle-granularity on their own (the model is checked by validate_upcycling)."""
    g = t.upcycle_granularity
    _require(g >= 1, f"--upcycle-granularity={g} is invalid; it must be an integer >= 1 (1 = every expert a copy of "
                     f"the dense MLP)")
    if not t.init_from_dense:
        _require(g == 1, f"--upcycle-granularity {g} needs --init-from-dense (the dense model to split)")
        return
    _require(not t.init_from_hf, f"--init-from-hf {t.init_from_hf} and --init-from-dense {t.init_from_dense} are both "
                                 f"set; choose one: --init-from-hf continues an MoE checkpoint, --init-from-dense "
                                 f"upcycles a dense one")
    _require(os.path.exists(t.init_from_dense),
             f"--init-from-dense {t.init_from_dense}: no such file or directory (expected a HuggingFace dense folder, a "
             f"moekit model file *.safetensors / *.pt, or a moekit-train checkpoint or run directory)")


def validate_upcycling(cfg: TrainConfig) -> None:
    """With --init-from-dense, the MoE config must be one whose upcycled model reproduces the dense model
    (moekit.models.upcycle.check_upcycle_config); the dense model's sizes are checked when it is read."""
    if not cfg.train.init_from_dense:
        return
    from moekit.models.upcycle import check_upcycle_config

    try:
        check_upcycle_config(cfg.model, cfg.train.upcycle_granularity)
    except ValueError as exc:
        raise UserError(f"--init-from-dense with --upcycle-granularity {cfg.train.upcycle_granularity}: {exc}") from None


def validate_placement(cfg: TrainConfig) -> None:
    """--layout.expert_placement / expert_replicas / rebalance_every on their own (the file's contents are
    checked against the model when the trainer reads it: moekit.train.rebalance)."""
    L = cfg.layout
    _require(L.rebalance_every >= 0, f"--layout.rebalance_every={L.rebalance_every} is invalid; it must be >= 0 (0 = never)")
    _require(L.expert_replicas >= 0, f"--layout.expert_replicas={L.expert_replicas} is invalid; it must be >= 0")
    placed = [f"--layout.{k} {getattr(L, k)}" for k in ("expert_placement", "expert_replicas", "rebalance_every")
              if getattr(L, k)]
    _require(not placed or (L.ep > 1 and cfg.model.num_experts > 0),
             f"{' '.join(placed)} places experts over expert-parallel ranks: it needs --ep > 1 and an MoE model")
    _require(L.ep < 1 or L.expert_replicas % L.ep == 0,
             f"--layout.expert_replicas {L.expert_replicas} must be a multiple of --ep {L.ep}: every rank holds the "
             f"same number of extra slots (e.g. {L.ep} or {2 * L.ep})")
    E = cfg.model.num_experts
    _require(not L.expert_replicas or L.expert_replicas <= E * (L.ep - 1),
             f"--layout.expert_replicas {L.expert_replicas} exceeds {E * (L.ep - 1)}: with it every rank would hold "
             f"some expert twice; use at most num_experts x (ep - 1)")
    _require(not L.expert_placement or os.path.isfile(L.expert_placement),
             f"--layout.expert_placement {L.expert_placement}: no such file (write one with moekit-placement RUN_DIR "
             f"--ep {L.ep} -o FILE)")


def validate_data(cfg: TrainConfig) -> None:
    from moekit.train.tokens import RAW_DTYPES

    d = cfg.data
    _require(0 < d.val_fraction < 0.5, f"--data.val_fraction={d.val_fraction} is invalid; it must be in (0, 0.5)")
    _require(not (d.path and d.text), "--data.path and --data.text are both set; choose one data source")
    _require(not (d.blend and (d.path or d.text)),
             f"--data.blend and --data.{'path' if d.path else 'text'} are both set; choose one data source (a blend "
             f"of one set is --data.blend FILE:1)")
    _require(d.dtype in RAW_DTYPES, f"--data.dtype={d.dtype!r} is invalid; choose one of {list(RAW_DTYPES)} (the ids "
                                    f"of a raw .bin file; token files and .npy files carry their own)")


def resolve_vocab(cfg: TrainConfig) -> None:
    """The model's vocabulary from the data's metadata (a moekit-prepare set) unless a config file or flag set
    model.vocab_size; a data vocabulary larger than a given one is refused. Missing blend sets and blends of
    different tokenizers are refused here too, before any work."""
    from moekit.train.data import prepared_vocab

    found = prepared_vocab(cfg.data)
    if found is None:
        return
    vocab, path = found
    if "model.vocab_size" not in cfg.given:
        cfg.model.vocab_size = vocab
    elif vocab > cfg.model.vocab_size:
        raise UserError(f"data file {path}: its tokenizer has vocab_size {vocab} (metadata {path}.json) but "
                        f"model.vocab_size is set to {cfg.model.vocab_size}; set it to at least {vocab}, or leave it "
                        f"out to take the data's")


def validate_model(cfg: TrainConfig) -> None:
    """ModelConfig checks, then a meta-device build: router options fail here, before any work."""
    # deferred: --help and config errors should not wait for torch
    from moekit.models.transformer import Transformer, meta_device

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
        with meta_device():
            Transformer(m)
    except ValueError as exc:
        msg = str(exc)
        named = msg.startswith(f"router {m.router!r}")  # build_router's messages name the router already
        raise UserError(f"model config ({cfg.preset}{'' if named else f', router {m.router!r}'}): {msg}") from None
    if m.num_experts:
        check_expert_backend(cfg)
        check_kernel_environment()


def check_kernel_environment() -> None:
    """The Triton kernels' environment variables, checked before the run instead of at its first expert GEMM
    (nothing to check where triton is not installed: the kernels never run)."""
    try:
        from moekit.moe.kernels import environment_problem
    except ImportError:
        return
    problem = environment_problem()
    if problem:
        raise UserError(problem)


def run_device(t: TrainSection) -> tuple[str, torch.dtype | None]:
    """(device kind, autocast dtype or None for plain fp32) that ``train.device`` / ``train.dtype`` ask for:
    auto = CUDA when torch sees a GPU, and bf16 autocast there. The one place this choice is made."""
    import torch

    kind = t.device if t.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"float32": None, "bfloat16": torch.bfloat16, "auto": torch.bfloat16 if kind == "cuda" else None}[t.dtype]
    return kind, dtype


def check_expert_backend(cfg: TrainConfig) -> None:
    """A named expert backend must run on this run's device and dtype (``auto`` always does): refused here,
    not at the first forward. Device and dtype are chosen as moekit.train.plan.plan_run does."""
    import torch

    from moekit.moe.experts import ffn_in_features, resolve_backend

    m, t = cfg.model, cfg.train
    if m.expert_backend == "auto":
        return
    kind, dtype = run_device(t)
    if kind == "cuda" and not torch.cuda.is_available():
        return  # plan_run refuses the device itself, naming it
    dtype = dtype or torch.float32
    device = torch.device("cpu")
    if kind == "cuda":  # this rank's GPU (train.distributed picks LOCAL_RANK's): not a context on GPU 0 from every rank
        local = os.environ.get("LOCAL_RANK", "0")
        device = torch.device("cuda", int(local) if local.isdigit() and int(local) < torch.cuda.device_count() else 0)
    H, F = m.hidden_size, m.moe_ffn_hidden_size
    one = torch.zeros((), device=device, dtype=dtype)  # expanded views: the real shapes, one element allocated
    rows, w_in, w_out = one.expand(1, H), one.expand(1, H, ffn_in_features(m.activation, F)), one.expand(1, F, H)
    try:
        resolve_backend(m.expert_backend, rows, w_in, w_out)
    except ValueError as exc:
        raise UserError(f"--model.expert_backend={m.expert_backend!r}: {exc}") from None


# ---------------------------------------------------------------------------------------------------
# Config files: TOML or JSON in, TOML out
# ---------------------------------------------------------------------------------------------------


def load_config(path: str) -> dict[str, Any]:
    """Read ``--config FILE``: TOML, or JSON (a run directory's config.json) by its suffix or its first character."""
    where = f"--config {path or repr(path)}"
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise UserError(f"{where}: file not found") from None
    except IsADirectoryError:
        raise UserError(f"{where}: is a directory; pass a TOML file or a run directory's config.json") from None
    except OSError as exc:
        raise UserError(f"{where}: cannot read it ({exc.strerror or exc})") from None
    try:
        text = raw.decode("utf-8").removeprefix("\ufeff")  # a byte-order mark some editors write
    except UnicodeDecodeError as exc:
        raise UserError(f"{where}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start}); save it "
                        f"as UTF-8") from None
    if path.lower().endswith(".json") or text.lstrip().startswith("{"):  # a TOML document never starts with {
        try:
            values = json.loads(text)
        except json.JSONDecodeError as exc:
            raise UserError(f"{where}: invalid JSON ({exc})") from None
        if not isinstance(values, dict):
            raise UserError(f"{where}: expected a JSON object of sections like config.json's, got {_shown(values)}")
        return values
    try:
        import tomllib
    except ImportError:  # Python 3.10
        try:
            import tomli as tomllib
        except ImportError:
            raise UserError(f"{where}: reading TOML on Python {sys.version_info[0]}.{sys.version_info[1]} "
                            f"needs the tomli package (pip install tomli), or Python >= 3.11") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"{where}: invalid TOML ({exc})") from None


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
