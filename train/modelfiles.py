"""moekit model files and the conversions behind moekit-convert (moekit.train.convert, the program; its
docstring describes the formats): ``save_moekit``, ``load_moekit``, ``read_moekit_config``, ``verify``, and
the two commands, ``hf_to_moekit`` and ``moekit_to_hf``.
"""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from moekit.models.config import ModelConfig
from moekit.models.hf import load_hf, save_hf
from moekit.models.transformer import Transformer, meta_device
from moekit.train.convert import DTYPE_NAMES

PT_FORMAT = "moekit-model"
CONFIG_KEY = "moekit_config"
DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}
DCP_META = "meta.json"  # written by train/checkpoint.py next to the DCP files


# ---------------------------------------------------------------------------------------------------
# moekit model files
# ---------------------------------------------------------------------------------------------------


def save_moekit(model: Transformer, path: str | Path) -> Path:
    """Write ``model`` with its config as OUT.safetensors or OUT.pt (by suffix)."""
    path = Path(path)
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    config = model.config.to_dict()
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".safetensors":
        save_file(state, str(path), metadata={"format": "pt", CONFIG_KEY: json.dumps(config)})
    elif path.suffix == ".pt":
        torch.save({"format": PT_FORMAT, "config": config, "model": state}, path)
    else:
        raise ValueError(f"{path}: unknown moekit format {path.suffix!r}; name the output *.safetensors or *.pt")
    return path


def read_moekit_config(path: str | Path) -> ModelConfig:
    """The ModelConfig of a moekit model file or checkpoint directory (``load_moekit``'s sources), without
    building the model (a .pt file is read whole: its config is inside the pickle)."""
    path = Path(path)
    if path.is_dir():
        return _dcp_source(path)[0]
    if path.suffix == ".safetensors":
        return _safetensors_source(path)[0]
    if path.suffix == ".pt":
        return _pt_source(path)[0]
    raise ValueError(f"{path}: not a moekit model (expected *.safetensors, *.pt or a checkpoints/step_N directory)")


def load_moekit(path: str | Path, device: str = "cpu") -> Transformer:
    """A moekit model from MODEL.safetensors, MODEL.pt or a train.py checkpoint directory (eval mode)."""
    path = Path(path)
    if path.is_dir():
        config, load = _dcp_source(path)
    elif path.suffix == ".safetensors":
        config, load = _safetensors_source(path)
    elif path.suffix == ".pt":
        config, load = _pt_source(path)
    else:
        raise ValueError(f"{path}: not a moekit model (expected *.safetensors, *.pt or a checkpoints/step_N "
                         f"directory)")
    with meta_device():
        model = Transformer(config)
    model.to_empty(device=device)
    load(model)
    with torch.no_grad():  # non-persistent buffers (pending router load) are not in any file
        for name, buf in model.named_buffers():
            if name not in model.state_dict():
                buf.zero_()
    return model.eval()


def _config(raw, where: str) -> ModelConfig:
    try:
        return ModelConfig.from_dict(json.loads(raw) if isinstance(raw, str) else raw).validate()
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{where}: the stored model config is invalid ({exc})") from None


def _load_strict(model: Transformer, state: dict, where: str) -> None:
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{where}: state_dict does not match its config: missing {missing[:5]}, unexpected "
                         f"{unexpected[:5]}; the file was written for a different model")


def _safetensors_source(path: Path):
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
    except (SafetensorError, OSError) as exc:
        raise ValueError(f"{path}: unreadable safetensors file ({exc}); it is truncated or not safetensors") from None
    if CONFIG_KEY not in meta:
        raise ValueError(f"{path}: no {CONFIG_KEY!r} in its metadata, so it is not a moekit model file; for a "
                         f"HuggingFace folder use 'hf-to-moekit'")

    def load(model):
        from safetensors.torch import load_file
        _load_strict(model, load_file(str(path)), str(path))

    return _config(meta[CONFIG_KEY], str(path)), load


def _pt_source(path: Path):
    blob = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(blob, dict) or blob.get("format") != PT_FORMAT:
        raise ValueError(f"{path}: not a moekit model file (format {PT_FORMAT!r}); write one with "
                         f"'moekit-convert hf-to-moekit ... OUT.pt'")
    return _config(blob["config"], str(path)), lambda model: _load_strict(model, blob["model"], str(path))


def _dcp_source(path: Path):
    """Model weights of a tools/train.py checkpoint; optimizer and data state are not read."""
    import torch.distributed.checkpoint as dcp

    try:
        meta = json.loads((path / DCP_META).read_text())
    except (FileNotFoundError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: no readable {DCP_META} ({type(exc).__name__}); pass a "
                         f"<run_dir>/checkpoints/step_N directory written by moekit-train") from None

    def load(model):
        state = {"model": model.state_dict()}
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.load(state, checkpoint_id=str(path))
        except Exception as exc:  # DCP wraps every reader failure; any of them means an unusable checkpoint
            raise ValueError(f"{path}: DCP could not read the model ({type(exc).__name__}); the checkpoint is "
                             f"incomplete or for a different model") from None

    return _config(meta.get("model"), str(path / DCP_META)), load


# ---------------------------------------------------------------------------------------------------
# Commands
# ---------------------------------------------------------------------------------------------------


@torch.no_grad()
def verify(a: Transformer, b: Transformer, what: str) -> None:
    """Same logits on random tokens: both sides hold the same values in the same dtype, so equal up to rounding."""
    cfg = a.config
    tokens = torch.randint(0, cfg.vocab_size, (2, min(16, cfg.max_seq_len)), generator=torch.Generator().manual_seed(0))
    la, lb = a(tokens), b(tokens)
    err = ((la - lb).norm() / lb.norm().clamp_min(1e-30)).item()
    if err > 1e-6:
        raise ValueError(f"verification failed: {what} changes the logits (relative error {err:.2e})")
    print(f"verified: {what} keeps the logits (relative error {err:.1e})")


def hf_to_moekit(args) -> None:
    model = load_hf(args.src, dtype=args.dtype if args.dtype == "auto" else DTYPES[args.dtype])
    out = save_moekit(model, args.out)
    print(f"wrote {out}: {model.hf_family}, {model.config.num_layers} layers, {model.config.num_experts} experts, "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters (for the tokenizer, pass "
          f"--tokenizer {args.src} to moekit-to-hf)")
    if args.verify:
        verify(load_moekit(out), model, f"{args.src} -> {out}")


def run_tokenizer(src: Path) -> Path | None:
    """The run directory of a checkpoint SRC (<run_dir>/checkpoints/step_N) when it recorded a tokenizer."""
    run = src.parent.parent
    if src.is_dir() and src.parent.name == "checkpoints" and (run / "tokenizer_info.json").is_file():
        return run
    return None


def moekit_to_hf(args) -> None:
    src = Path(args.src)
    model = load_moekit(src)
    dtype = None if args.dtype == "auto" else DTYPES[args.dtype]
    tokenizer = Path(args.tokenizer) if args.tokenizer else run_tokenizer(src)
    out = save_hf(model, args.out, family=args.family, dtype=dtype, max_shard_size=args.max_shard_size,
                  layout=args.layout, tokenizer_from=tokenizer)
    family = json.loads((out / "config.json").read_text())["model_type"]
    told = f", tokenizer from {tokenizer}" if tokenizer else ", no tokenizer (pass --tokenizer DIR to add one)"
    print(f"wrote {out} ({family}, {args.layout} experts{told})")
    if args.verify:
        verify(load_hf(out, dtype="auto"), model.to(dtype) if dtype else model, f"{args.src} -> {out}")
