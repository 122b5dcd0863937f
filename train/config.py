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
    [profile] every, steps, warmup, memory             --profile.every 100   (moekit.train.profiling)

Every value is converted to its field's type (``int``, ``float``, ``bool``, ``float | None`` with
"none", tables as JSON) and checked before any work starts (moekit.train.validation); errors are
``UserError`` naming the flag, the value and what would be accepted.
"""
from __future__ import annotations

import dataclasses
import json
import math
import sys
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from moekit.models.config import PRESETS, ModelConfig, preset
from moekit.train import UserError

DEFAULT_PRESET = "mixtral-tiny"
DTYPES = ("auto", "float32", "bfloat16")
RESIDUAL_DTYPES = ("auto", "float32", "bfloat16")
DEVICES = ("auto", "cpu", "cuda")
PROGRESS = ("auto", "on", "off")
ON_NONFINITE = ("stop", "skip")  # moekit.train.guard acts on these
LR_SCHEDULES = ("cosine", "linear", "constant", "wsd")  # train.lr_schedule (moekit.train.plan.lr_lambda)
WSD_DECAYS = ("linear", "sqrt", "cosine")  # train.wsd_decay
EXCLUDABLE = ("data",)  # checkpoint.exclude_from_loading: parts of a checkpoint a resume may leave unloaded
MAX_LR = 1.0  # AdamW's step is ~lr per weight: beyond this a run can only diverge (and 10 * lr can overflow fp32)


def excluded(setting: str) -> tuple[str, ...]:
    """checkpoint.exclude_from_loading's parts ("data,..." -> ("data", ...)); EXCLUDABLE names the valid ones."""
    return tuple(p.strip() for p in setting.split(",") if p.strip())


