"""Reading the dense model to upcycle (moekit-train --init-from-dense; the math is moekit.models.upcycle).

    load_dense(path)                                a dense Transformer from any source below (float32, CPU)
    read_dense(config, path, granularity, n)        load_dense, checked against the MoE config and this machine's
                                                    memory (n ranks per node); UserError on bad input
    init_from_dense(model, dense, path, g, seed)    upcycle into the trainer's (parallelised) model

Sources, told apart by what the path holds:
    DIR/meta.json                 a moekit-train checkpoint (run/checkpoints/step_N)
    DIR/checkpoints/              a moekit-train run directory: its newest checkpoint that verifies
    DIR/config.json               a HuggingFace folder (models.hf.load_hf: Llama, Qwen2, Qwen3 dense, ...)
    MODEL.safetensors, MODEL.pt   a moekit model file (moekit-convert, train.modelfiles.save_moekit)

This lives in the application layer because the moekit file formats do (train/modelfiles.py).
"""
from __future__ import annotations

import warnings
from pathlib import Path

import torch

from moekit.models.transformer import Transformer
from moekit.train import UserError

SOURCES = ("a HuggingFace dense folder (config.json + safetensors), a moekit model file (*.safetensors / *.pt), a "
           "moekit-train checkpoint directory (checkpoints/step_N) or run directory")


def held_dtype(path: str | Path) -> torch.dtype:
    """The dtype ``load_dense(path, keep_dtype=True)`` holds the dense model in: an HF folder's own half precision
    (config.json's dtype, bf16 or fp16), else float32."""
    from moekit.models.hf.io import DTYPE_NAMES as HF_DTYPES, read_config

    path = Path(path)
    if path.is_dir() and (path / "config.json").is_file():
        try:
            hf = read_config(path)
        except ValueError:
            return torch.float32  # load_dense says what is wrong with it
        return HF_DTYPES.get(hf.get("dtype", hf.get("torch_dtype")), torch.float32)
    return torch.float32


def load_dense(path: str | Path, keep_dtype: bool = False) -> Transformer:
    """The dense model at ``path`` (module docstring), float32 on the CPU, eval mode; ``keep_dtype``: an HF folder
    in its own half precision (``held_dtype``: half the memory; upcycling's values are the same, models.upcycle
    upcasts before it computes). ValueError when the path is none of the sources, or holds an MoE model
    (num_experts > 0)."""
    from moekit.train import checkpoint
    from moekit.train.modelfiles import load_moekit

    path = Path(path)
    if not path.exists():
        raise ValueError(f"{path}: no such file or directory; expected {SOURCES}")
    if path.is_dir() and (path / "meta.json").is_file():
        model = load_moekit(path)
    elif path.is_dir() and (path / "checkpoints").is_dir():
        newest, _, skipped = checkpoint.newest_verified(path)
        if newest is None:
            why = f" ({'; '.join(skipped)})" if skipped else ""
            raise ValueError(f"{path}: a run directory without a checkpoint that verifies{why}; pass a checkpoint or "
                             f"model file instead")
        model = load_moekit(newest)
    elif path.is_dir() and (path / "config.json").is_file():
        from moekit.models.hf import config_from_hf, load_hf  # needs safetensors: imported only when asked for

        config = config_from_hf(path)  # config.json alone: refuse an MoE folder before reading its weights
        if config.num_experts:
            raise ValueError(_not_dense(path, config.num_experts))
        model = load_hf(path, dtype=held_dtype(path) if keep_dtype else torch.float32)
    elif path.is_dir():
        raise ValueError(f"{path}: a directory with no config.json, meta.json or checkpoints/; expected {SOURCES}")
    elif path.suffix in (".safetensors", ".pt"):
        model = load_moekit(path)
    else:
        raise ValueError(f"{path}: unknown file type {path.suffix!r}; expected {SOURCES}")
    if model.config.num_experts:
        raise ValueError(_not_dense(path, model.config.num_experts))
    return model


