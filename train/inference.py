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

The tokenizer comes from the run directory (or the HF folder) as moekit.train.tokenizer describes.

Every problem is a UserError naming the path and the fix (the programs print it as one line, exit status 2).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from moekit.models.config import ModelConfig
from moekit.models.transformer import Transformer, meta_device
from moekit.moe.load import moe_layers
from moekit.moe.router_variants import ExpertChoiceRouter
from moekit.train import UserError, checkpoint
from moekit.train.model_args import DTYPE_NAMES
from moekit.train.runlock import describe_os_error
from moekit.train.tokenizer import NoTokenizer, Tokenizer, load_tokenizer, read_json

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}
KINDS = ("run", "checkpoint", "hf")


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
        data = read_json(config, "config.json")
        if isinstance(data, dict) and "model_type" in data:
            return "hf"
        if isinstance(data, dict) and "model" in data:
            raise UserError(f"{path}: a run directory without checkpoints (no {checkpoint.checkpoint_root(path)}); "
                            f"train until a checkpoint is saved (--checkpoint.every, and after the last step)")
    raise UserError(f"{path}: neither a run directory (checkpoints/), a checkpoint (meta.json) nor a HuggingFace "
                    f"folder (config.json with model_type); {hint}")


def newest_verified(run_dir: Path, warn: Callable[[str], None]) -> tuple[Path, dict]:
    """The newest checkpoint of ``run_dir`` whose files verify, and its meta.json; damaged ones are skipped."""
    if not checkpoint.list_checkpoints(run_dir):
        raise UserError(f"{run_dir}: no checkpoint in {checkpoint.checkpoint_root(run_dir)}; train until one is "
                        f"saved, or pass a checkpoint directory")
    path, meta, skipped = checkpoint.newest_verified(run_dir)
    if path is None:
        raise UserError(f"{run_dir}: no checkpoint verifies: {' | '.join(skipped)}; restore one from a backup")
    for reason in skipped:
        warn(f"warning: skipped {reason}; using {path}")
    return path, meta


def _run_configs(meta: dict, run_dir: Path) -> list[tuple[str, dict]]:
    """The trainer's settings recorded for a checkpoint, as (where, config): meta.json "run" (that checkpoint's
    run) first, then the run directory's config.json (its latest start)."""
    found = []
    run = meta.get("run")
    if isinstance(run, dict) and isinstance(run.get("config"), dict):
        found.append((f"{checkpoint.META} \"run\"", run["config"]))
    path = run_dir / "config.json"
    data = read_json(path, "config.json") if path.is_file() else None
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
        with meta_device():
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


def _load_hf(path: Path, dtype: torch.dtype) -> Transformer:
    from moekit.models.hf import load_hf  # needs safetensors: imported only for an HF folder

    try:  # the parameters allocated in ``dtype`` (no fp32 copy of a bf16 model), buffers float32
        return load_hf(path, dtype=dtype, buffers_fp32=True)
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
        model = _load_hf(path, dtype)
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
