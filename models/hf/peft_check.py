"""Load a PEFT adapter folder (models/hf/peft.py) the way its users do, through transformers and PEFT, and compare the
logits with the LoRA model's: the check ``moekit-convert export-lora --verify`` runs where peft is installed."""
from __future__ import annotations

import copy
import importlib.util
import re
import tempfile
import warnings
from pathlib import Path
from typing import NamedTuple

import torch

from moekit.models.hf.export import choose_family
from moekit.models.hf.peft import adapter_metadata, peft_tensors


class PeftCheck(NamedTuple):
    ok: bool | None  # None: not checked (peft / transformers missing, or transformers cannot load the base)
    message: str


@torch.no_grad()
def check_with_peft(model, folder: str | Path, family: str | None = None, tokens: int = 24) -> PeftCheck:
    """Load a PEFT folder ``save_peft`` wrote of ``model`` the way its users will: the HF checkpoint of the base
    weights (``save_hf`` of ``model`` with its adapters zeroed, in a temporary folder) through transformers'
    ``AutoModelForCausalLM``, the adapter through ``peft.PeftModel``, and compare the logits of random tokens with
    ``model``'s (float32 on the CPU; at most two float32 copies of the model at once, and none when that would
    take more than half the available memory).

    ok True: the same logits. ok False: PEFT cannot load it, or leaves adapted modules without their adapter (the
    message names them; PEFT's conversion to transformers >= 5's fused experts, models/hf/peft.py). ok None: not
    checked (peft or transformers missing, or this transformers cannot load the base). A ValueError when PEFT puts
    every adapter in place and still computes other logits: that is an export bug."""
    if importlib.util.find_spec("peft") is None or importlib.util.find_spec("transformers") is None:
        return PeftCheck(None, "not checked through PEFT: peft is not installed (pip install peft)")
    import peft
    import transformers
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from moekit.models.hf import save_hf

    meta = adapter_metadata(folder)
    layout = meta.get("moekit_layout", "per_expert")
    family = family or meta.get("moekit_family") or choose_family(model, None)
    too_big = _too_big(model)
    if too_big:
        return PeftCheck(None, too_big + "; the tensor check covers the file")
    versions = f"PEFT {peft.__version__} on transformers {transformers.__version__}"
    ours = copy.deepcopy(model).float().eval()
    ids, want = _logits(ours, tokens)
    for n, p in ours.named_parameters():  # now the base: the adapters add nothing
        if ".lora_b" in n:
            p.zero_()
    with tempfile.TemporaryDirectory(prefix="moekit-peft-") as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' and PEFT's notes on the tiny base are not the user's business
        save_hf(ours, Path(tmp) / "base", family=family)
        del ours
        try:
            hf = AutoModelForCausalLM.from_pretrained(Path(tmp) / "base", dtype=torch.float32)
        except Exception as exc:  # this transformers lacks the family, or reads it otherwise: not the adapter's doing
            return PeftCheck(None, f"not checked through PEFT: transformers {transformers.__version__} could not "
                                   f"load the {family} base checkpoint ({_first_line(exc)})")
        try:
            loaded = PeftModel.from_pretrained(hf, str(folder)).eval()
        except Exception as exc:
            return PeftCheck(False, f"{versions} cannot load it ({_first_line(exc)}). {_peft_advice(layout)}")
        got = loaded(input_ids=ids).logits.float()
    err = ((got - want).norm() / want.norm().clamp_min(1e-30)).item()
    if err <= 1e-4:
        return PeftCheck(True, f"{versions} loads it onto the base checkpoint with the model's logits (relative "
                               f"error {err:.1e})")
    wrapped = {n for n, m in loaded.named_modules() if hasattr(m, "lora_A") and not hasattr(m, "parameter_name")}
    params = set()
    for n, m in loaded.named_modules():
        if hasattr(m, "parameter_name"):  # a LoRA on an nn.Parameter (nested wrappers: strip their base_layer)
            params.add(re.sub(r"(\.base_layer)+$", "", n) + "." + m.parameter_name)
    export = peft_tensors(model, family, layout)  # what the folder adapts, by name: only to say what PEFT missed
    prefix = "base_model.model."
    missed = [m for m in export.modules
              if f"{prefix}{m}" not in wrapped and f"{prefix}{export.fused.get(m, '')}" not in params]
    missed += [key for key, _ in export.parameters.values() if f"{prefix}{key}" not in params]
    converted = loaded.peft_config[next(iter(loaded.peft_config))]
    if not missed and getattr(converted, "use_rslora", False) and getattr(converted, "rank_pattern", None):
        return PeftCheck(False, f"{versions} loads it with other logits than the model's (relative error {err:.1e}): "
                                f"its conversion to transformers >= 5's fused experts joins gate and up projections "
                                f"at twice the rank and alpha ({converted.rank_pattern}), which keeps alpha / r but "
                                f"not rsLoRA's alpha / sqrt(r). {_peft_advice(layout)}")
    if not missed:
        raise ValueError(f"{versions} loads the adapter onto every adapted module and computes other logits than the "
                         f"model's (relative error {err:.1e}): the export is wrong; please report it")
    shown = sorted({re.sub(r"\.experts\.\d+\.", ".experts.N.", re.sub(r"\.layers\.\d+\.", ".layers.N.", m))
                    for m in missed})
    return PeftCheck(False, f"{versions} loads it with other logits than the model's (relative error {err:.1e}): it "
                            f"puts no adapter on {len(missed)} adapted module(s) ({', '.join(shown[:8])}"
                            f"{' ...' if len(shown) > 8 else ''}). {_peft_advice(layout)}")