@dataclass
class TrainSection:
    steps: int = 400  # optimizer steps (the default run: ~3 minutes on a 2-core CPU)
    batch_size: int = 16  # global batch: sequences per optimizer step, whatever the layout
    micro_batch_size: int = 0  # sequences per forward on one rank; 0 = the whole per-rank batch (no accumulation)
    batch_size_start: int = 0  # global batch at step 1, ramped linearly to batch_size over batch_ramp_steps (0 = no
    #   ramp; DeepSeek-V3 went 3072 -> 15360 sequences); each step's batch is whole micro-batches on every rank
    batch_ramp_steps: int = 0  # steps the batch-size ramp takes (with batch_size_start)
    seq_len: int = 256  # tokens per sequence (<= model.max_seq_len)
    lr: float = 3e-3  # peak learning rate (AdamW)
    min_lr_ratio: float = 0.1  # the schedule decays to lr * min_lr_ratio at the last step
    warmup_steps: int = 20  # linear warmup from lr / warmup_steps
    lr_schedule: str = "cosine"  # after warmup: cosine | linear | constant | wsd (constant, then decay at the end)
    decay_fraction: float = 0.2  # wsd: the final share of the post-warmup steps spent decaying to min_lr_ratio
    decay_steps: int = 0  # wsd: the decay over the last n steps instead (0 = decay_fraction); a cooldown branched
    #   from a stable-phase checkpoint: --resume it with --steps S + n --train.decay_steps n
    wsd_decay: str = "linear"  # wsd: the decay's shape, linear | sqrt (1 - sqrt) | cosine
    optimizer: str = "adamw"  # adamw | muon (Muon on the weight matrices, AdamW on the rest: train/muon.py)
    muon_momentum: float = 0.95  # muon: the momentum of the matrices' (Nesterov) gradient buffer
    weight_decay: float = 0.1  # on matrices and embeddings, not on norms
    beta1: float = 0.9  # AdamW first-moment decay
    beta2: float = 0.95  # AdamW second-moment decay
    eps: float = 1e-8  # AdamW denominator epsilon
    grad_clip: float = 1.0  # max global grad norm; 0 = no clipping (the norm is still logged)
    seed: int = 0  # weight init, data order, router noise
    dtype: str = "auto"  # auto = bf16 autocast on CUDA, fp32 on CPU
    residual_dtype: str = "auto"  # the residual stream (embedding out, residual adds, norms): auto = bf16 under bf16
    #   autocast on CUDA (as FSDP's bf16 parameters compute, Megatron's and torchtitan's default), fp32 otherwise;
    #   float32 keeps it fp32 (Megatron's fp32_residual_connection); bfloat16 needs bf16 autocast (CPUs too)
    device: str = "auto"  # auto = cuda when available
    init_from_hf: str = ""  # a HuggingFace folder to start from (models.hf); the model config must match it
    init_from: str = ""  # start from a moekit run's weights (its newest checkpoint that verifies, or one checkpoint):
    #   a fresh optimizer, schedule and data order, e.g. fine-tuning after pretraining (--resume continues a run)
    init_from_dense: str = ""  # upcycle a dense model (HF folder, moekit file, checkpoint or run dir) into this MoE
    upcycle_granularity: int = 1  # with init_from_dense: each dense MLP split into g experts of F/g (1 = copies)
    upcycle_drop: float = 0.0  # with init_from_dense: each expert re-initialises this share of its units (drop-upcycling)
    trainable: str = ""  # partial training: only the parameters these comma-separated patterns name train ("" = all),
    #   e.g. "*.experts.*" or "*.attn.*,*.router.*" (one-process names; moekit.train.freezing)
    freeze: str = ""  # these parameters stay as they are (patterns, after trainable), e.g. "embed.*,*.router.*"
    lr_scale: str = ""  # per-parameter learning-rate multipliers, "PATTERN=FACTOR,..." (first match wins; the same
    #   patterns as trainable), e.g. "*.router.*=0.1,embed.*=0.5": those parameters train at lr x FACTOR, schedule alike
    train_experts: str = ""  # expert-specialised fine-tuning: only the experts this file lists train in each MoE
    #   layer (moekit-eval --select-experts writes it); with trainable "*.experts.*" nothing else trains
    export_hf: str = ""  # after the last step, write the model here as a HuggingFace folder (models.hf.save_hf_sharded)
    export_hf_fp8: bool = False  # with export_hf: linear weights in block-wise fp8 e4m3 (DeepSeek-V3's release format)
    export_hf_mxfp4: bool = False  # with export_hf: gpt-oss's expert weights in MXFP4 (OpenAI's release format)
    export_hf_ema: bool = False  # with export_hf and ema_decay: write the parameter average instead of the weights
    on_nonfinite: str = "stop"  # non-finite loss / grad norm on any rank: stop, or skip the step (no update)
    spike_skip: float = 0.0  # skip the step (no update) when its loss or grad norm is this many standard deviations
    #   above the mean of the last spike_window good steps (0 = off; e.g. 6); moekit.train.spikes
    spike_window: int = 128  # good steps the spike statistics cover (none is skipped before the window is full)
    ema_decay: float = 0.0  # keep an exponential moving average of the parameters with this decay per step (0 = off;
    #   e.g. 0.999), in the optimizer state; evaluations also report val_loss_ema (moekit.train.ema)
    ema_every: int = 1  # with ema_decay: fold the weights in every n steps (each time weighing decay^n): 1/n the cost
    ema_start: int = 0  # with ema_decay: the average starts at this step (a copy of the weights then)
    compile: bool = False  # torch.compile each transformer block (models.parallelize step 4)
    deterministic: bool = False  # deterministic kernels (torch.use_deterministic_algorithms); see docs/training.md
    activation_checkpointing: str = "none"  # recompute: none | full (blocks) | ffn (FFN/MoE) | selective (elementwise ops)
    qk_clip: float = 0.0  # QK-clip (Kimi K2's MuonClip, models/qk_clip.py): after each step, heads whose largest
    #   attention logit passed this (e.g. 100) get their q / k weights scaled back to it; 0 = off
    host_memory: str = "system"  # system (the C library's) | retain: keep freed CPU memory (moekit.train.host_memory)


