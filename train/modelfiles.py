"""moekit model files and the conversions behind moekit-convert (moekit.train.convert, the program; its
docstring describes the formats): ``save_moekit``, ``load_moekit``, ``read_moekit_config``, ``verify``,
``check_out``, and the two commands, ``hf_to_moekit`` and ``moekit_to_hf``, which check their flags and OUT
before reading any model.
"""
from __future__ import annotations

import contextlib
import copy
import json
import re
import sys
import warnings
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from moekit.models.config import ModelConfig
from moekit.models.hf import load_hf, mxfp4_reference, save_hf
from moekit.models.hf.io import save_safetensors
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
    if path.suffix not in (".safetensors", ".pt"):
        raise ValueError(f"{path}: unknown moekit format {path.suffix!r}; name the output *.safetensors or *.pt")
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".safetensors":
        save_safetensors(state, path, {"format": "pt", CONFIG_KEY: json.dumps(config)})
        return path
    try:
        torch.save({"format": PT_FORMAT, "config": config, "model": state}, path)
    except RuntimeError as exc:  # torch.save's file errors (open failed, a full disk): no half-written file left
        with contextlib.suppress(OSError):
            path.unlink(missing_ok=True)
        raise ValueError(f"{path}: could not write it ({_first_line(exc)}); free space, fix the folder's "
                         f"permissions, or choose another path") from None
    return path


def read_moekit_config(path: str | Path) -> ModelConfig:
    """The ModelConfig of a moekit model file or checkpoint directory (``load_moekit``'s sources), without
    building the model or reading its tensors (a .pt file is memory-mapped)."""
    return _source(Path(path))[0]


def load_moekit(path: str | Path, device: str = "cpu", averaged: bool = False) -> Transformer:
    """A moekit model from MODEL.safetensors, MODEL.pt or a train.py checkpoint directory (eval mode); ``averaged``:
    a checkpoint's parameter average (--train.ema_decay, moekit.train.ema) instead of its trained weights."""
    config, load, _ = _source(Path(path), averaged)
    with meta_device():
        model = Transformer(config)
    model.to_empty(device=device)
    load(model)
    with torch.no_grad():  # non-persistent buffers (pending router load) are not in any file
        for name, buf in model.named_buffers():
            if name not in model.state_dict():
                buf.zero_()
    return model.eval()


class ModelSlices:
    """A moekit model file's or checkpoint's tensors by state-dict name, read box by box without loading the model
    (the dense source of sliced upcycling, models.upcycle.upcycle_into): ``config``, ``shapes``, ``read(name,
    box)`` (the values at ``box``, one range per dim, in the stored dtype). A .safetensors file is read by slices,
    a .pt file through a memory map (the pages of the slice), a checkpoint one tensor at a time (the last few
    kept). Opening checks the names and shapes against the stored config: a ValueError as load_moekit's."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.config, _, tensors = _source(self.path)
        self.shapes, self._fetch = tensors()
        with meta_device():
            want = {k: tuple(v.shape) for k, v in Transformer(self.config).state_dict().items()}
        missing = [k for k in want if k not in self.shapes]
        unexpected = [k for k in self.shapes if k not in want]
        if missing or unexpected:
            raise ValueError(f"{path}: state_dict does not match its config: missing {missing[:5]}, unexpected "
                             f"{unexpected[:5]}; the file was written for a different model")
        wrong = [f"{k} {list(v)} (config: {list(want[k])})" for k, v in self.shapes.items() if tuple(v) != want[k]]
        if wrong:
            raise ValueError(f"{path}: tensor shapes do not match its config: {', '.join(wrong[:3])}; the file was "
                             f"written for a different model")

    def read(self, name: str, box) -> torch.Tensor:
        index = tuple(slice(r.start, r.stop) for r in box)
        try:
            return self._fetch(name)[index]
        except (SafetensorError, RuntimeError, OSError) as exc:
            raise ValueError(f"{self.path}: could not read {name} ({_first_line(exc)}); the file is damaged, "
                             f"restore or write it again") from None


SOURCES = "a moekit model file (*.safetensors, *.pt) or a checkpoint directory (<run_dir>/checkpoints/step_N)"


def _source(path: Path, averaged: bool = False):
    """(ModelConfig, load(model), tensors()) of a moekit model file or checkpoint directory; ``tensors()``: (shape
    by name, fetch(name) -> something sliceable as that tensor). ``averaged``: a checkpoint's parameter average
    (``load`` only). ValueError naming the fix."""
    if not path.exists():
        raise ValueError(f"{path}: no such file or directory; pass {SOURCES}")
    if averaged and not path.is_dir():
        raise ValueError(f"{path}: a model file holds one set of weights; --ema reads the parameter average of a "
                         f"moekit-train checkpoint (<run_dir>/checkpoints/step_N of a run with --train.ema_decay)")
    if path.is_dir():
        if _run_directory(path):
            from moekit.train import checkpoint

            steps = checkpoint.list_checkpoints(path)
            which = (f"e.g. its newest, {steps[-1]}" if steps else "it holds none yet")
            raise ValueError(f"{path}: a moekit-train run directory, not a checkpoint; pass one of its checkpoints, "
                             f"{path}/checkpoints/step_N ({which})")
        return _dcp_source(path, averaged)
    if path.suffix == ".safetensors":
        return _safetensors_source(path)
    if path.suffix == ".pt":
        return _pt_source(path)
    raise ValueError(f"{path}: not a moekit model; pass {SOURCES}")


def _run_directory(path: Path) -> bool:
    """A moekit-train run directory (checkpoints/ inside), not one of its checkpoints (meta.json inside)."""
    return path.is_dir() and not (path / DCP_META).exists() and (path / "checkpoints").is_dir()


def _first_line(exc: Exception) -> str:
    """``Type: the first sentence of the message``: torch's messages go on for lines."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    text = re.sub(r"^\[enforce fail at [^\]]*\][ .]*", "", text).split(". ")[0].removesuffix(".")
    return f"{type(exc).__name__}: {text[:200]}" if text else type(exc).__name__


