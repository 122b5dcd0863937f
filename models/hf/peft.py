"""LoRA adapters (models.lora) as a PEFT adapter folder: what vLLM, SGLang and PEFT load beside the base checkpoint.

    OUT/adapter_config.json        peft_type LORA, r, lora_alpha, target_modules (an anchored regex naming exactly
                                   the modules written), base_model_name_or_path
    OUT/adapter_model.safetensors  base_model.model.<HF module>.lora_A.weight [r, in], .lora_B.weight [out, r]

The HF modules are the ones ``save_hf`` writes for the family in its per-expert layout (routed experts as one Linear
each: ``mlp.experts.<e>.gate_proj``, ``up_proj``, ``down_proj``, the layout PEFT adapters of MoE models use), and
each HF weight with an adapter gets ``W_hf + (alpha / r) lora_B @ lora_A``: the very tensor ``save_hf`` writes of the
merged model (``check_peft`` recomputes it). PEFT's scale alpha / r is moekit's, so r and alpha are written as they
are.

How a moekit adapter becomes HF factors: the family's export rule maps the moekit weight to its HF tensors by
slicing, transposing and permuting (models.hf.weights.Rule.split). Applied to index probes (an arange along each dim,
expanded: no memory), it says which moekit index each HF element comes from. When the HF tensor's rows come from one
factor's dim and its columns from the other's (an nn.Linear ``[out, in]``: rows from B's out side, columns from A's
in side; for an expert, one expert's slice), the HF factors are those rows of B and columns of A. A rule that mixes
them (a fused 3-D expert tensor, gpt-oss's and Llama 4's only layout) has no per-Linear adapter: refused, naming the
weight.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from torch import Tensor

from moekit.models.hf.io import save_safetensors

PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"


def _probes(shape: tuple[int, ...]) -> list[Tensor]:
    """One int64 tensor of ``shape`` per dim whose value is that dim's index (expanded views: no memory)."""
    out = []
    for d, n in enumerate(shape):
        view = [1] * len(shape)
        view[d] = n
        out.append(torch.arange(n).view(view).expand(shape))
    return out


def _one_along(t: Tensor, dim: int, what: str) -> Tensor:
    """The values of 2-D ``t`` along ``dim`` when they do not change along the other dim; else a ValueError."""
    line = t[:, :1] if dim == 0 else t[:1, :]
    if not torch.equal(t, line.expand_as(t)):
        raise ValueError(what)
    return line.flatten()


def adapter_factors(rule, shape: tuple[int, ...], A: Tensor, B: Tensor, expert: bool) -> dict[str, tuple[Tensor, Tensor]]:
    """HF key -> (lora_A [r, in_hf], lora_B [out_hf, r]) for the adapter (A, B) of the moekit weight ``rule.target`` of
    ``shape``: a Linear's A [r, in], B [out, r] (``expert`` False), or an expert stack's A [E, in, r], B [E, r, out]."""
    probes = [rule.split(p) for p in _probes(shape)]  # per dim: the HF tensors of that dim's indices
    out = {}
    for k, key in enumerate(rule.sources):
        parts = [p[k] for p in probes]
        why = (f"{rule.target} -> {key}: the HF tensor {tuple(parts[0].shape)} does not take its rows from one factor "
               f"and its columns from the other, so it has no per-Linear adapter")
        if parts[0].dim() != 2:
            raise ValueError(why + " (a fused expert tensor: PEFT adapters need one Linear per expert; export the "
                             "experts per_expert, or merge the adapters: moekit-convert merge-lora)")
        if not expert:  # W [out, in] = B A: HF rows from B's out, columns from A's in
            rows, cols = _one_along(parts[0], 0, why), _one_along(parts[1], 1, why)
            out[key] = (A[:, cols], B[rows])
            continue
        e = parts[0].unique()  # W[e] [in, out] = A[e] B[e]: one expert; HF rows from B's out, columns from A's in
        if e.numel() != 1:
            raise ValueError(why + " (it spans several experts)")
        rows, cols = _one_along(parts[2], 0, why), _one_along(parts[1], 1, why)
        e = int(e)
        out[key] = (A[e][cols].t(), B[e][:, rows].t())
    return out


