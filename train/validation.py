"""Training configuration checks: everything that can be checked before data is read or a device is touched
(moekit.train.config holds the settings; moekit.train.plan.resolve_layout checks [layout] against the world).

Each check raises ``UserError`` naming the flag, the value and what would be accepted. ``validate(cfg)`` runs
them all, cheapest first: the model is built on the meta device last, so a value the cheap checks refuse never
waits for torch.
"""
from __future__ import annotations

import dataclasses
import math
import os
from typing import TYPE_CHECKING

from moekit.train import UserError, host_memory, runlock
from moekit.train.config import (DEVICES, DTYPES, EXCLUDABLE, LR_SCHEDULES, MAX_LR, ON_NONFINITE, PROGRESS,
                                 RESIDUAL_DTYPES, WSD_DECAYS, TrainConfig, TrainSection, excluded)

if TYPE_CHECKING:
    import torch


def _require(ok: bool, msg: str) -> None:
    if not ok:
        raise UserError(msg)


OPTIMIZERS = ("adamw", "muon")


def validate(cfg: TrainConfig) -> TrainConfig:
    """Every section but [layout], whose degrees need the world size: moekit.train.plan.resolve_layout."""
    t = cfg.train
    for name in ("steps", "batch_size", "seq_len"):
        _require(getattr(t, name) >= 1, f"--train.{name}={getattr(t, name)} is invalid; it must be a positive integer")
    for name in ("micro_batch_size", "warmup_steps", "seed", "batch_size_start", "batch_ramp_steps"):
        _require(getattr(t, name) >= 0, f"--train.{name}={getattr(t, name)} is invalid; it must be >= 0")
    _require(bool(t.batch_size_start) == bool(t.batch_ramp_steps),
             f"--train.batch_size_start={t.batch_size_start} with --train.batch_ramp_steps={t.batch_ramp_steps}: a "
             f"batch-size ramp needs both (the batch at step 1, and the steps to reach --batch-size), or neither")
    _require(t.batch_size_start < t.batch_size or not t.batch_size_start,
             f"--train.batch_size_start={t.batch_size_start} is invalid; the ramp starts below --batch-size "
             f"{t.batch_size} and grows to it")
    _require(t.seed < 2**63, f"--train.seed={t.seed} is invalid; it must be < 2**63 (torch seeds are 64-bit)")
    _require(math.isfinite(t.lr) and 0 < t.lr <= MAX_LR,
             f"--train.lr={t.lr} is invalid; AdamW moves every weight by about lr per step, so the learning rate "
             f"must be in (0, {MAX_LR:g}] (typical: 1e-4 to 1e-2)")
    _require(0 <= t.min_lr_ratio <= 1, f"--train.min_lr_ratio={t.min_lr_ratio} is invalid; it must be in [0, 1]")
    validate_schedule(t)
    for name in ("beta1", "beta2", "muon_momentum"):
        _require(0 <= getattr(t, name) < 1, f"--train.{name}={getattr(t, name)} is invalid; it must be in [0, 1)")
    _require(t.optimizer in OPTIMIZERS, f"--train.optimizer={t.optimizer!r} is invalid; choose one of "
                                        f"{list(OPTIMIZERS)} (muon: Muon on the weight matrices, AdamW on the rest)")
    for name in ("weight_decay", "grad_clip", "eps"):
        v = getattr(t, name)
        _require(math.isfinite(v) and v >= 0, f"--train.{name}={v} is invalid; it must be a finite number >= 0")
    _require(t.lr * t.weight_decay < 1,
             f"--train.weight_decay={t.weight_decay} with --train.lr={t.lr} is invalid; AdamW scales the weights by "
             f"1 - lr * weight_decay each step, so lr * weight_decay must be < 1 (typical weight_decay: 0 to 0.1)")
    _require(t.dtype in DTYPES, f"--train.dtype={t.dtype!r} is invalid; choose one of {list(DTYPES)}")
    _require(t.device in DEVICES, f"--train.device={t.device!r} is invalid; choose one of {list(DEVICES)}")
    _require(math.isfinite(t.qk_clip) and t.qk_clip >= 0,
             f"--train.qk_clip={t.qk_clip} is invalid; it must be a finite logit bound >= 0 (0 = off; Kimi K2 "
             f"used 100)")
    if t.qk_clip > 0:
        from moekit.models.qk_clip import check_model

        problem = check_model(cfg.model)
        _require(not problem, f"--train.qk_clip={t.qk_clip}: {problem}")
        _require(t.activation_checkpointing != "selective",
                 f"--train.qk_clip={t.qk_clip} with --train.activation_checkpointing selective: selective "
                 f"checkpointing replays kept matmuls by call order, and the logit record runs in the forward only; "
                 f"use none, full or ffn")
    _require(t.residual_dtype in RESIDUAL_DTYPES, f"--train.residual_dtype={t.residual_dtype!r} is invalid; choose one "
                                                  f"of {list(RESIDUAL_DTYPES)}")
    if t.residual_dtype == "bfloat16":
        import torch

        kind, autocast = run_device(t)
        _require(autocast == torch.bfloat16,
                 f"--train.residual_dtype=bfloat16 needs bf16 autocast, but this run computes in fp32 (--train.dtype="
                 f"{t.dtype} on {kind}); add --train.dtype bfloat16, or leave --train.residual_dtype auto")
    _require(t.activation_checkpointing in ("none", "full", "ffn", "selective"),
             f"--train.activation_checkpointing={t.activation_checkpointing!r} is invalid; choose none, full, ffn or "
             f"selective")
    _require(t.host_memory in host_memory.MODES,
             f"--train.host_memory={t.host_memory!r} is invalid; choose one of {list(host_memory.MODES)} (system: "
             f"the C library's defaults; retain: keep freed CPU memory for reuse, see docs/training.md)")
    _require(math.isfinite(t.spike_skip) and t.spike_skip >= 0,
             f"--train.spike_skip={t.spike_skip} is invalid; it must be a number of standard deviations >= 0 (0 = off; "
             f"e.g. 6)")
    _require(t.spike_window >= 2, f"--train.spike_window={t.spike_window} is invalid; the statistics need at least 2 "
                                  f"steps (e.g. 128)")
    _require(math.isfinite(t.ema_decay) and 0 <= t.ema_decay < 1,
             f"--train.ema_decay={t.ema_decay} is invalid; it must be in [0, 1) (0 = off; e.g. 0.999: a half-life of "
             f"~690 steps)")
    _require(t.ema_every >= 1, f"--train.ema_every={t.ema_every} is invalid; it must be a number of steps >= 1")
    _require(t.ema_start >= 0, f"--train.ema_start={t.ema_start} is invalid; it must be a step >= 0 (0 = from the "
                               f"first step)")
    _require(t.on_nonfinite in ON_NONFINITE,
             f"--train.on_nonfinite={t.on_nonfinite!r} is invalid; choose one of {list(ON_NONFINITE)}")
    _require(not t.init_from_hf or os.path.isdir(t.init_from_hf),
             f"--init-from-hf {t.init_from_hf}: not a directory (expected a HuggingFace model folder)")
    moekit_run = t.init_from_hf and any(os.path.exists(os.path.join(t.init_from_hf, name))
                                        for name in ("checkpoints", "meta.json"))
    _require(not moekit_run,  # its config.json is the run's own, not HuggingFace's
             f"--init-from-hf {t.init_from_hf}: a moekit-train run directory or checkpoint, not a HuggingFace folder; "
             f"continue it with --resume (its newest checkpoint, or --resume CHECKPOINT), upcycle a dense one with "
             f"--init-from-dense {t.init_from_hf}, or write a HuggingFace folder first with 'moekit-convert "
             f"moekit-to-hf {t.init_from_hf} OUT'")
    validate_upcycling_flags(t)
    sources = [flag for flag, v in (("--init-from-hf", t.init_from_hf), ("--init-from-dense", t.init_from_dense),
                                    ("--train.init_from", t.init_from)) if v]
    _require(len(sources) <= 1, f"{' and '.join(sources)} each give the run its starting weights; choose one")
    _require(not t.init_from or os.path.isdir(t.init_from)
             or (os.path.isfile(t.init_from) and t.init_from.endswith((".safetensors", ".pt"))),
             f"--train.init_from {t.init_from}: not a directory or a moekit model file (expected a moekit-train run "
             f"directory, one of its checkpoints, RUN_DIR/checkpoints/step_N, or a *.safetensors / *.pt model file)")
    _require(not t.init_from or not os.path.realpath(t.init_from).startswith(os.path.realpath(cfg.run_dir) + os.sep),
             f"--train.init_from {t.init_from} lies inside --run-dir {cfg.run_dir}, which this run takes over; start "
             f"the new run in another --run-dir")
    for flag, source in (("--init-from-hf", t.init_from_hf), ("--init-from-dense", t.init_from_dense),
                         ("--train.init_from", t.init_from)):
        _require(not source or os.path.realpath(source) != os.path.realpath(cfg.run_dir),
                 f"--run-dir {cfg.run_dir} is the {flag} folder; the run would replace its config.json and "
                 f"tokenizer: choose another --run-dir")
    _require(t.export_hf or not t.export_hf_fp8, "--train.export_hf_fp8 true writes the --export-hf folder in fp8; "
                                                 "give --export-hf DIR too")
    _require(t.export_hf or not t.export_hf_mxfp4, "--train.export_hf_mxfp4 true writes the --export-hf folder's "
                                                   "experts in MXFP4; give --export-hf DIR too")
    _require(not (t.export_hf_fp8 and t.export_hf_mxfp4), "--train.export_hf_fp8 and --train.export_hf_mxfp4 each "
                                                          "quantize the expert weights; choose one")
    _require(t.export_hf or not t.export_hf_ema, "--train.export_hf_ema true writes the parameter average to the "
                                                 "--export-hf folder; give --export-hf DIR too")
    _require(not t.export_hf_ema or t.ema_decay > 0, "--train.export_hf_ema true exports the parameter average; keep one "
                                                     "with --train.ema_decay (e.g. 0.999)")
    _require(not t.export_hf_ema or t.ema_start <= t.steps,
             f"--train.export_hf_ema true: the average starts at step {t.ema_start} (--train.ema_start), after the last "
             f"step {t.steps}; lower --train.ema_start")
    if t.export_hf:
        validate_export_dir(t.export_hf, cfg.run_dir)
    from moekit.train.modelsource import adopt_source_model

    cfg.source_note = adopt_source_model(cfg)  # the architecture of --init-from-hf / --init-from-dense
    validate_data(cfg)
    validate_placement(cfg)
    _require(cfg.layout.ep_overlap_chunks >= 1 and (cfg.layout.ep_overlap_chunks == 1 or cfg.layout.ep > 1),
             f"--layout.ep_overlap_chunks {cfg.layout.ep_overlap_chunks} is invalid; it must be >= 1, and > 1 only with "
             f"--ep > 1 (it overlaps the expert-parallel all-to-all; 1 = off)")
    _require(cfg.eval.every >= 0,
             f"--eval.every={cfg.eval.every} is invalid; it must be >= 0 (0 = only after the last step)")
    _require(cfg.eval.sequences >= 1, f"--eval.sequences={cfg.eval.sequences} is invalid; it must be a positive number "
                                      f"of validation sequences")
    _require(cfg.eval.task_items >= 1, f"--eval.task_items={cfg.eval.task_items} is invalid; it must be a positive "
                                       f"number of items per task")
    _require(cfg.eval.task_fewshot >= 0, f"--eval.task_fewshot={cfg.eval.task_fewshot} is invalid; it must be a "
                                         f"number of examples >= 0")
    if cfg.eval.tasks:
        from moekit.train.tasks import check_specs

        check_specs(cfg.eval.tasks, "--eval.tasks")  # names and files, before anything runs
    _require(cfg.log.every >= 1, f"--log.every={cfg.log.every} is invalid; it must be a positive integer")
    _require(cfg.log.load_every >= 0, f"--log.load_every={cfg.log.load_every} is invalid; it must be >= 0 (0 = auto)")
    _require(cfg.log.progress in PROGRESS, f"--log.progress={cfg.log.progress!r} is invalid; choose one of {list(PROGRESS)}")
    _require(cfg.checkpoint.every >= 0,
             f"--checkpoint.every={cfg.checkpoint.every} is invalid; it must be >= 0 (0 = never)")
    _require(all(p in EXCLUDABLE for p in excluded(cfg.checkpoint.exclude_from_loading)),
             f"--checkpoint.exclude_from_loading={cfg.checkpoint.exclude_from_loading!r} is invalid; it takes "
             f"{', '.join(repr(p) for p in EXCLUDABLE)} (resume into new data: its position starts afresh) or nothing")
    _require(cfg.checkpoint.keep_every >= 0 and (not cfg.checkpoint.keep_every or not cfg.checkpoint.every
                                                 or cfg.checkpoint.keep_every % cfg.checkpoint.every == 0),
             f"--checkpoint.keep_every={cfg.checkpoint.keep_every} is invalid; it must be >= 0 (0 = none) and a "
             f"multiple of --checkpoint.every {cfg.checkpoint.every}, whose saves it keeps")
    _require(cfg.checkpoint.keep >= 1, f"--checkpoint.keep={cfg.checkpoint.keep} is invalid; it must keep at least 1 "
                                       f"checkpoint (the newest)")
    validate_profile(cfg)
    resolve_vocab(cfg)
    validate_model(cfg)
    validate_mtp(cfg)
    validate_upcycling(cfg)
    return cfg


