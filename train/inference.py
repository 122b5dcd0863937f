"""Load a trained model for inference: ``load_for_inference(path, device, dtype) -> (model, tokenizer, info)``.

What ``path`` may be (the kind is recognised from the folder's contents):

    RUN_DIR     a moekit-train run directory: its newest checkpoint that verifies (sizes and sha256 of
                every file, moekit.train.checkpoint.read_meta); damaged ones are skipped with a warning
    CHECKPOINT  <run_dir>/checkpoints/step_N: that checkpoint (it must verify); its run directory is two
                levels up (config.json, tokenizer)
    HF_DIR      a HuggingFace folder (config.json with model_type, safetensors): moekit.models.hf.load_hf

The model config is the checkpoint's (meta.json "model"); the run's recorded settings (meta.json "run" and
<run_dir>/config.json) must describe the same model. Only the weights are read (no optimizer state).

Inference routing (``inference_routing``): the model is in eval mode, so no router jitter, no expert-bias
updates and no load records. Capacity: a router given a capacity_factor drops the slots beyond
ceil(T * k / E * factor) of the T tokens routed *together*, so in eval a token's output would depend on
which other tokens share its forward (the batch, the prompt, cached or not). Inference therefore routes
dropless wherever the router allows it (every built-in router but expert_choice, whose capacity is its
selection rule); ``dropless=False`` keeps the trained capacity (moekit-eval --capacity trained).

Tokenizer contract, read from one folder (the run directory; the HF folder itself):

    tokenizer.json        present: encode/decode with the ``tokenizers`` library
    tokenizer_info.json   {"kind": "hf" | "bytes", "source", "sha256" (of tokenizer.json), "vocab_size",
                          "eos_id": int | null}: the EOS id, and a check that tokenizer.json is the one
                          the run used
    neither               bytes: vocab 256, encode = UTF-8 bytes, decode = UTF-8 with errors="replace"

A run whose data had no tokenizer metadata records kind "unknown": its ids cannot become text
(``NoTokenizer``; moekit-eval still reports the loss).

An HF folder's EOS comes from generation_config.json, config.json or tokenizer_config.json. Every problem
is a UserError naming the path and the fix (the programs print it as one line, exit status 2).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from moekit.models.config import ModelConfig
from moekit.models.transformer import Transformer
from moekit.moe.load import moe_layers
from moekit.moe.router_variants import ExpertChoiceRouter
from moekit.train import UserError, checkpoint
from moekit.train.runlock import describe_os_error

TOKENIZER_FILE, TOKENIZER_INFO = "tokenizer.json", "tokenizer_info.json"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KINDS = ("run", "checkpoint", "hf")


# ---------------------------------------------------------------------------------------------------
# Tokenizers
# ---------------------------------------------------------------------------------------------------


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255 (what moekit trains on by default); ids from 256 on are special (a
    prepared byte set's EOS is 256, vocab 257) and decode to nothing."""

    kind = "bytes"
    sha256 = None

    def __init__(self, eos_id: int | None = None, vocab_size: int = 256):
        self.vocab_size = vocab_size
        self.eos_ids = () if eos_id is None else (eos_id,)

    @property
    def eos_id(self) -> int | None:
        return self.eos_ids[0] if self.eos_ids else None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def byte_count(self, ids: list[int]) -> int:
        """Bytes of text these tokens stand for (bits per byte): one per byte id."""
        return sum(1 for i in ids if 0 <= i < 256)

    def describe(self) -> str:
        return f"bytes (vocab {self.vocab_size}, EOS {self.eos_id if self.eos_id is not None else 'none'})"