def _not_dense(path: Path, num_experts: int) -> str:
    return (f"{path}: not a dense model (num_experts={num_experts}); upcycling starts from a dense model (num_experts "
            f"= 0). To continue training an MoE checkpoint use --init-from-hf (HuggingFace) or --resume")


DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def dense_param_count(config, granularity: int) -> int:
    """Parameters of the dense model an MoE model of ``config`` upcycles from: the same model with dense FFNs of
    moe_ffn_hidden_size x granularity units (what models.upcycle.dense_mismatches requires of it)."""
    import dataclasses

    from moekit.models.transformer import meta_device

    dense = dataclasses.replace(config, num_experts=0, shared_ffn_hidden_size=0,
                                ffn_hidden_size=config.moe_ffn_hidden_size * granularity)
    with meta_device():
        return sum(p.numel() for p in Transformer(dense.validate()).parameters())


def read_dense(config, path: str, granularity: int, ranks_per_node: int = 1) -> Transformer:
    """The dense model at ``path`` to upcycle into an MoE model of ``config`` (whole, on the CPU, in
    ``held_dtype``), checked against it before anything is built; bad sources and config mismatches are
    UserErrors naming the flags that fix them. ``ranks_per_node``: the processes on this machine that each hold
    a copy; more than its memory is refused before reading."""
    from moekit.models.upcycle import check_upcycle_config, dense_mismatches
    from moekit.train.plan import device_memory

    where = f"--init-from-dense {path}"
    try:
        check_upcycle_config(config, granularity)  # its warnings come with the upcycle itself
        held = held_dtype(path)
        each = held.itemsize * dense_param_count(config, granularity)
    except ValueError as exc:
        raise UserError(f"{where}: {exc}") from None
    have = device_memory(torch.device("cpu"))
    if each * ranks_per_node > have:
        gib = 2**30
        raise UserError(f"{where}: every rank holds the dense model whole in host memory ({DTYPE_NAMES[held]}) while "
                        f"it upcycles, {each / gib:,.1f} GiB, and the {ranks_per_node} ranks of a node need "
                        f"{each * ranks_per_node / gib:,.1f} GiB of this machine's {have / gib:,.1f} GiB; start fewer "
                        f"ranks per node (torchrun --nproc-per-node), or upcycle a smaller dense model")
    try:
        dense = load_dense(path, keep_dtype=True)
        diffs = dense_mismatches(dense.config, config, granularity)
    except (ValueError, OSError) as exc:
        raise UserError(f"{where}: {exc}") from None
    if diffs:
        listed = ", ".join(f"model.{k}={_flag_value(have)} (" + (f"dense ffn_hidden_size / granularity {granularity}"
                                                                  if k == "moe_ffn_hidden_size" else "dense model")
                           + f": {_flag_value(want)})" for k, want, have in diffs)
        fix = " ".join(f"--model.{k} {_flag_value(want)}" for k, want, _ in diffs)
        raise UserError(f"{where}: the MoE model must keep the dense model's attention, embedding and FFN sizes; it "
                        f"differs in {listed}; use {fix}"
                        + (" (or another --upcycle-granularity)" if any(k == "moe_ffn_hidden_size" for k, *_ in diffs)
                           else ""))
    return dense


def init_from_dense(model, dense: Transformer, path: str, granularity: int, seed: int) -> list[str]:
    """Upcycle ``dense`` (``read_dense``; from ``path``) into the trainer's ``model``, a whole or parallelised one
    (moekit.models.upcycle.upcycle_into: each rank fills what it holds); return the warnings to print."""
    from moekit.models.upcycle import upcycle_into

    where = f"--init-from-dense {path}"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            upcycle_into(model, dense, granularity, seed)
        except ValueError as exc:
            raise UserError(f"{where}: {exc}") from None
    return [f"{where}: warning: {w.message}" for w in caught]


def _flag_value(value) -> str:
    """A value as a --model.KEY flag takes it (tables as JSON, None as none, booleans as true / false)."""
    import json

    if value is None:
        return "none"
    if isinstance(value, (bool, dict, list)):
        text = json.dumps(value)
        return f"'{text}'" if isinstance(value, (dict, list)) else text
    return str(value)