def validate_profile(cfg: TrainConfig) -> None:
    """[profile]: windows that fit between their multiples of every, and memory snapshots only where there is CUDA."""
    p = cfg.profile
    _require(p.every >= 0, f"--profile.every={p.every} is invalid; it must be >= 0 (trace the steps ending at each "
                           f"multiple of it; 0 = off)")
    _require(p.steps >= 1, f"--profile.steps={p.steps} is invalid; a trace records at least 1 step")
    _require(p.warmup >= 0, f"--profile.warmup={p.warmup} is invalid; it must be >= 0 (steps the profiler runs "
                            f"unrecorded first)")
    _require(not p.every or p.steps + p.warmup <= p.every,
             f"--profile.steps={p.steps} + --profile.warmup={p.warmup} is more than --profile.every={p.every}: each "
             f"trace would begin before the last one ended; raise --profile.every to at least {p.steps + p.warmup} or "
             f"record fewer steps")
    if p.memory:
        kind, _ = run_device(cfg.train)
        _require(kind == "cuda", f"--profile.memory true records CUDA's caching allocator, and this run is on {kind}; "
                                 f"leave it off there (--profile.every traces the CPU's operators all the same)")


def validate_mtp(cfg: TrainConfig) -> None:
    """Multi-token prediction (models.mtp) needs a sequence longer than its depths (it runs under every layout:
    one process, dp, fsdp, ep, tp with or without sequence parallelism, and pp on the last stage)."""
    D = cfg.model.mtp_layers
    if not D:
        return
    adopted = cfg.train.init_from_hf and "model.mtp_layers" not in cfg.given and "preset" not in cfg.given
    source = " (the --init-from-hf checkpoint's num_nextn_predict_layers)" if adopted else ""
    _require(cfg.train.seq_len > D, f"--model.mtp_layers {D}{source} predicts up to {D + 1} tokens ahead, but "
                                    f"--train.seq_len is {cfg.train.seq_len}: use sequences longer than {D}, or fewer "
                                    f"depths (--model.mtp_layers)")


