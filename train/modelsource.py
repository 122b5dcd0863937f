"""The model a run starts from when it names one: ``--init-from-hf DIR`` and ``--init-from-dense PATH``.

Without ``--preset`` (or ``preset =`` in a config file) the architecture comes from that source, the way
``from_pretrained`` takes it from config.json, so nobody retypes a checkpoint's sizes as flags:

    --init-from-hf DIR       the HuggingFace folder's ModelConfig (models.hf.config_from_hf)
    --init-from-dense PATH   models.upcycle.upcycled_config of the dense model's config: its attention,
                             embeddings and norms, experts of width ffn_hidden_size / --upcycle-granularity;
                             num_experts and top_k from --model.num_experts / --model.top_k (default 8 and 2,
                             both times the granularity), aux_loss_coeff the MoE default 0.01

Every ``model.*`` setting a flag or config file gave is then applied on top: training-only fields
(capacity_factor, aux_loss_coeff, expert_backend, ...) freely; a field that changes the math is refused when
the weights are loaded (models.hf.load_hf_into / train.upcycle), naming it. ``model.vocab_size`` counts as
given, so data whose tokenizer has a larger vocabulary is refused rather than silently growing the model.
With ``--preset``, today's rule holds: the preset (plus flags) must match the source.
"""
from __future__ import annotations

import dataclasses
import json

from moekit.models.config import ModelConfig
from moekit.train import UserError

DEFAULT_EXPERTS, DEFAULT_TOP_K = 8, 2


def adopt_source_model(cfg) -> str | None:
    """Replace ``cfg.model`` (a train.config.TrainConfig) by its source's architecture plus the given model
    settings, when the run names a source and no preset; returns a note for the log, or None."""
    t = cfg.train
    if "preset" in cfg.given or not (t.init_from_hf or t.init_from_dense or t.init_from):
        return None
    if t.init_from:
        where = f"--train.init_from {t.init_from}"
        base = _checkpoint_model(t.init_from, where)
    elif t.init_from_hf:
        from moekit.models.hf import config_from_hf  # safetensors: only when asked for

        where = f"--init-from-hf {t.init_from_hf}"
        try:
            base = config_from_hf(t.init_from_hf)
        except (ValueError, OSError) as exc:
            raise UserError(f"{where}: {exc}") from None
    else:
        where = f"--init-from-dense {t.init_from_dense}"
        base = _upcycled_base(cfg, where)
    cfg.model = _with_given(base, cfg.model, cfg.given)
    cfg.given.add("model.vocab_size")
    return f"model architecture from {where} ({base.name})"


def _checkpoint_model(source: str, where: str) -> ModelConfig:
    """The model config a moekit checkpoint records (meta.json "model"; a run directory: its newest checkpoint's,
    read without hashing: the trainer verifies the one it loads)."""
    from pathlib import Path

    from moekit.train.checkpoint import META, init_kind, list_checkpoints

    path = Path(source)
    kind = init_kind(path)
    if kind == "file":  # a moekit model file: its ModelConfig is in the file
        from moekit.train.modelfiles import read_moekit_config

        try:
            return read_moekit_config(path)
        except (ValueError, OSError) as exc:
            raise UserError(f"{where}: {exc}") from None
    if kind == "run":
        steps = list_checkpoints(path)
        if not steps:
            raise UserError(f"{where}: the run has no checkpoint (checkpoints/step_N) to start from")
        path = steps[-1]
    try:
        meta = json.loads((path / META).read_text(encoding="utf-8"))
        return ModelConfig.from_dict(meta["model"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UserError(f"{where}: no model config in {path / META} ({type(exc).__name__}: {exc}); pass a moekit "
                        f"checkpoint or run directory (a HuggingFace folder: --init-from-hf)") from None


def _upcycled_base(cfg, where: str) -> ModelConfig:
    from moekit.models.upcycle import upcycled_config
    from moekit.train.upcycle import dense_config

    t, m, given = cfg.train, cfg.model, cfg.given
    try:
        dense = dense_config(t.init_from_dense)  # train.upcycle: the same sources, told apart alike
    except (ValueError, OSError, json.JSONDecodeError) as exc:
        raise UserError(f"{where}: {exc}") from None
    if dense.num_experts:
        raise UserError(f"{where}: not a dense model (num_experts={dense.num_experts}); upcycling starts from a "
                        f"dense model. To continue an MoE checkpoint use --init-from-hf or --resume")
    g = t.upcycle_granularity
    experts = m.num_experts if "model.num_experts" in given else DEFAULT_EXPERTS * g
    top_k = m.top_k if "model.top_k" in given else DEFAULT_TOP_K * g
    try:
        # a dense source has no balance loss to inherit: the MoE default, unless given (applied afterwards)
        return upcycled_config(dense, experts, top_k, g, aux_loss_coeff=ModelConfig.aux_loss_coeff)
    except ValueError as exc:
        raise UserError(f"{where} with --upcycle-granularity {g}: {exc}") from None


def _with_given(base: ModelConfig, current: ModelConfig, given: set[str]) -> ModelConfig:
    """``base`` with every ``model.*`` value the user gave (already applied to ``current``) copied over."""
    out = ModelConfig.from_dict(base.to_dict())
    keys = [k.split(".", 2)[1:] for k in given if k.startswith("model.")]
    if ["router"] in keys:  # a new router family drops the source's options, as set_value does
        out.set_router(current.router)
    for key in keys:
        if len(key) == 1 and key[0] != "router":
            setattr(out, key[0], getattr(current, key[0]))
        elif len(key) == 2:  # model.router_options.X
            out.router_options[key[1]] = current.router_options[key[1]]
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    assert all(k[0] in names for k in keys), keys
    return out