def _targets_regex(modules: list[str]) -> str:
    """An anchored regex matching exactly the module names written: per module path, its layer indices as an
    alternation, expert indices as \\d+ (an expert stack's adapters cover every expert)."""
    groups: dict[tuple[str, str | None], set[str]] = {}
    for m in modules:
        m = re.sub(r"\.experts\.\d+\.", ".experts.<E>.", m)
        found = re.match(r"^(.*?\.layers\.)(\d+)(\..*)$", m)
        key = (found[1], found[3]) if found else (m, None)
        groups.setdefault(key, set()).add(found[2] if found else "")

    def esc(text: str) -> str:
        return re.escape(text).replace("<E>", r"\d+")

    alts = [esc(head) if tail is None else f"{esc(head)}(?:{'|'.join(sorted(idx, key=int))}){esc(tail)}"
            for (head, tail), idx in sorted(groups.items())]
    return "^(" + "|".join(alts) + ")$" if alts else ""


@torch.no_grad()
def peft_tensors(model, family: str | None = None) -> tuple[str, dict[str, Tensor], list[str]]:
    """(the family, PEFT key -> tensor, the HF module names) of a one-process model's adapters (module docstring)."""
    from moekit.models.hf import export_rules
    from moekit.models.lora import LoRALinear
    from moekit.moe.experts import GroupedExperts

    name, rules, _ = export_rules(model, family, None, "per_expert")
    by_target = {r.target: r for r in rules}
    state = model.state_dict()
    tensors: dict[str, Tensor] = {}
    modules: list[str] = []
    for prefix, module in model.named_modules():
        if isinstance(module, LoRALinear):
            carriers = [(f"{prefix}.weight", module.lora_a, module.lora_b, False)]
        elif isinstance(module, GroupedExperts) and module.lora_rank:
            carriers = [(f"{prefix}.w_{s}", getattr(module, f"lora_a_{s}"), getattr(module, f"lora_b_{s}"), True)
                        for s in module.lora_sides]
        else:
            continue
        for target, A, B, expert in carriers:
            rule = by_target.get(target)
            if rule is None:  # an MTP depth the family has no place for (export_rules warned)
                continue
            for key, (a, b) in adapter_factors(rule, tuple(state[target].shape), A.detach(), B.detach(),
                                               expert).items():
                if not key.endswith(".weight"):
                    raise ValueError(f"{target} -> {key}: not a Linear's weight; PEFT adapters go on Linears")
                hf_module = key[: -len(".weight")]
                if f"base_model.model.{hf_module}.lora_A.weight" in tensors:
                    raise ValueError(f"{key} gets adapters from two moekit weights; merge instead (moekit-convert "
                                     f"merge-lora)")
                tensors[f"base_model.model.{hf_module}.lora_A.weight"] = a.contiguous().cpu()
                tensors[f"base_model.model.{hf_module}.lora_B.weight"] = b.contiguous().cpu()
                modules.append(hf_module)
    return name, tensors, modules


def save_peft(model, path: str | Path, *, family: str | None = None, base_model: str = "",
              dtype: torch.dtype | None = None) -> Path:
    """Write a one-process ``model``'s LoRA adapters as a PEFT adapter folder (module docstring) for the HF checkpoint
    ``save_hf`` writes of its base weights in ``family``; ``base_model``: adapter_config's base_model_name_or_path
    (the HF folder or hub id the adapters were trained on). ValueError for a model without adapters and for an
    adapter no Linear of the family carries."""
    cfg = model.config
    if not getattr(cfg, "lora_rank", 0):
        raise ValueError("the model has no LoRA adapters (model.lora_rank 0); nothing to export as PEFT")
    name, tensors, modules = peft_tensors(model, family)
    if dtype is not None:
        tensors = {k: v.to(dtype) for k, v in tensors.items()}
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    save_safetensors(tensors, folder / PEFT_WEIGHTS, {"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": cfg.lora_rank, "lora_alpha": cfg.lora_alpha,
              "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
              "target_modules": _targets_regex(modules), "modules_to_save": None, "inference_mode": True,
              "base_model_name_or_path": base_model, "moekit": {"family": name, "targets": cfg.lora_targets}}
    (folder / PEFT_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return folder


def apply_peft(hf_tensors: dict[str, Tensor], adapter: dict[str, Tensor], scale: float) -> dict[str, Tensor]:
    """HF checkpoint tensors with a PEFT adapter's deltas added (float32 arithmetic): W + scale lora_B @ lora_A per
    adapted Linear. For checking an export against the merged model's (and for using adapters without PEFT)."""
    from moekit.models.lora import folded

    out = dict(hf_tensors)
    for key, a in adapter.items():
        if not key.endswith(".lora_A.weight"):
            continue
        module = key[len("base_model.model."): -len(".lora_A.weight")]
        out[f"{module}.weight"] = folded(out[f"{module}.weight"], a, adapter[key.replace(".lora_A.", ".lora_B.")],
                                         scale, expert=False)
    return out