def _config(raw, where: str) -> ModelConfig:
    try:
        return ModelConfig.from_dict(json.loads(raw) if isinstance(raw, str) else raw).validate()
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{where}: the stored model config is invalid ({exc})") from None


def tensor_source(path: str | Path):
    """(shape by name, fetch(name) -> something sliceable as that tensor) of a moekit model file or checkpoint,
    without reading the tensors; ValueError naming the fix."""
    return _source(Path(path))[2]()


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

    def tensors():
        handle = safe_open(str(path), framework="pt")
        return {k: tuple(handle.get_slice(k).get_shape()) for k in handle.keys()}, handle.get_slice

    return _config(meta[CONFIG_KEY], str(path)), load, tensors


def _pt_source(path: Path):
    try:  # memory-mapped: the config without reading the tensors, and slices that read only their pages
        try:
            blob = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as exc:
            if "mmap" not in str(exc):
                raise
            blob = torch.load(path, map_location="cpu", weights_only=True)  # the legacy (non-zip) format
    except OSError:
        raise  # permissions, I/O errors: the program reports them with the path
    except Exception as exc:  # torch.load fails on a bad file with whatever its reader met: any means unusable
        raise ValueError(f"{path}: unreadable (truncated, or not a file torch.save wrote: {_first_line(exc)}); "
                         f"restore it, or write it again with 'moekit-convert hf-to-moekit ... OUT.pt'") from None
    if not isinstance(blob, dict) or blob.get("format") != PT_FORMAT:
        raise ValueError(f"{path}: not a moekit model file (format {PT_FORMAT!r}); write one with "
                         f"'moekit-convert hf-to-moekit ... OUT.pt'")
    state = blob["model"]
    return (_config(blob["config"], str(path)), lambda model: _load_strict(model, state, str(path)),
            lambda: ({k: tuple(v.shape) for k, v in state.items()}, state.__getitem__))