def validate_upcycling_flags(t: TrainSection) -> None:
    """--init-from-dense / --upcycle-granularity on their own (the model is checked by validate_upcycling)."""
    g = t.upcycle_granularity
    _require(g >= 1, f"--upcycle-granularity={g} is invalid; it must be an integer >= 1 (1 = every expert a copy of "
                     f"the dense MLP)")
    r = t.upcycle_drop
    _require(math.isfinite(r) and 0.0 <= r <= 1.0,
             f"--upcycle-drop={r} is invalid; it must be a fraction in [0, 1] (the share of each expert's hidden "
             f"units re-initialised; 0 = plain upcycling, 0.5 = the drop-upcycling paper's choice)")
    if not t.init_from_dense:
        _require(g == 1, f"--upcycle-granularity {g} needs --init-from-dense (the dense model to split)")
        _require(r == 0, f"--upcycle-drop {r} needs --init-from-dense (the dense model to upcycle)")
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
    from moekit.train.data import data_files
    from moekit.train.tokens import RAW_DTYPES

    d = cfg.data
    _require(0 < d.val_fraction < 0.5, f"--data.val_fraction={d.val_fraction} is invalid; it must be in (0, 0.5)")
    _require(not (d.path and d.text), "--data.path and --data.text are both set; choose one data source")
    _require(not (d.blend and (d.path or d.text)),
             f"--data.blend and --data.{'path' if d.path else 'text'} are both set; choose one data source (a blend "
             f"of one set is --data.blend FILE:1)")
    _require(not d.val_path or os.path.isfile(d.val_path),
             f"--data.val_path {d.val_path}: no such file (a token file to validate on: moekit-prepare's, a raw .bin "
             f"or a .npy, prepared with the training data's tokenizer)")
    _require(not d.val_path or all(os.path.realpath(d.val_path) != os.path.realpath(p) for p in data_files(d)),
             f"--data.val_path {d.val_path} is also training data; validate on held-out text (a file of its own, or "
             f"leave --data.val_path empty to hold out --data.val_fraction of the training data)")
    _require(d.dtype in RAW_DTYPES, f"--data.dtype={d.dtype!r} is invalid; choose one of {list(RAW_DTYPES)} (the ids "
                                    f"of a raw .bin file; token files and .npy files carry their own)")