class HFTokenizer:
    """A ``tokenizers`` tokenizer.json. ``add_special_tokens``: whether encode adds BOS and the like (as
    transformers does for an HF folder; a run's token stream is plain text)."""

    kind = "hf"

    def __init__(self, path: Path, add_special_tokens: bool, eos_ids: tuple[int, ...] = ()):
        from tokenizers import Tokenizer  # a moekit dependency; imported only for a tokenizer.json

        try:
            self.tok = Tokenizer.from_file(str(path))
        except Exception as exc:  # the library raises its own exception type for a malformed file
            raise UserError(f"{path}: not a tokenizers file ({' '.join(str(exc).split())[:200]}); restore the "
                            f"tokenizer.json the model was trained with") from None
        self.path, self.add_special_tokens, self.eos_ids = path, add_special_tokens, eos_ids
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        self.sha256 = hashlib.sha256(path.read_bytes()).hexdigest()

    @property
    def eos_id(self) -> int | None:
        return self.eos_ids[0] if self.eos_ids else None

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=self.add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)

    def byte_count(self, ids: list[int]) -> int:
        return len(self.decode(ids).encode("utf-8"))

    def describe(self) -> str:
        eos = ",".join(map(str, self.eos_ids)) or "none"
        return f"{self.path} (vocab {self.vocab_size}, EOS {eos})"


Tokenizer = ByteTokenizer | HFTokenizer


class NoTokenizer(UserError):
    """The run recorded no tokenizer (its data were ids without metadata): ids cannot become text."""


def _read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: corrupt {what} ({type(exc).__name__}: {exc}); restore it") from None
    except OSError as exc:
        raise UserError(f"{path}: unreadable ({describe_os_error(exc)})") from None


def _eos(values: Any, vocab: int, where: Path) -> tuple[int, ...]:
    """EOS ids from an int, a list of them or None, each checked to be a token id of the model."""
    values = [] if values is None else values if isinstance(values, list) else [values]
    for v in values:
        if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < vocab:
            raise UserError(f"{where}: EOS id {v!r} is not a token id of the model (vocab_size {vocab}); fix it")
    return tuple(values)


def _tokenizer_info(folder: Path) -> dict | None:
    path = folder / TOKENIZER_INFO
    info = _read_json(path, "tokenizer info") if path.is_file() else None
    if info is not None and (not isinstance(info, dict) or info.get("kind") not in ("hf", "bytes", "unknown")):
        raise UserError(f"{path}: expected an object with kind \"hf\" or \"bytes\"; restore it")
    if info is not None and info["kind"] == "unknown":
        raise NoTokenizer(f"{path}: the run trained on token ids without tokenizer metadata, so they cannot be "
                          f"turned into text; train on a set made by moekit-prepare (it records the tokenizer)")
    if info is not None and info["kind"] != ("hf" if (folder / TOKENIZER_FILE).is_file() else "bytes"):
        found = "a" if info["kind"] == "bytes" else "no"
        raise UserError(f"{path} says kind {info['kind']!r} but there is {found} {folder / TOKENIZER_FILE}; restore "
                        f"the tokenizer files the run was trained with")
    return info


def load_tokenizer(folder: Path, model_vocab: int, hf: bool = False) -> Tokenizer:
    """The tokenizer of ``folder`` by the contract above. ``hf``: an HF model folder (EOS from its configs,
    BOS added by encode as transformers does)."""
    info = _tokenizer_info(folder)
    eos = _eos(info.get("eos_id"), model_vocab, folder / TOKENIZER_INFO) if info is not None else ()
    tok_file = folder / TOKENIZER_FILE
    if not tok_file.is_file():
        if model_vocab < 256:
            raise UserError(f"{folder}: no {TOKENIZER_FILE}, so the text is byte tokens, but the model's vocab_size "
                            f"is {model_vocab} < 256; add the tokenizer.json the model was trained with")
        vocab = info.get("vocab_size") if info is not None else None
        vocab = vocab if isinstance(vocab, int) and 256 <= vocab <= model_vocab else 256
        return ByteTokenizer(eos[0], max(vocab, eos[0] + 1)) if eos else ByteTokenizer(None, vocab)
    tok = HFTokenizer(tok_file, add_special_tokens=hf, eos_ids=eos)
    if hf:
        tok.eos_ids = _hf_eos_ids(folder, tok, model_vocab)
    if info is not None and isinstance(info.get("sha256"), str) and tok.sha256 != info["sha256"]:
        raise UserError(f"{tok_file}: sha256 {tok.sha256[:12]}... differs from {TOKENIZER_INFO}'s "
                        f"{info['sha256'][:12]}...; this is not the tokenizer the run was trained with: restore that one")
    if tok.vocab_size > model_vocab:
        raise UserError(f"{tok_file}: {tok.vocab_size} token ids but the model's vocab_size is {model_vocab}; "
                        f"this tokenizer does not belong to the model")
    return tok