def _dcp_source(path: Path, averaged: bool = False):
    """Model weights of a tools/train.py checkpoint (``averaged``: its parameter average, moekit.train.ema);
    optimizer and data state are not read."""
    import torch.distributed.checkpoint as dcp

    try:
        meta = json.loads((path / DCP_META).read_text())
    except (FileNotFoundError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: no readable {DCP_META} ({type(exc).__name__}); pass a "
                         f"<run_dir>/checkpoints/step_N directory written by moekit-train") from None

    def load(model, state=None):  # state: some tensors only, read by this process alone (no collective)
        alone = state is not None
        state = {"model": model.state_dict() if state is None else state}
        if averaged and not alone:
            from moekit.train import ema

            try:
                state = ema.read_template(model, state["model"], path)
            except ValueError as exc:
                raise ValueError(f"{path}: {exc}") from None
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.load(state, checkpoint_id=str(path), no_dist=alone)
        except Exception as exc:  # DCP wraps every reader failure; any of them means an unusable checkpoint
            raise ValueError(f"{path}: DCP could not read the model ({type(exc).__name__}); the checkpoint is "
                             f"incomplete or for a different model") from None

    def tensors():  # shapes and dtypes from DCP's metadata; each tensor read whole when first sliced, 3 kept
        try:
            stored = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
        except Exception as exc:  # noqa: BLE001  as load: any reader failure means an unusable checkpoint
            raise ValueError(f"{path}: DCP could not read its metadata ({type(exc).__name__}); the checkpoint is "
                             f"incomplete") from None
        model = {k.removeprefix("model."): v for k, v in stored.items() if k.startswith("model.")}
        shapes = {k: tuple(v.size) for k, v in model.items() if hasattr(v, "size")}
        kept: dict[str, torch.Tensor] = {}

        def fetch(name):
            if name not in kept:
                t = torch.empty(shapes[name], dtype=model[name].properties.dtype)
                load(None, {name: t})
                kept[name] = t
                while len(kept) > 3:  # a layer's MLP: gate, up, out
                    kept.pop(next(iter(kept)))
            return kept[name]

        return shapes, fetch

    return _config(meta.get("model"), str(path / DCP_META)), load, tensors


# ---------------------------------------------------------------------------------------------------
# Commands
# ---------------------------------------------------------------------------------------------------


@torch.no_grad()
def logit_error(a: Transformer, b: Transformer) -> float:
    """Relative error of ``a``'s logits against ``b``'s on fixed random tokens."""
    cfg = a.config
    tokens = torch.randint(0, cfg.vocab_size, (2, min(16, cfg.max_seq_len)), generator=torch.Generator().manual_seed(0))
    la, lb = a(tokens), b(tokens)
    return ((la.float() - lb.float()).norm() / lb.float().norm().clamp_min(1e-30)).item()


def verify(a: Transformer, b: Transformer, what: str) -> None:
    """Same logits on random tokens: both sides hold the same values in the same dtype, so equal up to rounding."""
    err = logit_error(a, b)
    if err > 1e-6:
        raise ValueError(f"verification failed: {what} changes the logits (relative error {err:.2e})")
    print(f"verified: {what} keeps the logits (relative error {err:.1e})")


