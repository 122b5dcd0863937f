"""Load a trained model for inference: ``load_for_inference(path, device, dtype) -> (model, tokenizer, info)``.

What ``path`` may be (the kind is recognised from the folder's contents):

    RUN_DIR     a moekit-train run directory: its newest checkpoint that verifies (sizes and sha256 of
                every file, moekit.train.checkpoint.read_meta); damaged ones are skipped with a warning
    CHECKPOINT  <run_dir>/checkpoints/step_N: that checkpoint (it must verify); its run directory is two
                levels up (config.json, tokenizer)
    HF_DIR      a HuggingFace folder (config.json with model_type, safetensors): moekit.models.hf.load_hf
    MODEL_FILE  a moekit model file (*.safetensors with its ModelConfig in the header, *.pt: moekit-convert's
                hf-to-moekit, average and prune write them; moekit.train.modelfiles.load_moekit); it records no
                tokenizer, so ``tokenizer=`` names the folder to take one from (a run directory or an HF folder)

The model config is the checkpoint's (meta.json "model"); the run's recorded settings (meta.json "run" and
<run_dir>/config.json) must describe the same model. Only the weights are read (no optimizer state).

Inference routing (``inference_routing``): the model is in eval mode, so no router jitter, no expert-bias
updates and no load records. Capacity: a router given a capacity_factor drops the slots beyond
ceil(T * k / E * factor) of the T tokens routed *together*, so in eval a token's output would depend on
which other tokens share its forward (the batch, the prompt, cached or not). Inference therefore routes
dropless wherever the router allows it (every built-in router but expert_choice, whose capacity is its
selection rule); ``dropless=False`` keeps the trained capacity (moekit-eval --capacity trained).

The tokenizer comes from the run directory (or the HF folder) as moekit.train.tokenizer describes; an HF
folder's ``eos_ids`` are every end token it names (``hf_stop_ids``). ``ChatTemplate.load(folder)`` reads a
folder's chat template and renders a conversation as transformers' ``apply_chat_template`` does (moekit-generate
--chat).

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
from moekit.train import UserError, checkpoint, ema
from moekit.train.model_args import DTYPE_NAMES
from moekit.train.runlock import describe_os_error
from moekit.train.tokenizer import ByteTokenizer, HFTokenizer, NoTokenizer, Tokenizer, load_tokenizer, read_json
from moekit.train.tokenizer import _eos as eos_ids  # the same id checks and messages as the tokenizer's EOS

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
    averaged: bool = False  # the checkpoint's parameter average (--ema), not its trained weights

    def describe(self) -> str:
        weights = ", its parameter EMA" if self.averaged else ""
        what = (f"HuggingFace folder {self.path}" if self.kind == "hf" else
                f"{self.config.name} from the model file {self.path}" if self.kind == "file" else
                f"{self.config.name} from {self.checkpoint} (step {self.step}{weights})")
        return f"{what} on {self.device}, {str(self.dtype).removeprefix('torch.')}"


def detect_kind(path: Path) -> str:
    """'run', 'checkpoint' or 'hf' from a folder's contents, 'file' for a moekit model file; UserError for anything
    else."""
    hint = ("pass a run directory, a checkpoint (RUN_DIR/checkpoints/step_N), a HuggingFace model folder or a moekit "
            "model file (*.safetensors, *.pt)")
    if not path.exists():
        raise UserError(f"{path}: no such file or directory; {hint}")
    if path.is_file() and path.suffix in MODEL_FILE_SUFFIXES:
        return "file"
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


MODEL_FILE_SUFFIXES = (".safetensors", ".pt")  # moekit.train.modelfiles' formats


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


def _load_weights(model: Transformer, ckpt: Path, averaged: bool = False) -> None:
    """The checkpoint's model state only (DCP reads just the keys asked for: no optimizer, no data state).
    ``averaged``: the parameter average of --train.ema_decay instead of the trained weights (moekit.train.ema)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    weights = get_model_state_dict(model)
    state = {"model": weights}
    if averaged:
        try:
            state = ema.read_template(model, weights, ckpt)
        except ValueError as exc:
            raise UserError(f"checkpoint {ckpt}: {exc}") from None
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, checkpoint_id=str(ckpt))
    except Exception as exc:  # DCP wraps every reader failure; any of them means an unusable checkpoint
        reason = str(exc).strip().splitlines()
        raise UserError(f"checkpoint {ckpt}: DCP could not load the model ({type(exc).__name__}: "
                        f"{reason[-1] if reason else ''})") from None
    set_model_state_dict(model, weights)
    persistent = set(model.state_dict())
    with torch.no_grad():  # non-persistent buffers (a router's pending load) are in no checkpoint
        for name, buf in model.named_buffers():
            if name not in persistent:
                buf.zero_()