def resolve_vocab(cfg: TrainConfig) -> None:
    """The model's vocabulary from the data's metadata (a moekit-prepare set) unless a config file or flag set
    model.vocab_size; a data vocabulary larger than a given one is refused. Missing blend sets and blends of
    different tokenizers are refused here too, before any work."""
    from moekit.train.data import prepared_vocab

    found = prepared_vocab(cfg.data)
    d = cfg.data
    if found is None and not (d.path or d.blend) and cfg.model.vocab_size < 256:  # bytes: the corpus, --data.text
        raise UserError(f"--model.vocab_size={cfg.model.vocab_size}: the data is byte-level text "
                        f"({d.text or 'the embedded corpus'}), whose 256 byte values need model.vocab_size >= 256")
    if found is None:
        return
    vocab, path = found
    if "model.vocab_size" not in cfg.given:
        cfg.model.vocab_size = vocab
    elif vocab > cfg.model.vocab_size:
        raise UserError(f"data file {path}: its tokenizer has vocab_size {vocab} (metadata {path}.json) but "
                        f"model.vocab_size is set to {cfg.model.vocab_size}; set it to at least {vocab}, or leave it "
                        f"out to take the data's")


def validate_schedule(t) -> None:
    """lr_schedule and the wsd settings, which apply to wsd only (a changed one with another schedule is refused:
    it would do nothing)."""
    _require(t.lr_schedule in LR_SCHEDULES,
             f"--train.lr_schedule={t.lr_schedule!r} is invalid; choose one of {list(LR_SCHEDULES)} (wsd: warmup, "
             f"constant, then a decay over the last --train.decay_fraction of the steps)")
    _require(t.wsd_decay in WSD_DECAYS,
             f"--train.wsd_decay={t.wsd_decay!r} is invalid; choose one of {list(WSD_DECAYS)}")
    _require(isinstance(t.decay_fraction, (int, float)) and 0 < t.decay_fraction <= 1,
             f"--train.decay_fraction={t.decay_fraction} is invalid; it must be in (0, 1] (0.2: decay over the last "
             f"fifth of the steps)")
    _require(t.decay_steps == 0 or 2 <= t.decay_steps <= t.steps - t.warmup_steps,
             f"--train.decay_steps={t.decay_steps} is invalid; it must be 0 (use --train.decay_fraction) or from 2 to "
             f"the {t.steps - t.warmup_steps} steps after warmup (--steps {t.steps}, --train.warmup_steps "
             f"{t.warmup_steps})")
    defaults = TrainSection()
    _require(t.decay_steps == 0 or t.decay_fraction == defaults.decay_fraction,
             f"--train.decay_steps={t.decay_steps} and --train.decay_fraction={t.decay_fraction} both set the decay's "
             f"length; keep one")
    for name in ("decay_fraction", "decay_steps", "wsd_decay"):
        _require(t.lr_schedule == "wsd" or getattr(t, name) == getattr(defaults, name),
                 f"--train.{name}={getattr(t, name)} applies to --train.lr_schedule wsd only (this run's is "
                 f"{t.lr_schedule!r}); add --train.lr_schedule wsd or leave it out")


