"""LoRA adapters (models.lora) as a PEFT adapter folder: what vLLM, SGLang and PEFT load beside the base checkpoint.

    OUT/adapter_config.json        peft_type LORA, r, lora_alpha, target_modules, base_model_name_or_path
    OUT/adapter_model.safetensors  base_model.model.<HF module>.lora_A.weight [r, in], .lora_B.weight [out, r]; its
                                   header metadata names the family and moekit's targets (``adapter_metadata``)

``target_modules`` selects exactly the modules written: the list of their last names (``["q_proj", "w1", ...]``, as
PEFT users write it) when that list picks no other Linear of the checkpoint, else an anchored regex over the full
names. The regex also spells each adapted expert projection as ``<fused experts module>.<projection>``
(``model.layers.3.mlp.experts.w1``): transformers >= 5 holds the experts fused (``mlp.experts.gate_up_proj``), and
PEFT converts per-expert adapters to that layout (>= 0.19 for a list, >= 0.20 for a regex), finding them by probing
those names against the regex. Two limits are PEFT's, not the file's (PEFT 0.21): for the families it converts in the
Qwen2-MoE pattern (qwen2_moe, qwen3_moe, olmoe, deepseek_v3, glm4_moe, ...) it takes every ``gate_proj`` /
``up_proj`` / ``down_proj`` target for a routed expert's, so adapters on shared experts or dense FFN layers are left
out; for families it has no conversion for (qwen3_5_moe, qwen3_next) it finds no per-expert module at all.
``moekit-convert export-lora --verify`` loads the folder through PEFT when it is installed (``check_with_peft``) and
names the modules PEFT leaves without their adapter (models/hf/peft_check.py).

The HF modules are the ones ``save_hf`` writes for the family in its per-expert layout (routed experts as one Linear
each: ``mlp.experts.<e>.gate_proj``, ``up_proj``, ``down_proj``, the layout PEFT adapters of MoE models use), and
each HF weight with an adapter gets ``W_hf + (alpha / r) lora_B @ lora_A``: the very tensor ``save_hf`` writes of the
merged model (``apply_peft`` recomputes it). PEFT's scale alpha / r (alpha / sqrt(r) with ``use_rslora``) is
moekit's, so r, alpha and rsLoRA are written as they are.

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
from typing import NamedTuple

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


def one_expert(probe: Tensor, why: str) -> int:
    """The one moekit expert every element of an HF tensor's expert probe comes from; else a ValueError. (An equality
    test against the first element: ``unique()`` would sort the probe, 99% of an import's time at 128 experts.)"""
    first = probe.flatten()[:1]
    if first.numel() == 0 or not torch.equal(probe, first.view([1] * probe.dim()).expand_as(probe)):
        raise ValueError(why + " (it spans several experts)")
    return int(first)


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
            raise ValueError(why + " (the family stores its experts fused: export the adapters with --layout fused, "
                             "PEFT's adapters on transformers >= 5's fused expert parameters, or merge them: "
                             "moekit-convert merge-lora)")
        if not expert:  # W [out, in] = B A: HF rows from B's out, columns from A's in
            rows, cols = _one_along(parts[0], 0, why), _one_along(parts[1], 1, why)
            out[key] = (A[:, cols], B[rows])
            continue
        e = one_expert(parts[0], why)  # W[e] [in, out] = A[e] B[e]: HF rows from B's out, columns from A's in
        rows, cols = _one_along(parts[2], 0, why), _one_along(parts[1], 1, why)
        out[key] = (A[e][cols].t(), B[e][:, rows].t())
    return out