def _load_file(path: Path, folder, require_tokenizer: bool):
    """(model, tokenizer or None, why none) of a moekit model file, the tokenizer from ``folder``."""
    from moekit.train.modelfiles import load_moekit

    try:
        model = load_moekit(path)
    except (ValueError, OSError) as exc:
        raise UserError(f"{path}: {exc}") from None
    model.eval()
    if folder is None:
        why = (f"{path} is a moekit model file, which records no tokenizer; pass --tokenizer DIR (the run directory "
               f"it was trained in, or the HF folder it came from)")
        if require_tokenizer:
            raise UserError(why)
        return model, None, why
    folder = Path(folder)
    if not folder.is_dir():
        raise UserError(f"--tokenizer {folder}: not a directory (a run directory or an HF folder holding the tokenizer)")
    hf = (folder / "config.json").is_file() and detect_kind(folder) == "hf"
    tok = load_tokenizer(folder, model.config.vocab_size, hf=hf)
    if hf:
        tok.eos_ids = hf_stop_ids(folder, tok, model.config.vocab_size)
    return model, tok, None


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
                       averaged: bool = False, tokenizer: str | Path | None = None
                       ) -> tuple[Transformer, Tokenizer | None, InferenceInfo]:
    """(model in eval mode on ``device``, its tokenizer, what was loaded); module docstring for ``path``.

    dtype: parameter dtype ("auto": bf16 on CUDA, fp32 on CPU); router buffers stay float32, as routing
    computes in float32. dropless: see ``inference_routing``. require_tokenizer=False: a run that recorded
    no tokenizer gives None (``info.no_tokenizer`` says why) instead of an error. warn: gets the skipped
    damaged checkpoints. averaged: a checkpoint's parameter average (--train.ema_decay; the programs' --ema) instead
    of its trained weights; a UserError for an HF folder or a checkpoint without one. tokenizer: the folder (a run
    directory or an HF folder) whose tokenizer a moekit model file goes with (the programs' --tokenizer); refused for
    the other kinds, which carry their own.
    """
    path = Path(path)
    device = resolve_device(device) if isinstance(device, str) else device
    dtype = resolve_dtype(dtype, device) if isinstance(dtype, str) else dtype
    kind = detect_kind(path)
    ckpt = step = run_dir = run_config = no_tokenizer = None
    if kind in ("hf", "file") and averaged:
        what = "a HuggingFace folder" if kind == "hf" else "a moekit model file"
        raise UserError(f"{path}: {what} holds one set of weights; --ema reads the parameter average of a "
                        f"moekit-train checkpoint (--train.ema_decay)")
    if tokenizer is not None and kind != "file":
        raise UserError(f"--tokenizer {tokenizer}: {path} carries its own tokenizer; --tokenizer goes with a moekit "
                        f"model file (*.safetensors, *.pt), which records none")
    if kind == "file":
        model, tokenizer, no_tokenizer = _load_file(path, tokenizer, require_tokenizer)
    elif kind == "hf":
        model = _load_hf(path, dtype)
        tokenizer = load_tokenizer(path, model.config.vocab_size, hf=True)
        tokenizer.eos_ids = hf_stop_ids(path, tokenizer, model.config.vocab_size)  # decoding stops at any of them
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
        _load_weights(model, ckpt, averaged)
        try:
            tokenizer = load_tokenizer(run_dir, config.vocab_size)
        except NoTokenizer as exc:
            if require_tokenizer:
                raise
            tokenizer, no_tokenizer = None, str(exc)
    cast_parameters(model.to(device), dtype)
    routing = inference_routing(model, dropless)
    info = InferenceInfo(kind, path, model.config, device, dtype, ckpt, step, run_dir, run_config, routing,
                         cache_inexact(model), no_tokenizer, averaged)
    return model, tokenizer, info


