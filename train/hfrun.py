"""HuggingFace folders in a training run: ``moekit-train --init-from-hf`` and ``--export-hf``.

    load_init(model, path, seed)                     fill the parallelised model from the folder, each rank its
                                                     slices (models.hf.load_hf_sharded)
    check_export(model, cfg, data)                   before training: a family reproduces the model, and a
                                                     tokenizer goes with it; returns where that tokenizer is
    export(model, cfg, tokenizer, last_ckpt, prog)   after training: every rank writes the tensors it owns
                                                     (models.hf.save_hf_sharded); returns the folder
    exported(folder, fp8)                            the console line saying what was written

Every failure is a UserError (before training) or a RunFailed naming the final checkpoint to export from
(after it), one line each.
"""
from __future__ import annotations

import json
from pathlib import Path

from moekit.train import UserError, runlock
from moekit.train.config import TrainConfig
from moekit.train.faults import RunFailed


def load_init(model, path: str, seed: int) -> None:
    """Fill the parallelised ``model`` from a HuggingFace folder, each rank reading only its slices (all ranks
    fail alike); what the folder lacks (MTP depths) starts from ``seed`` (models.init)."""
    from moekit.models.hf import load_hf_sharded  # safetensors: imported only when asked for

    try:
        load_hf_sharded(model, path, init_seed=seed)
    except (ValueError, OSError) as exc:  # config mismatch, missing or misshapen tensors: the message names them
        hint = ("; or leave out --preset (and the preset in --config) to take the checkpoint's architecture"
                if "different math" in str(exc) else "")
        raise UserError(f"--init-from-hf {path}: {exc}{hint}") from None


def check_export(model, cfg: TrainConfig, data) -> Path:
    """Before training: a family reproduces ``model``, and there is a tokenizer to export with it (returned)."""
    from moekit.models.hf import check_hf_exportable

    try:
        check_hf_exportable(model)
    except ValueError as exc:
        raise UserError(f"--export-hf: {exc}") from None
    return tokenizer_source(cfg, data)


def tokenizer_source(cfg: TrainConfig, data) -> Path:
    """The run directory when the data recorded their tokenizer (moekit-prepare, bytes); else the
    --init-from-hf folder's tokenizer, which raw token ids of that model were made with."""
    from moekit.models.hf.export import check_tokenizer_source

    if data.tokenizer.kind in ("hf", "bytes"):
        return Path(cfg.run_dir)
    source = cfg.train.init_from_hf
    if source:
        try:
            check_tokenizer_source(source)
            return Path(source)
        except ValueError:
            pass
    raise UserError(f"--export-hf {cfg.train.export_hf}: the data ({data.desc}) carry no tokenizer "
                    f"metadata{' and the --init-from-hf folder has no tokenizer' if source else ''}, so the export "
                    f"would have none; make the data with moekit-prepare (it records the tokenizer), or drop "
                    f"--export-hf and export afterwards with "
                    f"moekit-convert moekit-to-hf RUN_DIR OUT --tokenizer DIR")


def export(model, cfg: TrainConfig, tokenizer: Path, last_checkpoint, prog: str) -> Path:
    """Write the trained ``model`` to --export-hf as a HuggingFace folder (models.hf.save_hf_sharded: every rank
    writes the tensors it owns, nothing is gathered on one rank; placed experts from their slots, each expert
    once), with ``tokenizer`` (check_export's). Collective; returns the folder."""
    from moekit.models.hf import save_hf_sharded

    path, fp8, mxfp4 = cfg.train.export_hf, cfg.train.export_hf_fp8, cfg.train.export_hf_mxfp4
    try:
        return save_hf_sharded(model, path, tokenizer_from=tokenizer, fp8=fp8, mxfp4=mxfp4)
    except (OSError, ValueError) as exc:  # the trained weights are safe in the final checkpoint: say where
        why = runlock.describe_os_error(exc) if isinstance(exc, OSError) else str(exc)
        flag = " --train.export_hf_fp8 true" if fp8 else " --train.export_hf_mxfp4 true" if mxfp4 else ""
        if cfg.train.export_hf_ema:  # the average comes back with the checkpoint's optimizer state
            flag += f" --train.ema_decay {cfg.train.ema_decay:g} --train.export_hf_ema true"
        raise RunFailed(f"--export-hf {path}: {why}; training finished and its final checkpoint is {last_checkpoint}: "
                        f"fix that, then export it with {prog} --resume {last_checkpoint} --steps {cfg.train.steps} "
                        f"--export-hf {path}{flag}") from None


def exported(folder: Path, fp8: bool, mxfp4: bool = False) -> str:
    family = json.loads((folder / "config.json").read_text())["model_type"]  # what was written
    quant = ", fp8 linear weights" if fp8 else ", MXFP4 expert weights" if mxfp4 else ""
    return f"exported {folder} (HuggingFace {family}{quant})"