def check_out(out: str | Path, folder: bool) -> None:
    """Refuse an OUT that cannot be written, before any work, naming OUT and the fix; leave nothing behind.
    ``folder``: OUT is moekit-to-hf's HuggingFace folder (else hf-to-moekit's *.safetensors / *.pt file)."""
    from moekit.train import UserError
    from moekit.train.runlock import probe_writable, refuse_run_directory

    out = Path(out)
    if folder:
        refuse_run_directory(out, "OUT")
    elif out.suffix not in (".safetensors", ".pt"):
        raise ValueError(f"OUT {out}: unknown moekit format {out.suffix!r}; name the output *.safetensors or *.pt")
    elif out.is_dir():
        raise ValueError(f"OUT {out}: a directory; name the output file, e.g. {out / ('model' + out.suffix)}")
    parent = out if folder else out.parent
    existing = next((p for p in (parent, *parent.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        if existing == out:
            raise ValueError(f"OUT {out}: an existing file; moekit-to-hf writes a folder (config.json + "
                             f"safetensors): choose another OUT")
        raise ValueError(f"OUT {out}: {existing} is a file, not a folder; choose another OUT")
    if folder:
        probe_writable(out, "OUT")
        return
    try:
        probe_writable(parent, "folder")
    except UserError as exc:
        raise UserError(f"OUT {out}: {exc}") from None


def hf_to_moekit(args) -> None:
    check_out(args.out, folder=False)
    model = load_hf(args.src, dtype=args.dtype if args.dtype == "auto" else DTYPES[args.dtype])
    out = save_moekit(model, args.out)
    print(f"wrote {out}: {model.hf_family}, {model.config.num_layers} layers, {model.config.num_experts} experts, "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters (for the tokenizer, pass "
          f"--tokenizer {args.src} to moekit-to-hf)")
    if args.verify:  # load_moekit builds float32: compare in the dtype that was written
        dtype = next(model.parameters()).dtype
        verify(load_moekit(out).to(dtype), model, f"{args.src} -> {out}")


def run_tokenizer(src: Path) -> Path | None:
    """The run directory of a checkpoint SRC (<run_dir>/checkpoints/step_N) when it recorded a tokenizer."""
    run = src.parent.parent
    if src.is_dir() and src.parent.name == "checkpoints" and (run / "tokenizer_info.json").is_file():
        return run
    return None


def run_checkpoint(src: Path) -> Path:
    """SRC itself, or for a moekit-train run directory its newest checkpoint that verifies (as moekit-generate
    takes it; damaged newer ones are skipped with a warning)."""
    if not _run_directory(src):
        return src
    import sys

    from moekit.train.inference import newest_verified

    path, _ = newest_verified(src, lambda line: print(line, file=sys.stderr))
    print(f"SRC {src} is a run directory: converting its newest checkpoint, {path}")
    return path


def moekit_to_hf(args) -> None:
    from moekit.models.hf.export import check_tokenizer_source
    from moekit.models.hf.families import FAMILIES
    from moekit.models.hf.io import parse_size

    try:  # the flags first, then OUT, then SRC: each refused before any model is read or anything written
        parse_size(args.max_shard_size)
    except ValueError:
        raise ValueError(f"--max-shard-size {args.max_shard_size}: not a size; use a positive number of bytes or a "
                         f"size such as 5GB or 200MB") from None
    if args.fp8 and args.mxfp4:
        raise ValueError("--fp8 and --mxfp4 each quantize the expert weights; choose one")
    if args.fp8 and args.layout != "per_expert":
        raise ValueError(f"--fp8 writes per-expert tensors, as the released fp8 checkpoints do; drop --layout "
                         f"{args.layout}")
    if args.tokenizer:
        check_tokenizer_source(args.tokenizer, f"--tokenizer {args.tokenizer}", "--tokenizer")
    check_out(args.out, folder=True)
    src = run_checkpoint(Path(args.src))
    tokenizer = Path(args.tokenizer) if args.tokenizer else run_tokenizer(src)
    if tokenizer and not args.tokenizer:
        check_tokenizer_source(tokenizer, f"the tokenizer of SRC's run {tokenizer}", "--tokenizer")
    model = load_moekit(src, averaged=args.ema)
    dtype = None if args.dtype == "auto" else DTYPES[args.dtype]
    out = save_hf(model, args.out, family=args.family, dtype=dtype, max_shard_size=args.max_shard_size,
                  layout=args.layout, tokenizer_from=tokenizer, fp8=args.fp8, mxfp4=args.mxfp4)
    family = json.loads((out / "config.json").read_text())["model_type"]
    told = f", tokenizer from {tokenizer}" if tokenizer else ", no tokenizer (pass --tokenizer DIR to add one)"
    layout = "fused (the family's only layout)" if FAMILIES[family].naming.woven else args.layout
    quant = ", fp8 linear weights" if args.fp8 else ", MXFP4 expert weights" if args.mxfp4 else ""
    print(f"wrote {out} ({family}, {layout} experts{quant}{told})")
    if args.verify and args.mxfp4:  # the file must hold exactly the MXFP4 rounding of the experts
        rounded = mxfp4_reference(model, dtype or torch.bfloat16)
        verify(load_hf(out), rounded, f"{args.src} -> {out} (mxfp4)")
        print(f"MXFP4 rounding changed the logits by {logit_error(rounded, model):.2e} (relative) against {args.src}")
    elif args.verify and args.fp8:  # the file must hold exactly the fp8 rounding of the model; report its cost
        from moekit.models.hf import fp8_reference

        rounded = fp8_reference(model, family=family, dtype=dtype)
        verify(load_hf(out), rounded, f"{args.src} -> {out} (fp8)")
        print(f"fp8 rounding changed the logits by {logit_error(rounded, model):.2e} (relative) against {args.src}")
    elif args.verify:
        verify(load_hf(out, dtype="auto"), model.to(dtype) if dtype else model, f"{args.src} -> {out}")


def merge_lora_command(args) -> None:
    """moekit-convert merge-lora SRC -o OUT: a model with LoRA adapters (models.lora) -> the same model with the
    adapters folded into its weights and gone (model.lora_rank 0), as a moekit model file or an HF folder."""
    import copy

    from moekit.models.lora import has_lora, merge_lora

    out = Path(args.out)
    hf = out.suffix not in (".safetensors", ".pt")
    check_out(out, folder=hf)
    src = run_checkpoint(Path(args.src))
    model = load_moekit(src, averaged=args.ema)
    if not has_lora(model):
        raise ValueError(f"SRC {args.src}: the model has no LoRA adapters (model.lora_rank 0); nothing to merge "
                         f"(moekit-to-hf exports it as it is)")
    before = copy.deepcopy(model) if args.verify else None
    cfg = model.config
    what = f"rank {cfg.lora_rank}, alpha {cfg.lora_alpha:g}, targets {cfg.lora_targets!r}"
    merge_lora(model)
    if hf:
        tokenizer = Path(args.tokenizer) if args.tokenizer else run_tokenizer(src)
        save_hf(model, out, family=args.family, tokenizer_from=tokenizer)
    else:
        save_moekit(model, out)
    print(f"wrote {out}: LoRA adapters ({what}) folded into the weights; "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, no adapters")
    if before is not None:
        verify(load_hf(out) if hf else load_moekit(out), before, f"{args.src} -> {out} (merged)")


def _run_config(src: Path) -> dict | None:
    """The config.json of the run a checkpoint SRC (<run_dir>/checkpoints/step_N) belongs to, when there is one."""
    path = src.parent.parent / "config.json" if src.is_dir() and src.parent.name == "checkpoints" else None
    try:
        return json.loads(path.read_text()) if path is not None and path.is_file() else None
    except (OSError, ValueError):
        return None


def export_lora_command(args) -> None:
    """moekit-convert export-lora SRC OUT: a LoRA run's adapters as a PEFT adapter folder (models.hf.peft) for the
    HF checkpoint of its base weights; --verify checks base + adapter against the merged export, tensor by tensor."""
    from moekit.models.hf.peft import PEFT_WEIGHTS, adapter_metadata, apply_peft, save_peft
    from moekit.models.hf.peft_check import check_with_peft
    from moekit.models.lora import has_lora, lora_scale

    check_out(args.out, folder=True)
    src = run_checkpoint(Path(args.src))
    run = _run_config(src)
    model = load_moekit(src, averaged=args.ema)
    if not has_lora(model):
        raise ValueError(f"SRC {args.src}: the model has no LoRA adapters (model.lora_rank 0); export it whole with "
                         f"moekit-to-hf")
    trained = [f"--train.{k} {run['train'][k]!r}" for k in ("trainable", "init_from_dense") if run and run["train"].get(k)]
    if trained:
        raise ValueError(f"SRC {args.src}: the run trained more than its adapters ({', '.join(trained)}), which an "
                         f"adapter cannot carry; export the merged model instead (moekit-convert merge-lora SRC -o "
                         f"HF_DIR, or moekit-to-hf)")
    base = args.base or (run["train"].get("init_from_hf", "") if run else "")
    cfg = model.config
    out = save_peft(model, args.out, family=args.family, base_model=base,
                    dtype=None if args.dtype == "auto" else DTYPES[args.dtype], layout=args.layout)
    meta = adapter_metadata(out)
    family = meta["moekit_family"]
    print(f"wrote {out}: PEFT LoRA adapter (rank {cfg.lora_rank}, alpha {cfg.lora_alpha:g}, {args.layout} experts) "
          f"for the {family} checkpoint of its base weights{f' ({base})' if base else ''}")
    if not args.verify:
        return
    # the HF tensors of the base (the export rules leave the adapters out) and of the merged model, as save_hf writes
    import copy

    from safetensors.torch import load_file

    from moekit.models.hf import export_rules
    from moekit.models.hf.weights import export_tensors
    from moekit.models.lora import merge_lora

    def tensors(m) -> dict:
        return export_tensors(m, export_rules(m, family, None, args.layout)[1], None)

    parameters = {k: tuple(v) for k, v in json.loads(meta["moekit_parameters"]).items()}
    scale = lora_scale(cfg.lora_rank, cfg.lora_alpha, cfg.lora_rslora)
    got = apply_peft(tensors(model), load_file(out / PEFT_WEIGHTS), scale, parameters)
    want = tensors(merge_lora(copy.deepcopy(model)))
    worst = max(((got[k].float() - v.float()).norm() / v.float().norm().clamp_min(1e-30)).item()
                for k, v in want.items())
    if worst > 1e-5:
        raise ValueError(f"verification failed: base + adapter differs from the merged export (relative error "
                         f"{worst:.2e})")
    print(f"verified: the base checkpoint plus the adapter is the merged model's (relative error {worst:.1e})")
    check = check_with_peft(model, out, family)
    if check.ok is False:  # the file is right; the loader most people use would not compute the model from it
        print(f"WARNING: {check.message}", file=sys.stderr)
    else:
        print(f"verified: {check.message}" if check.ok else check.message)


def import_lora_command(args) -> None:
    """moekit-convert import-lora BASE ADAPTER -o OUT: a PEFT LoRA adapter folder onto the moekit model of the HF
    checkpoint it was trained on (models.hf.peft_import), written as a moekit model file with adapters: to fine-tune
    on (--train.init_from OUT), generate or evaluate with, or merge. --verify checks the import tensor by tensor
    against the base plus the adapter in HF terms, and through transformers + PEFT where peft is installed."""
    from moekit.models.hf.peft_check import check_import_with_peft
    from moekit.models.hf.peft_import import load_peft, read_config

    check_out(args.out, folder=False)
    read_config(args.adapter)  # a bad adapter folder is refused before the base is read
    model = load_hf(args.base, dtype=args.dtype if args.dtype == "auto" else DTYPES[args.dtype])
    base = copy.deepcopy(model).float() if args.verify else None
    report = load_peft(model, args.adapter)
    out = save_moekit(model, args.out)
    cfg = model.config
    if report.rank:
        print(f"wrote {out}: {report.family} base with LoRA adapters on {len(report.targets)} weights (rank "
              f"{cfg.lora_rank}, alpha {cfg.lora_alpha:g}{', rsLoRA' if cfg.lora_rslora else ''}; "
              f"model.lora_targets {_shorten(cfg.lora_targets)})")
    else:
        print(f"wrote {out}: {report.family} base; the adapter had nothing moekit's LoRA carries (see below)")
    if report.widened:
        print(f"  {len(report.widened)} weights take one adapter from several PEFT modules with A factors of their "
              f"own (e.g. {report.widened[0]}: moekit fuses gate and up projections): their ranks add up")
    if report.narrower:
        print(f"  model.lora_rank {cfg.lora_rank} is the widest adapter's; {len(report.narrower)} weights use fewer "
              f"ranks (e.g. {report.narrower[0]}), the others zero in both factors, which keeps them zero in training")
    if report.merged:
        print(f"  folded into the base weights (moekit's LoRA has no adapters there; they stay as PEFT trained them "
              f"unless --train.trainable names them): {', '.join(report.merged)}")
    if report.whole:
        print(f"  replaced by the adapter's modules_to_save (trained whole by PEFT; --train.trainable trains them on): "
              f"{', '.join(report.whole)}")
    if report.dropout:
        print(f"  lora_dropout {report.dropout:g}, as the adapter was trained: training it on drops its inputs alike "
              f"(--model.lora_dropout 0 with --train.init_from turns that off)")
    print(f"next: moekit-train --train.init_from {out} --data.path DATA ... (trains the adapters), moekit-generate "
          f"{out} --tokenizer {args.base} --prompt TEXT, or moekit-convert merge-lora {out} -o HF_DIR")
    if not args.verify:
        return
    from moekit.models.hf import export_rules
    from moekit.models.hf.peft_import import merged_hf_tensors
    from moekit.models.hf.weights import export_tensors
    from moekit.models.lora import merge_lora

    layout = "fused" if any(u.expert is not None for u in report.adapter.updates) else "per_expert"

    def tensors(m) -> dict:
        return export_tensors(m, export_rules(m, report.family, None, layout)[1], None)

    got = tensors(merge_lora(copy.deepcopy(model).float()))
    want = merged_hf_tensors(tensors(base), report.adapter)
    del base
    worst = max(((got[k] - v).norm() / v.norm().clamp_min(1e-30)).item() for k, v in want.items())
    limit = 1e-5 if next(model.parameters()).dtype == torch.float32 else 1e-2
    if worst > limit:
        raise ValueError(f"verification failed: the imported model differs from the base checkpoint plus the "
                         f"adapter (relative error {worst:.2e}); please report it")
    print(f"verified: the imported model is the base checkpoint plus the adapter, tensor by tensor (relative error "
          f"{worst:.1e})")
    check = check_import_with_peft(model, args.base, args.adapter)
    if check.ok is False:
        print(f"WARNING: {check.message}", file=sys.stderr)
    else:
        print(f"verified: {check.message}" if check.ok else check.message)


def _shorten(text: str, limit: int = 160) -> str:
    return text if len(text) <= limit else text[:limit] + " ..."