# ---------------------------------------------------------------------------------------------------
# Chat templates (moekit-generate --chat) and an HF folder's end tokens
# ---------------------------------------------------------------------------------------------------

# Where a folder keeps its chat template, in the order read: transformers (4.43+) writes chat_template.jinja and
# lets it override tokenizer_config.json's "chat_template"; chat_template.json is the processors' older file
TEMPLATE_FILES = ("chat_template.jinja", "tokenizer_config.json", "chat_template.json")
# the named special tokens transformers passes to a template (PreTrainedTokenizerBase.SPECIAL_TOKENS_ATTRIBUTES)
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
JINJA_MIN = (3, 1, 6)  # older jinja2 has known sandbox escapes, and a template is foreign code (as transformers)
JINJA_INSTALL = "pip install 'jinja2>=3.1.6' (or moekit's extra: pip install 'moekit[chat]')"


def template_folder(path: str | Path, tokenizer: str | Path | None = None) -> Path:
    """The folder whose chat template and tokenizer files go with ``path``: an HF folder itself, the run directory
    of a run or checkpoint (where the tokenizer is read too), or a model file's ``tokenizer`` folder."""
    path = Path(path)
    kind = detect_kind(path)
    if kind == "file":
        if tokenizer is None:
            raise UserError(f"{path} is a moekit model file, which records no tokenizer or chat template; pass "
                            f"--tokenizer DIR (the run directory or HF folder it goes with)")
        return Path(tokenizer)
    return path.parent.parent if kind == "checkpoint" else path


def _token_text(value) -> str | None:
    """A tokenizer_config.json special token: a string, or an AddedToken written as {"content": ...}."""
    value = value.get("content") if isinstance(value, dict) else value
    return value if isinstance(value, str) else None


def _pick_template(value, where: Path) -> str | None:
    """A "chat_template" entry: one template, or named ones ({name: template} or [{"name", "template"}]),
    of which transformers renders "default" when no tools are given."""
    if isinstance(value, list):
        value = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
    if isinstance(value, dict):
        if "default" not in value:
            raise UserError(f"{where}: the chat templates are named {sorted(map(str, value))} with no \"default\", "
                            f"the one --chat renders; name one of them \"default\"")
        value = value["default"]
    if value is not None and not isinstance(value, str):
        raise UserError(f"{where}: chat_template is a {type(value).__name__}, not a template's text; restore it")
    return value


@dataclass
class ChatTemplate:
    """A folder's chat template, compiled; ``render`` lays out a conversation the way transformers'
    ``apply_chat_template`` does (the same jinja2 sandbox, globals and special-token variables)."""

    source: Path
    text: str
    special_tokens: dict[str, str]
    compiled: object = None

    @classmethod
    def load(cls, folder: Path) -> "ChatTemplate":
        """The template of ``folder`` (TEMPLATE_FILES), compiled; UserError when there is none, when jinja2
        is missing or too old, or when the template does not parse."""
        config_path = folder / "tokenizer_config.json"
        config = read_json(config_path, "tokenizer_config.json") if config_path.is_file() else {}
        config = config if isinstance(config, dict) else {}
        source = text = None
        for name in TEMPLATE_FILES:
            path = folder / name
            if not path.is_file():
                continue
            if name.endswith(".jinja"):
                try:
                    text = path.read_text(encoding="utf-8")
                except (OSError, UnicodeDecodeError) as exc:
                    why = describe_os_error(exc) if isinstance(exc, OSError) else str(exc)
                    raise UserError(f"{path}: unreadable ({why}); restore it") from None
            else:
                data = config if name == "tokenizer_config.json" else read_json(path, name)
                text = _pick_template(data.get("chat_template") if isinstance(data, dict) else None, path)
            if text is not None:
                source = path
                break
        if source is None:
            raise UserError(f"{folder}: no chat template (no chat_template in tokenizer_config.json, no "
                            f"chat_template.jinja or chat_template.json), so --chat cannot lay out the prompt; it may "
                            f"be a base model: drop --chat and give the text to continue with --prompt")
        special = {k: t for k in SPECIAL_TOKEN_NAMES if (t := _token_text(config.get(k))) is not None}
        return cls(source, text, special, _compile(text, source))

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        import jinja2

        try:
            return self.compiled.render(messages=messages, tools=None, documents=None,
                                        add_generation_prompt=add_generation_prompt, **self.special_tokens)
        except jinja2.TemplateError as exc:  # raise_exception() in the template, or an undefined it needs
            raise UserError(f"{self.source}: the chat template refused the conversation ({exc}); check --system / "
                            f"--prompt against what the template accepts") from None
        except Exception as exc:  # the template is foreign code: whatever it fails with is its own error
            raise UserError(f"{self.source}: the chat template failed ({type(exc).__name__}: {exc}); fix the "
                            f"template, or drop --chat") from None