def validate_export_dir(export: str, run_dir: str) -> None:
    """--export-hf must not be a run directory (this run's or another's): the HF config.json would replace the
    run's, and its tokenizer.json change what the run's readers load."""
    if os.path.realpath(export) == os.path.realpath(run_dir):
        raise UserError(f"--export-hf {export} is this run's --run-dir; the HuggingFace folder would replace the "
                        f"run's config.json; export to another folder, e.g. {os.path.join(run_dir, 'hf')}")
    runlock.refuse_run_directory(export, "--export-hf")


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
            built = Transformer(m)
    except ValueError as exc:
        msg = str(exc)
        named = msg.startswith(f"router {m.router!r}")  # build_router's messages name the router already
        raise UserError(f"model config ({cfg.preset}{'' if named else f', router {m.router!r}'}): {msg}") from None
    if m.num_experts:
        check_expert_backend(cfg)
        check_kernel_environment()
    validate_freezing(cfg, built)


def validate_freezing(cfg: TrainConfig, model) -> None:
    """--train.trainable / freeze / train_experts against the model's parameter names (moekit.train.freezing)."""
    t = cfg.train
    _require(not t.train_experts or os.path.isfile(t.train_experts),
             f"--train.train_experts {t.train_experts}: no such file (write one with moekit-eval MODEL --data TASK "
             f"--split all --select-experts FILE)")
    _require(not t.train_experts or cfg.model.num_experts > 0,
             f"--train.train_experts {t.train_experts}: the model has no routed experts to choose from")
    from moekit.train import freezing

    freezing.plan(model, cfg)  # UserError on a pattern naming nothing, nothing left to train, a bad selection
    freezing.check_lr_scales(model, cfg)  # --train.lr_scale: each pattern names something, each scaled lr is valid