def fused_factors(rule, shape: tuple[int, ...], A: Tensor, B: Tensor, transposed: bool) -> tuple[Tensor, Tensor]:
    """(lora_A [E r, in], lora_B [out, r E]) of PEFT's adapter on the fused expert parameter ``rule.sources[0]`` ([E, d1,
    d2], transformers >= 5's in-memory experts) for moekit's expert adapter A [E, in, r], B [E, r, out] of a stack of
    ``shape``. PEFT (``target_parameters``) adds, per expert e, ``scale lora_B_e @ lora_A_e`` to the parameter's [d1, d2]
    slice, or its transpose where transformers marks the experts ``is_transposed`` (``transposed``), with lora_A_e
    rows e r .. e r + r of lora_A and lora_B_e the columns j E + e of lora_B (expert-minor)."""
    why = (f"{rule.target} -> {', '.join(rule.sources)}: not one fused [experts, rows, columns] tensor whose rows come "
           f"from one factor and columns from the other")
    if len(rule.sources) != 1:
        raise ValueError(why)
    pe, pi, po = (rule.split(p)[0] for p in _probes(shape))  # per HF element: its moekit expert, in and out index
    if pe.dim() != 3:
        raise ValueError(why)
    experts = pe[:, 0, 0]
    if not (torch.equal(pe, experts[:, None, None].expand_as(pe)) and torch.equal(pi, pi[:1].expand_as(pi))
            and torch.equal(po, po[:1].expand_as(po))):
        raise ValueError(why)
    pi, po = pi[0], po[0]
    A, B = A[experts], B[experts]
    if torch.equal(pi, pi[:, :1].expand_as(pi)):  # [E, in, out]: d1 from A's in, d2 from B's out
        left, right = A[:, _one_along(pi, 0, why)], B[:, :, _one_along(po, 1, why)]
    else:  # [E, out, in]
        left = B[:, :, _one_along(po, 0, why)].transpose(1, 2)
        right = A[:, _one_along(pi, 1, why)].transpose(1, 2)
    # each expert's delta is left @ right ([d1, r] @ [r, d2]); PEFT's factors of it (or of its transpose)
    lora_a, lora_b = (left.transpose(1, 2), right.transpose(1, 2)) if transposed else (right, left)
    E, r = lora_a.shape[0], lora_a.shape[1]
    return lora_a.reshape(E * r, -1), lora_b.permute(1, 2, 0).reshape(lora_b.shape[1], r * E)


def adapter_metadata(path: str | Path) -> dict[str, str]:
    """The moekit metadata of a PEFT folder ``save_peft`` wrote (its family, ``moekit_family``, and moekit's
    ``moekit_targets``), from the adapter file's header; {} for a folder another tool wrote."""
    from safetensors import safe_open

    with safe_open(str(Path(path) / PEFT_WEIGHTS), framework="pt") as f:
        meta = f.metadata() or {}
    return {k: v for k, v in meta.items() if k.startswith("moekit_")}


def target_modules(modules: list[str], linears: set[str], probes: list[str]) -> list[str] | str:
    """adapter_config's target_modules for the HF ``modules`` written (module docstring): their sorted last names when
    those pick exactly ``modules`` among ``linears`` (every HF module with a weight, adapted or not), else the
    anchored regex of ``modules`` plus ``probes`` (the fused-experts names of adapted expert projections)."""
    leaves = {m.rsplit(".", 1)[-1] for m in modules}
    if {m for m in linears | set(modules) if m.rsplit(".", 1)[-1] in leaves} == set(modules):
        return sorted(leaves)
    return _targets_regex(modules + probes)


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


class PeftExport(NamedTuple):
    family: str
    tensors: dict[str, Tensor]  # PEFT key -> tensor
    modules: list[str]  # the HF Linears with adapters (per_expert: routed experts' too)
    targets: list[str] | str  # adapter_config's target_modules
    fused: dict[str, str]  # per_expert: an expert projection's module -> its fused tensor's key in transformers >= 5
    parameters: dict[str, tuple[str, bool]]  # fused: the adapter's module in the file (``...experts`` or
    # ``...experts.base_layer``) -> (the HF parameter, transposed); adapter_config's target_parameters are the values


@torch.no_grad()
def peft_tensors(model, family: str | None = None, layout: str = "per_expert") -> PeftExport:
    """The adapters of a one-process model as PEFT tensors (module docstring); ``layout`` "fused": the routed
    experts' as PEFT's adapters on transformers >= 5's fused expert parameters (``target_parameters``)."""
    from moekit.models.hf import FAMILIES, export_rules
    from moekit.models.lora import LoRALinear
    from moekit.moe.experts import GroupedExperts

    name, rules, _ = export_rules(model, family, None, layout)
    by_target = {r.target: r for r in rules}
    fused = by_target if layout == "fused" else {r.target: r for r in export_rules(model, name, None, "fused")[1]}
    linears = {k[: -len(".weight")] for r in rules for k in r.sources if k.endswith(".weight")}
    transposed = FAMILIES[name].naming.experts_transposed
    state = model.state_dict()
    tensors: dict[str, Tensor] = {}
    modules: list[str] = []
    probes: list[str] = []
    fused_of: dict[str, str] = {}
    params: dict[str, list[tuple[str, Tensor, Tensor]]] = {}  # fused experts module -> its adapted parameters
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
            if expert and layout == "fused":
                a, b = fused_factors(rule, tuple(state[target].shape), A.detach(), B.detach(), transposed)
                container, _, param = rule.sources[0].rpartition(".")
                params.setdefault(container, []).append((param, a, b))
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
                if expert and target in fused:  # transformers >= 5's name: the fused experts' module + this leaf
                    fused_key = fused[target].sources[0]
                    fused_of[hf_module] = fused_key
                    probe = f"{fused_key.rsplit('.', 1)[0]}.{hf_module.rsplit('.', 1)[-1]}"
                    if probe not in probes:
                        probes.append(probe)
    parameters: dict[str, tuple[str, bool]] = {}
    for container, adapted in params.items():
        # PEFT wraps a module's targeted parameters one inside the other in their registration order (gate_up_proj,
        # then down_proj, in every transformers experts class): the first is reached through base_layer
        for depth, (param, a, b) in enumerate(adapted):
            where = container + ".base_layer" * (len(adapted) - 1 - depth)
            tensors[f"base_model.model.{where}.lora_A.weight"] = a.contiguous().cpu()
            tensors[f"base_model.model.{where}.lora_B.weight"] = b.contiguous().cpu()
            parameters[where] = (f"{container}.{param}", transposed)
    targets = target_modules(modules, linears, probes) if modules else []
    return PeftExport(name, tensors, modules, targets, fused_of, parameters)