@torch.no_grad()
def check_import_with_peft(model, base: str | Path, folder: str | Path, tokens: int = 24) -> PeftCheck:
    """``model``, the moekit import of the PEFT ``folder`` onto the HF checkpoint ``base`` (models/hf/peft_import.py),
    against that folder loaded the way PEFT's users load it (transformers' ``AutoModelForCausalLM`` of ``base``, then
    ``peft.PeftModel``): the logits of random tokens, in float32 on the CPU (a model in another dtype is imported
    again in float32 for it). ok None: not checked (peft or
    transformers missing or unable to load them, or two float32 copies would take over half the available memory);
    ok False: other logits, the relative error named (PEFT's own conversion to fused experts misses some adapters,
    models/hf/peft.py, so this is a warning beside the tensor check, not a proof)."""
    if importlib.util.find_spec("peft") is None or importlib.util.find_spec("transformers") is None:
        return PeftCheck(None, "not checked through PEFT: peft is not installed (pip install peft)")
    import peft
    import transformers
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    too_big = _too_big(model)
    if too_big:
        return PeftCheck(None, too_big)
    versions = f"PEFT {peft.__version__} on transformers {transformers.__version__}"
    if next(model.parameters()).dtype != torch.float32:  # a bf16 import differs from PEFT's float32 load by bf16's
        # rounding of the base: the same import in float32 for the comparison
        from moekit.models.hf import load_hf
        from moekit.models.hf.peft_import import load_peft

        model = load_hf(base, dtype=torch.float32)
        load_peft(model, folder)
    ids, want = _logits(model.eval(), tokens)
    del model
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            hf = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
        except Exception as exc:  # this transformers lacks the family: not the adapter's doing
            return PeftCheck(None, f"not checked through PEFT: transformers {transformers.__version__} could not "
                                   f"load {base} ({_first_line(exc)})")
        try:
            loaded = PeftModel.from_pretrained(hf, str(folder)).eval()
        except Exception as exc:
            return PeftCheck(None, f"not checked through PEFT: {versions} cannot load {folder} onto {base} "
                                   f"({_first_line(exc)})")
        got = loaded(input_ids=ids).logits.float()
    err = ((got - want).norm() / want.norm().clamp_min(1e-30)).item()
    if err <= 1e-4:
        return PeftCheck(True, f"{versions} computes the same logits from {base} and the adapter (relative error "
                               f"{err:.1e})")
    return PeftCheck(False, f"{versions} computes other logits from {base} and the adapter than the import (relative "
                            f"error {err:.1e}). The import matches the adapter's tensors (the check above); PEFT's "
                            f"conversion to transformers >= 5's fused experts leaves some per-expert adapters out "
                            f"(shared experts, dense FFN layers of Qwen2-MoE-pattern families): compare "
                            f"PeftModel.from_pretrained's module list with the adapter")


def _too_big(model) -> str | None:
    """Why not to load through transformers here: a float32 copy of the model and transformers' float32 model would
    take over half of the available memory (None: go ahead)."""
    need = 8 * sum(p.numel() for p in model.parameters())
    free = _available_bytes()
    if free is not None and need > free // 2:
        return (f"not checked through PEFT: that load holds two float32 copies of the model ({need / 2**30:.1f} GiB) "
                f"and {free / 2**30:.1f} GiB is available")
    return None


def _logits(model, tokens: int):
    """(random token ids [2, tokens], a float32 model's logits of them)."""
    ids = torch.randint(0, model.config.vocab_size, (2, tokens), generator=torch.Generator().manual_seed(0))
    want = model(ids)
    return ids, (want[0] if isinstance(want, tuple) else want).float()


def _available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), else None."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {' '.join(lines[:2])[:300]}"


def _peft_advice(layout: str) -> str:
    if layout == "per_expert":
        return ("The folder holds the right tensors, and serving engines that read per-expert adapters (vLLM, SGLang) "
                "load it. For PEFT on transformers >= 5: export with --layout fused, keep adapters off those modules "
                "(--model.lora_targets), or export the merged model (moekit-convert merge-lora)")
    return ("The folder holds the right tensors. For PEFT: keep adapters off those modules (--model.lora_targets), "
            "export with --layout per_expert, or export the merged model (moekit-convert merge-lora)")
