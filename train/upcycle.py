"""Opening the dense model to upcycle (moekit-train --init-from-dense; the math is moekit.models.upcycle).

    open_dense(path)                                the dense model at ``path`` as a source read box by box
    dense_config(path)                              its ModelConfig alone (resolve_dense: which source it is)
    read_dense(config, path, granularity)           open_dense, checked against the MoE config; UserError on bad
                                                    input
    init_from_dense(model, dense, path, g, seed)    upcycle into the trainer's (parallelised) model: each rank
                                                    reads only the parts of the dense model its shards are made of
    dense_read_peak(config, granularity)            the host memory a rank holds at most while it upcycles

Sources, told apart by what the path holds:
    DIR/meta.json                 a moekit-train checkpoint (run/checkpoints/step_N)
    DIR/checkpoints/              a moekit-train run directory: its newest checkpoint that verifies
    DIR/config.json               a HuggingFace folder (Llama, Qwen2, Qwen3 dense, ...; models.hf.sharded.FolderSlices)
    MODEL.safetensors, MODEL.pt   a moekit model file (moekit-convert, train.modelfiles.save_moekit)

No rank reads or holds the dense model whole: a safetensors file (HF or moekit) is read by slices, a .pt file
through a memory map, a checkpoint one tensor at a time (train.modelfiles.ModelSlices). This lives in the
application layer because the moekit file formats do (train/modelfiles.py).
"""
from __future__ import annotations

import warnings
from pathlib import Path

from moekit.train import UserError

SOURCES = ("a HuggingFace dense folder (config.json + safetensors), a moekit model file (*.safetensors / *.pt), a "
           "moekit-train checkpoint directory (checkpoints/step_N) or run directory")


def resolve_dense(path: str | Path) -> tuple[str, Path]:
    """("hf" or "moekit", the path to read) of a dense source (module docstring): a run directory resolves to its
    newest checkpoint that verifies, whose meta.json tells it from an HF folder although both hold a config.json.
    ValueError naming the sources when the path is none of them."""
    from moekit.train import checkpoint

    path = Path(path)
    if not path.exists():
        raise ValueError(f"{path}: no such file or directory; expected {SOURCES}")
    if path.is_dir() and (path / "meta.json").is_file():
        return "moekit", path
    if path.is_dir() and (path / "checkpoints").is_dir():
        newest, _, skipped = checkpoint.newest_verified(path)
        if newest is None:
            why = f" ({'; '.join(skipped)})" if skipped else ""
            raise ValueError(f"{path}: a run directory without a checkpoint that verifies{why}; pass a checkpoint or "
                             f"model file instead")
        return "moekit", newest
    if path.is_dir() and (path / "config.json").is_file():
        return "hf", path
    if path.is_dir():
        raise ValueError(f"{path}: a directory with no config.json, meta.json or checkpoints/; expected {SOURCES}")
    if path.suffix in (".safetensors", ".pt"):
        return "moekit", path
    raise ValueError(f"{path}: unknown file type {path.suffix!r}; expected {SOURCES}")


def dense_config(path: str | Path):
    """The ModelConfig of a dense source (``resolve_dense``), from its config alone (no tensor is read)."""
    kind, where = resolve_dense(path)
    if kind == "hf":
        from moekit.models.hf import config_from_hf  # needs safetensors: imported only when asked for

        return config_from_hf(where)
    from moekit.train.modelfiles import read_moekit_config

    return read_moekit_config(where)


def open_dense(path: str | Path):
    """The dense model at ``path`` (module docstring) as an upcycling source (``config``, ``shapes``,
    ``read(name, box)``; models.upcycle.ModuleSource's interface): config and file headers are read and checked,
    no tensor data. ValueError when the path is none of the sources, is unreadable, or holds an MoE model
    (num_experts > 0)."""
    kind, where = resolve_dense(path)
    if kind == "hf":
        from moekit.models.hf import config_from_hf
        from moekit.models.hf.sharded import FolderSlices

        config = config_from_hf(where)  # config.json alone: refuse an MoE folder before opening its weights
        if config.num_experts:
            raise ValueError(_not_dense(Path(path), config.num_experts))
        source = FolderSlices(where)
    else:
        from moekit.train.modelfiles import ModelSlices

        source = ModelSlices(where)
    if source.config.num_experts:
        raise ValueError(_not_dense(Path(path), source.config.num_experts))
    return source


def _not_dense(path: Path, num_experts: int) -> str:
    return (f"{path}: not a dense model (num_experts={num_experts}); upcycling starts from a dense model (num_experts "
            f"= 0). To continue training an MoE checkpoint use --init-from-hf (HuggingFace) or --resume")


def dense_read_peak(config, granularity: int) -> int:
    """Bytes of host memory a rank holds at most at once while it upcycles (``init_from_dense``), an upper bound:
    one dense MLP's tensors in float32 (the shards its experts copy, or a checkpoint's tensors, read one at a
    time and the last three kept), or the embedding / output layer in float32 (a checkpoint's, read whole)."""
    from moekit.moe.activations import get_activation

    H, F = config.hidden_size, config.moe_ffn_hidden_size * granularity
    mlp = (3 if get_activation(config.activation).gated else 2) * F * H
    return 4 * max(mlp, config.vocab_size * H)


def read_dense(config, path: str, granularity: int):
    """The dense model at ``path`` to upcycle into an MoE model of ``config`` (``open_dense``: a source, nothing read
    but config and headers), checked against it before anything is built; bad sources and config mismatches are
    UserErrors naming the flags that fix them."""
    from moekit.models.upcycle import check_upcycle_config, dense_mismatches

    where = f"--init-from-dense {path}"
    try:
        check_upcycle_config(config, granularity)  # its warnings come with the upcycle itself
        dense = open_dense(path)
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


def init_from_dense(model, dense, path: str, granularity: int, seed: int, drop: float = 0.0) -> list[str]:
    """Upcycle ``dense`` (``read_dense``; from ``path``) into the trainer's ``model``, a whole or parallelised one
    (moekit.models.upcycle.upcycle_into: each rank reads the slices its shards need and fills what it holds;
    ``drop``: drop-upcycling's share of each expert's units re-initialised);
    return the warnings to print. Call on every rank: a failure on any (a damaged file read by some ranks only)
    is the same UserError on all, none left waiting in a collective."""
    from moekit.models.hf.sharded import _agree
    from moekit.models.upcycle import upcycle_into

    where = f"--init-from-dense {path}"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            _agree(upcycle_into, model, dense, granularity, seed, drop)
        except (ValueError, OSError) as exc:
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