def _import_jinja2():
    try:
        import jinja2
        import jinja2.ext
        import jinja2.sandbox
    except ImportError:
        raise UserError(f"--chat renders the model's chat template with jinja2, which is not installed; "
                        f"{JINJA_INSTALL}") from None
    version = tuple(int(p) for p in jinja2.__version__.split(".")[:3] if p.isdigit())
    if version < JINJA_MIN:
        raise UserError(f"--chat needs jinja2 >= 3.1.6 to render a chat template safely (older versions have "
                        f"sandbox escapes), and {jinja2.__version__} is installed; {JINJA_INSTALL}")
    return jinja2


def _compile(text: str, source: Path):
    """The template compiled in an environment like transformers' (utils/chat_template_utils.py), so that
    templates written for it render the same here."""
    import json
    from datetime import datetime

    jinja2 = _import_jinja2()

    class Generation(jinja2.ext.Extension):
        # {% generation %}...{% endgeneration %} marks the assistant's text for training masks: render it as is
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # jinja's own tojson escapes HTML characters, which would change the prompt's text
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(text)
    except jinja2.TemplateSyntaxError as exc:
        raise UserError(f"{source}: the chat template does not parse (line {exc.lineno}: {exc.message}); fix it, "
                        f"or drop --chat") from None


def chat_messages(prompt: str, system: str | None) -> list[dict[str, str]]:
    """The conversation --chat renders: an optional system message, then the prompt as the user's."""
    return ([{"role": "system", "content": system}] if system is not None else []) + [
        {"role": "user", "content": prompt}]


def encode_rendered(tokenizer: Tokenizer, text: str) -> list[int]:
    """Token ids of a rendered template. The template writes BOS and the turn markers itself, so nothing is
    added (transformers' apply_chat_template encodes with add_special_tokens=False); the markers in the text
    become their added tokens."""
    if isinstance(tokenizer, HFTokenizer):
        return tokenizer.tok.encode(text, add_special_tokens=False).ids
    return tokenizer.encode(text)


def hf_stop_ids(folder: Path, tokenizer: HFTokenizer | ByteTokenizer, vocab: int) -> tuple[int, ...]:
    """Every end token an HF folder names: ``eos_token_id`` of generation_config.json and of config.json (an int
    or a list: gpt-oss lists <|return|>, <|endoftext|> and <|call|>), and tokenizer_config.json's eos_token. An
    instruct model may end its turn with any of them (Qwen3: <|im_end|> or <|endoftext|>). The tokenizer's own
    choice (the first source found) stays first, so ``eos_id`` keeps its meaning."""
    ids = list(tokenizer.eos_ids)
    for name in ("generation_config.json", "config.json"):
        path = folder / name
        data = read_json(path, name) if path.is_file() else None
        if isinstance(data, dict):
            ids += eos_ids(data.get("eos_token_id"), vocab, path)
    path = folder / "tokenizer_config.json"
    data = read_json(path, "tokenizer_config.json") if path.is_file() else None
    text = _token_text(data.get("eos_token")) if isinstance(data, dict) else None
    if text is not None and isinstance(tokenizer, HFTokenizer):
        found = tokenizer.tok.token_to_id(text)
        ids += eos_ids(found, vocab, path) if found is not None else []
    return tuple(dict.fromkeys(ids))