@dataclass
class DataSection:
    path: str = ""  # token ids: a token file (moekit-prepare), a raw .bin (nanoGPT) or a .npy; "" = embedded corpus
    text: str = ""  # a text file, tokenised as bytes (vocab 256)
    blend: str = ""  # a weighted mixture of token files, "a.bin:0.7,b.bin:0.3" (config file: also a table / array)
    dtype: str = "uint16"  # the ids of a raw (headerless) .bin file: uint16 (nanoGPT), uint32 or uint8
    val_fraction: float = 0.05  # share of the data held out for validation, in (0, 0.5): every 1/val_fraction-th block
    val_path: str = ""  # a validation token file of its own (nanoGPT's val.bin): the training data then trains whole
    document_mask: bool = False  # attention stays within each document of a packed sequence (split at the data's EOS id)


@dataclass
class EvalSection:
    every: int = 50  # validation every n steps (and after the last); 0 = only after the last
    sequences: int = 64  # validation sequences (fixed, spread over the held-out split)
    tasks: str = ""  # multiple-choice tasks scored at each evaluation, comma-separated: task files (moekit-eval
    #   --tasks' formats) and/or the built-in @continuation, @next-line; metrics.jsonl "tasks": {name: {acc, acc_norm,
    #   correct_nll, chance, items}}
    task_items: int = 200  # items of each task scored at each evaluation (the first ones of a file)
    task_fewshot: int = 0  # solved examples of the same file before each task item (moekit-eval --fewshot)
    ema: bool = True  # with --train.ema_decay: each evaluation also measures the averaged weights (val_loss_ema;
    #   with --eval.tasks also their scores, tasks_ema)


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
    keep_every: int = 0  # also keep the checkpoints at multiples of this step, whatever keep says (0 = none):
    #   milestones for averaging and analysis
    async_save: bool = False  # write in the background (dcp.async_save) after a synchronous copy to CPU memory
    exclude_from_loading: str = ""  # "data": on --resume the data and seq_len may change; the new data drawn afresh


@dataclass
class LayoutSection:
    """The [layout] settings as the user gave them: requested degrees and the knobs around them.

    Settings only, no checks: moekit.train.plan.resolve_layout turns them, with the world size, the model
    and the batch, into comm.topology's ``Layout`` (the one degrees type, which validates itself) plus the
    per-rank batch split. World size = dp * fsdp * cp * tp * pp; ep borrows from the dp * fsdp * cp ranks. 0 for
    dp means "infer from the world size"; once resolved, the trainer writes the inferred dp back here, so
    --print-config and config.json show the degrees the run used.
    """

    dp: int = 0  # data-parallel replicas; 0 = world size / (fsdp * tp * pp)
    ep: int = 1  # expert-parallel ranks (divides dp * fsdp and num_experts): each holds E / ep experts
    tp: int = 1  # tensor-parallel ranks: attention heads and dense MLP widths split, MoE tokens split
    pp: int = 1  # pipeline stages: contiguous groups of layers
    fsdp: int = 1  # fully-sharded data-parallel ranks (FSDP2: parameters, gradients, optimizer state)
    cp: int = 1  # context-parallel ranks: each sequence split over them (long context); attention gathers keys
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
class ProfileSection:
    """Traces of chosen steps (moekit.train.profiling): <run_dir>/profile/step_<s>/, one set of files per rank."""

    every: int = 0  # trace the steps ending at each multiple of n (torch.profiler, every rank); 0 = off
    steps: int = 1  # steps recorded in each trace (the last ones up to the multiple of every)
    warmup: int = 1  # steps the profiler runs unrecorded before them (its start-up cost stays out of the trace)
    memory: bool = False  # CUDA: record the allocator's history; a snapshot with each trace and on out-of-memory


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
    profile: ProfileSection = field(default_factory=ProfileSection)

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


# A JSON object for each table-valued setting, for the message when a string is not one.
EXAMPLES = {"router_options": '{"jitter": 0.0}', "rope_scaling": '{"rope_type": "linear", "factor": 2.0}'}


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
                example = EXAMPLES.get(where.rsplit(".", 1)[-1], '{"key": value}')
                raise UserError(f"{where}: expected a JSON object such as '{example}', got {value!r}") from None
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