def check_kernel_environment() -> None:
    """The Triton kernels' environment variables, checked before the run instead of at its first expert GEMM
    (nothing to check where triton is not installed: the kernels never run), MOEKIT_SPLIT_ROUTER, MOEKIT_LM_LOSS,
    MOEKIT_DELTA_SCAN and MOEKIT_FUSED_PERMUTE."""
    from moekit.models.delta_rule import delta_scan_problem
    from moekit.models.loss import lm_loss_problem
    from moekit.moe.experts import fused_permute_problem
    from moekit.moe.precision import split_router_problem

    for problem in (split_router_problem(), lm_loss_problem(), delta_scan_problem(), fused_permute_problem()):
        if problem:
            raise UserError(problem)
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


def residual_dtype(t: TrainSection, kind: str, autocast: torch.dtype | None) -> torch.dtype | None:
    """The residual stream's dtype that ``train.residual_dtype`` asks for on a ``kind`` device computing under
    ``autocast`` (run_device), for models.transformer.embed_tokens; None = the parameters' own (fp32, or FSDP's
    bf16 compute copies). auto: bf16 autocast's dtype on CUDA (what FSDP's bf16 parameters give every multi-GPU
    layout, so one GPU computes as they do), the parameters' on CPU."""
    import torch

    if t.residual_dtype == "float32":
        return torch.float32
    if t.residual_dtype == "bfloat16" or (t.residual_dtype == "auto" and kind == "cuda"):
        return autocast
    return None


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