def save_peft(model, path: str | Path, *, family: str | None = None, base_model: str = "",
              dtype: torch.dtype | None = None, layout: str = "per_expert") -> Path:
    """Write a one-process ``model``'s LoRA adapters as a PEFT adapter folder (module docstring) for the HF checkpoint
    ``save_hf`` writes of its base weights in ``family``; ``base_model``: adapter_config's base_model_name_or_path
    (the HF folder or hub id the adapters were trained on). ValueError for a model without adapters and for an
    adapter no Linear of the family carries."""
    cfg = model.config
    if not getattr(cfg, "lora_rank", 0):
        raise ValueError("the model has no LoRA adapters (model.lora_rank 0); nothing to export as PEFT")
    export = peft_tensors(model, family, layout)
    tensors = export.tensors
    if dtype is not None:
        tensors = {k: v.to(dtype) for k, v in tensors.items()}
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    # moekit's own notes go in the tensor file's header: PEFT warns about any key of adapter_config it does not know
    save_safetensors(tensors, folder / PEFT_WEIGHTS,
                     {"format": "pt", "moekit_family": export.family, "moekit_targets": str(cfg.lora_targets),
                      "moekit_layout": layout, "moekit_parameters": json.dumps(export.parameters)})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": cfg.lora_rank, "lora_alpha": cfg.lora_alpha,
              "lora_dropout": float(cfg.lora_dropout), "bias": "none", "fan_in_fan_out": False,
              "use_rslora": bool(cfg.lora_rslora), "use_dora": False,
              "target_modules": export.targets, "modules_to_save": None, "inference_mode": True,
              "base_model_name_or_path": base_model}
    if export.parameters:
        config["target_parameters"] = [key for key, _ in export.parameters.values()]
    (folder / PEFT_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return folder


def apply_peft(hf_tensors: dict[str, Tensor], adapter: dict[str, Tensor], scale: float,
               parameters: dict[str, tuple[str, bool]] | None = None) -> dict[str, Tensor]:
    """HF checkpoint tensors with a PEFT adapter's deltas added (float32 arithmetic): W + scale lora_B @ lora_A per
    adapted Linear, and per adapted fused expert parameter (``parameters``: PeftExport.parameters, which the file's
    header holds as ``moekit_parameters``) each expert's ``scale lora_B_e @ lora_A_e`` (transposed where marked).
    For checking an export against the merged model's (and for using adapters without PEFT)."""
    from moekit.models.lora import folded

    parameters = parameters or {}
    out = dict(hf_tensors)
    for key, a in adapter.items():
        if not key.endswith(".lora_A.weight"):
            continue
        module = key[len("base_model.model."): -len(".lora_A.weight")]
        b = adapter[key.replace(".lora_A.", ".lora_B.")]
        if module not in parameters:
            out[f"{module}.weight"] = folded(out[f"{module}.weight"], a, b, scale, expert=False)
            continue
        param, transposed = parameters[module]
        E = out[param].shape[0]
        A_e = a.reshape(E, -1, a.shape[-1])  # [E, r, in]
        B_e = b.reshape(b.shape[0], -1, E).permute(2, 0, 1)  # [E, out, r]
        left, right = (A_e.transpose(1, 2), B_e.transpose(1, 2)) if transposed else (B_e, A_e)
        out[param] = folded(out[param], left, right, scale, expert=True)  # + scale left @ right per expert
    return out