def _hf_eos_ids(folder: Path, tok: HFTokenizer, vocab: int) -> tuple[int, ...]:
    """An HF folder's EOS: eos_token_id of generation_config.json, else config.json, else the id of
    tokenizer_config.json's eos_token."""
    for name in ("generation_config.json", "config.json"):
        path = folder / name
        value = _read_json(path, name).get("eos_token_id") if path.is_file() else None
        if value is not None:
            return _eos(value, vocab, path)
    path = folder / "tokenizer_config.json"
    eos = _read_json(path, "tokenizer_config.json").get("eos_token") if path.is_file() else None
    text = eos.get("content") if isinstance(eos, dict) else eos
    eos_id = tok.tok.token_to_id(text) if isinstance(text, str) else None
    return () if eos_id is None else _eos(eos_id, vocab, path)


# ---------------------------------------------------------------------------------------------------
# Devices, dtypes, inference routing
# ---------------------------------------------------------------------------------------------------


def resolve_device(name: str) -> torch.device:
    """'auto' (CUDA when torch sees a GPU), 'cpu', 'cuda' or 'cuda:N'."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise UserError(f"--device {name!r} is invalid; use auto, cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise UserError(f"--device {name!r} is not supported; use auto, cpu, cuda or cuda:N")
    if device.type == "cuda" and (not torch.cuda.is_available() or (device.index or 0) >= torch.cuda.device_count()):
        raise UserError(f"--device {name}: torch sees {torch.cuda.device_count()} CUDA device(s); use --device cpu")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """'auto' = bfloat16 on CUDA, float32 on CPU (as moekit-train computes), or a name in DTYPES."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise UserError(f"--dtype {name!r} is invalid; choose auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def cast_parameters(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Parameters to ``dtype``; buffers (a router's expert_bias) stay float32, as routing computes in float32."""
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.to(dtype)


def inference_routing(model: torch.nn.Module, dropless: bool = True) -> list[str]:
    """Eval mode, and dropless routing where the router allows (module docstring); what changed, per router kind."""
    model.eval()
    changed: dict[str, float] = {}
    for _, layer in moe_layers(model):
        router = layer.router
        if dropless and router.capacity_factor is not None and not isinstance(router, ExpertChoiceRouter):
            changed[type(router).__name__] = router.capacity_factor
            router.capacity_factor = None
    return [f"{name}: capacity_factor={factor:g} dropped, routing is dropless" for name, factor in changed.items()]


def cache_inexact(model: torch.nn.Module) -> str | None:
    """Why decoding with a KV cache would not reproduce the full forward, or None: it does when every
    router chooses a token's experts from that token alone."""
    for name, layer in moe_layers(model):
        router = layer.router
        if isinstance(router, ExpertChoiceRouter):
            return f"{name}.router is expert_choice: experts pick among all the tokens of a forward"
        if router.capacity_factor is not None:
            return (f"{name}.router drops slots beyond capacity_factor={router.capacity_factor:g} of the tokens "
                    f"routed together")
    return None


# ---------------------------------------------------------------------------------------------------
# The programs' shared command line (moekit-generate, moekit-eval)
# ---------------------------------------------------------------------------------------------------


class OneLineParser(argparse.ArgumentParser):
    """Flag errors as a UserError (the program prints one line, exit status 2), not a usage block."""

    def error(self, message: str):
        raise UserError(f"{message} (see --help)")


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The model to load and where: PATH, --device, --dtype (``load_for_inference``'s arguments)."""
    p.add_argument("path", metavar="RUN_DIR|CHECKPOINT|HF_DIR",
                   help="a run directory (its newest checkpoint that verifies), RUN_DIR/checkpoints/step_N, or a "
                        "HuggingFace model folder")
    p.add_argument("--device", default="auto", metavar="D", help="auto (CUDA when available), cpu, cuda, cuda:N")
    p.add_argument("--dtype", default="auto", metavar="T",
                   help=f"parameter dtype: auto (bfloat16 on CUDA, float32 on CPU), {', '.join(DTYPES)}")


# ---------------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------------


@dataclass
class InferenceInfo:
    kind: str  # one of KINDS
    path: Path  # as given
    config: ModelConfig
    device: torch.device
    dtype: torch.dtype
    checkpoint: Path | None = None  # the checkpoint read (run / checkpoint)
    step: int | None = None
    run_dir: Path | None = None
    run_config: dict | None = None  # the trainer's settings (TrainConfig.to_dict()), when known
    routing: list[str] = field(default_factory=list)  # what inference_routing changed
    cache_inexact: str | None = None
    no_tokenizer: str | None = None  # why there is no tokenizer (require_tokenizer=False)

    def describe(self) -> str:
        what = (f"HuggingFace folder {self.path}" if self.kind == "hf" else
                f"{self.config.name} from {self.checkpoint} (step {self.step})")
        return f"{what} on {self.device}, {str(self.dtype).removeprefix('torch.')}"


def detect_kind(path: Path) -> str:
    """'run', 'checkpoint' or 'hf' from a folder's contents; UserError for anything else."""
    hint = "pass a run directory, a checkpoint (RUN_DIR/checkpoints/step_N) or a HuggingFace model folder"
    if not path.exists():
        raise UserError(f"{path}: no such file or directory; {hint}")
    if not path.is_dir():
        raise UserError(f"{path}: not a directory; {hint}")
    if (path / checkpoint.META).exists() or any(path.glob("*.distcp")):
        return "checkpoint"
    if checkpoint.checkpoint_root(path).is_dir():
        return "run"
    config = path / "config.json"
    if config.is_file():
        data = _read_json(config, "config.json")
        if isinstance(data, dict) and "model_type" in data:
            return "hf"
        if isinstance(data, dict) and "model" in data:
            raise UserError(f"{path}: a run directory without checkpoints (no {checkpoint.checkpoint_root(path)}); "
                            f"train until a checkpoint is saved (--checkpoint.every, and after the last step)")
    raise UserError(f"{path}: neither a run directory (checkpoints/), a checkpoint (meta.json) nor a HuggingFace "
                    f"folder (config.json with model_type); {hint}")


def newest_verified(run_dir: Path, warn: Callable[[str], None]) -> tuple[Path, dict]:
    """The newest checkpoint of ``run_dir`` whose files verify, and its meta.json; damaged ones are skipped."""
    found = checkpoint.list_checkpoints(run_dir)[::-1]
    if not found:
        raise UserError(f"{run_dir}: no checkpoint in {checkpoint.checkpoint_root(run_dir)}; train until one is "
                        f"saved, or pass a checkpoint directory")
    skipped = []
    for path in found:
        try:
            meta = checkpoint.read_meta(path)
        except UserError as exc:  # an interrupted or damaged save: an older one may still be good
            skipped.append(str(exc))
            continue
        for reason in skipped:
            warn(f"warning: skipped {reason}; using {path}")
        return path, meta
    raise UserError(f"{run_dir}: no checkpoint verifies: {' | '.join(skipped)}; restore one from a backup")


def _run_configs(meta: dict, run_dir: Path) -> list[tuple[str, dict]]:
    """The trainer's settings recorded for a checkpoint, as (where, config): meta.json "run" (that checkpoint's
    run) first, then the run directory's config.json (its latest start)."""
    found = []
    run = meta.get("run")
    if isinstance(run, dict) and isinstance(run.get("config"), dict):
        found.append((f"{checkpoint.META} \"run\"", run["config"]))
    path = run_dir / "config.json"
    data = _read_json(path, "config.json") if path.is_file() else None
    if isinstance(data, dict):
        found.append((str(path), data))
    return found


def _model_config(ckpt: Path, meta: dict, run_configs: list[tuple[str, dict]]) -> ModelConfig:
    saved = meta.get("model")
    if not isinstance(saved, dict):
        raise UserError(f"checkpoint {ckpt / checkpoint.META}: no model config in it; it is not a moekit-train "
                        f"checkpoint")
    for where, config in run_configs:  # a run may not describe another model than its checkpoint holds
        run_model = config.get("model")
        if not isinstance(run_model, dict):
            continue
        diffs = [f"{k}={run_model.get(k)!r} (run) vs {v!r} (checkpoint)" for k, v in saved.items()
                 if k not in checkpoint.RESUMABLE_MODEL_FIELDS and run_model.get(k) != v]
        if diffs:
            raise UserError(f"{ckpt}: the run's settings ({where}) describe a different model than the checkpoint: "
                            f"{'; '.join(diffs[:3])}; restore them or pass another checkpoint")
    try:
        return ModelConfig.from_dict(saved).validate()
    except (ValueError, TypeError) as exc:
        raise UserError(f"checkpoint {ckpt / checkpoint.META}: its model config is invalid ({exc})") from None


def _build(config: ModelConfig, where: str) -> Transformer:
    try:
        with torch.device("meta"):
            model = Transformer(config)
    except ValueError as exc:  # e.g. a module:Class router that no longer imports
        raise UserError(f"{where}: the model cannot be built ({' '.join(str(exc).split())})") from None
    return model.to_empty(device="cpu")


def _load_weights(model: Transformer, ckpt: Path) -> None:
    """The checkpoint's model state only (DCP reads just the keys asked for: no optimizer, no data state)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    state = {"model": get_model_state_dict(model)}
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, checkpoint_id=str(ckpt))
    except Exception as exc:  # DCP wraps every reader failure; any of them means an unusable checkpoint
        reason = str(exc).strip().splitlines()
        raise UserError(f"checkpoint {ckpt}: DCP could not load the model ({type(exc).__name__}: "
                        f"{reason[-1] if reason else ''})") from None
    set_model_state_dict(model, state["model"])
    persistent = set(model.state_dict())
    with torch.no_grad():  # non-persistent buffers (a router's pending load) are in no checkpoint
        for name, buf in model.named_buffers():
            if name not in persistent:
                buf.zero_()


def _load_hf(path: Path) -> Transformer:
    from moekit.models.hf import load_hf  # needs safetensors: imported only for an HF folder

    try:
        return load_hf(path, dtype=torch.float32)
    except ValueError as exc:  # unsupported features, missing or misshapen tensors: the message names them
        raise UserError(f"{path}: {' '.join(str(exc).split())}") from None
    except OSError as exc:
        raise UserError(f"{path}: unreadable ({describe_os_error(exc)})") from None


def load_for_inference(path: str | Path, device: str | torch.device = "cpu", dtype: str | torch.dtype = "auto", *,
                       dropless: bool = True, require_tokenizer: bool = True, warn: Callable[[str], None] = print,
                       ) -> tuple[Transformer, Tokenizer | None, InferenceInfo]:
    """(model in eval mode on ``device``, its tokenizer, what was loaded); module docstring for ``path``.

    dtype: parameter dtype ("auto": bf16 on CUDA, fp32 on CPU); router buffers stay float32, as routing
    computes in float32. dropless: see ``inference_routing``. require_tokenizer=False: a run that recorded
    no tokenizer gives None (``info.no_tokenizer`` says why) instead of an error. warn: gets the skipped
    damaged checkpoints.
    """
    path = Path(path)
    device = resolve_device(device) if isinstance(device, str) else device
    dtype = resolve_dtype(dtype, device) if isinstance(dtype, str) else dtype
    kind = detect_kind(path)
    ckpt = step = run_dir = run_config = no_tokenizer = None
    if kind == "hf":
        model = _load_hf(path)
        tokenizer = load_tokenizer(path, model.config.vocab_size, hf=True)
    else:
        if kind == "run":
            run_dir = path
            ckpt, meta = newest_verified(path, warn)
        else:
            ckpt, run_dir = path, path.parent.parent
            meta = checkpoint.read_meta(path)
        step = meta["step"]
        run_configs = _run_configs(meta, run_dir)
        config = _model_config(ckpt, meta, run_configs)
        run_config = run_configs[0][1] if run_configs else None
        model = _build(config, str(ckpt))
        _load_weights(model, ckpt)
        try:
            tokenizer = load_tokenizer(run_dir, config.vocab_size)
        except NoTokenizer as exc:
            if require_tokenizer:
                raise
            tokenizer, no_tokenizer = None, str(exc)
    cast_parameters(model.to(device), dtype)
    routing = inference_routing(model, dropless)
    info = InferenceInfo(kind, path, model.config, device, dtype, ckpt, step, run_dir, run_config, routing,
                         cache_inexact(model), no_tokenizer)
    return model, tokenizer, info
