"""A PEFT LoRA adapter folder onto the moekit model of its base checkpoint: models/hf/peft.py's export, reversed.

    base = load_hf(BASE)                     # the HF checkpoint the adapter was trained on
    report = load_peft(base, ADAPTER)        # base now carries the adapter as moekit LoRA (models.lora)

What a folder may hold (PEFT's ``save_pretrained``, and the per-expert files vLLM and SGLang read):

    <module>.lora_A.weight [r, in], .lora_B.weight [out, r]   a Linear's adapter (per expert too: experts.N.w1)
    <experts>[.base_layer].lora_A / lora_B                    PEFT's ``target_parameters`` on transformers >= 5's
                                                              fused experts: per expert e, lora_A rows e r .. e r + r,
                                                              lora_B columns j E + e; the parameter registered first
                                                              (gate_up_proj) sits one base_layer deeper
    <module>.lora_embedding_A [r, V], .lora_embedding_B [H, r]  an embedding's adapter
    <module>.weight                                           ``modules_to_save``: a module PEFT trained whole

Each adapter's scale is ``lora_alpha / r`` (``alpha_pattern`` per module; / sqrt(r) with ``use_rslora``), r read from
its tensors (PEFT's own conversion to fused experts doubles gate_up's rank through ``rank_pattern``).

How an HF update becomes moekit factors: the family's export rule maps moekit weights to HF tensors; applied to index
probes (models/hf/peft.py) it says, for each HF row and column, which moekit index it comes from. An HF update
``L @ R`` ([rows, r] @ [r, cols]) whose rows come from the moekit weight's output side and columns from its input side
(or the other way round, for a transposed layout) is a block of the moekit adapter: B's rows and A's columns at those
indices (moekit's Linear computes B @ A, an expert A_e @ B_e). The HF tensors of one moekit weight (gate_proj and
up_proj both come from an expert stack's ``w_in``) share one rank-r block when their A sides are equal (an export of
moekit's own adapters), else each takes r ranks of its own: PEFT's separate gate and up adapters become a rank-2r
adapter on ``w_in`` that computes exactly what PEFT does. moekit's ``lora_rank`` is one number, so every adapter is
as wide as the widest, the extra ranks zero in both factors: zero gradients keep them zero, so training continues
as PEFT's would. Scales that differ per module (alpha_pattern) are folded into the B factors.

Adapters moekit's LoRA cannot carry (the output head, the embedding, a router) and ``modules_to_save`` go into the
base weights: the model computes what PEFT's does, and the report names them (train them on with
``--train.trainable``). DoRA, LoRA biases and fan_in_fan_out adapters are refused, naming the way out.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import json
import math
import re
from collections import Counter
from pathlib import Path
from typing import NamedTuple

import torch
from torch import Tensor

from moekit.models.hf.peft import PEFT_CONFIG, PEFT_WEIGHTS, _one_along, _probes, one_expert

PREFIX = "base_model.model."
PEFT_BIN = "adapter_model.bin"
_SAVED_WHOLE = re.compile(r"\.(?:modules_to_save|base_layer)\.(weight|bias)$")  # <module>.modules_to_save.weight


class Update(NamedTuple):
    """One HF tensor's low-rank update, ``scale * L @ R`` (``expert``: of that expert's slice of a fused tensor)."""
    key: str  # the HF tensor
    expert: int | None
    L: Tensor  # [rows, r]
    R: Tensor  # [r, cols]
    scale: float
    module: str  # the adapter's module in the file, for messages


class Adapter(NamedTuple):
    config: dict
    updates: list[Update]
    whole: dict[str, Tensor]  # modules_to_save: HF key -> the tensor PEFT trained whole


class ImportReport(NamedTuple):
    family: str
    rank: int  # moekit's lora_rank (the widest adapter)
    alpha: float
    targets: list[str]  # moekit weights with adapters
    widened: list[str]  # moekit weights whose HF tensors have separate A factors (rank: the sum of theirs)
    narrower: list[str]  # moekit weights whose adapter uses fewer than ``rank`` ranks (the rest zero)
    merged: list[str]  # moekit weights the adapter changes that take no moekit adapter: folded into the weights
    whole: list[str]  # moekit weights replaced by modules_to_save
    dropout: float  # PEFT's lora_dropout: the imported model's model.lora_dropout (0 when no adapter stays)
    adapter: Adapter


def _refuse(folder: Path, what: str) -> ValueError:
    return ValueError(f"ADAPTER {folder}: {what}")


def read_config(folder: str | Path) -> dict:
    """adapter_config.json of a PEFT folder, checked for what moekit can import (ValueError naming the fix)."""
    folder = Path(folder)
    path = folder / PEFT_CONFIG
    if not folder.is_dir():
        raise _refuse(folder, "not a folder; give the PEFT adapter folder (adapter_config.json + "
                              "adapter_model.safetensors, as save_pretrained writes it)")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise _refuse(folder, f"no {PEFT_CONFIG}; give the PEFT adapter folder save_pretrained wrote") from None
    except (OSError, ValueError) as exc:
        raise _refuse(folder, f"{PEFT_CONFIG} is unreadable ({exc}); re-download or re-save the adapter") from None
    if not isinstance(config, dict):
        raise _refuse(folder, f"{PEFT_CONFIG} is not a JSON object")
    kind = str(config.get("peft_type", "")).upper()
    if kind != "LORA":
        raise _refuse(folder, f"peft_type {config.get('peft_type')!r}: only LoRA adapters (peft_type LORA) import; "
                              f"merge it into the base with PEFT (merge_and_unload) and import the merged model")
    if config.get("use_dora"):
        raise _refuse(folder, "a DoRA adapter (use_dora true): moekit's LoRA has no magnitude vectors; merge it with "
                              "PEFT (merge_and_unload), save the model and import that with moekit-convert hf-to-moekit")
    if config.get("fan_in_fan_out"):
        raise _refuse(folder, "fan_in_fan_out true (adapters of GPT-2-style Conv1D layers): no moekit model has them")
    if str(config.get("bias", "none")) != "none" or config.get("lora_bias"):
        raise _refuse(folder, f"the adapter trains biases (bias {config.get('bias')!r}, lora_bias "
                              f"{config.get('lora_bias')!r}); moekit's adapters have none: merge it with PEFT "
                              f"(merge_and_unload) and import the merged model")
    for field in ("r", "lora_alpha"):
        value = config.get(field)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
            raise _refuse(folder, f"{PEFT_CONFIG} has {field}={value!r}; a LoRA adapter needs a positive number")
    dropout = config.get("lora_dropout") or 0.0
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise _refuse(folder, f"{PEFT_CONFIG} has lora_dropout={dropout!r}; it must be a number in [0, 1) (0: none)")
    return config


def _read_tensors(folder: Path) -> dict[str, Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if (folder / PEFT_WEIGHTS).is_file():
        try:
            return load_file(str(folder / PEFT_WEIGHTS))
        except (SafetensorError, OSError) as exc:
            raise _refuse(folder, f"{PEFT_WEIGHTS} is unreadable ({exc}); re-download or re-save the adapter") from None
    if (folder / PEFT_BIN).is_file():
        try:
            state = torch.load(folder / PEFT_BIN, map_location="cpu", weights_only=True)
        except Exception as exc:  # pickle and zip errors of every kind: a corrupt or foreign file
            raise _refuse(folder, f"{PEFT_BIN} is unreadable ({type(exc).__name__}: {exc})") from None
        if isinstance(state, dict) and all(isinstance(v, Tensor) for v in state.values()):
            return state
        raise _refuse(folder, f"{PEFT_BIN} is not a state dict of tensors")
    raise _refuse(folder, f"no {PEFT_WEIGHTS} (or {PEFT_BIN}); give the folder save_pretrained wrote")


def _pattern_value(patterns: dict, name: str, default):
    """PEFT's rank_pattern / alpha_pattern lookup: the first key that matches the end of ``name`` (a regex)."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(?:.*\.)?(?:{key})$", name):
            return value
    return default


def _scale(config: dict, name: str, rank: int) -> float:
    alpha = float(_pattern_value(config.get("alpha_pattern"), name, config["lora_alpha"]))
    return alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)


def read_adapter(folder: str | Path, fused_params: dict[str, list[tuple[str, tuple[int, ...]]]],
                 transposed: bool, hf_shapes: dict[str, tuple[int, ...]]) -> Adapter:
    """The updates a PEFT folder makes, in HF terms. ``fused_params``: fused experts module -> its [E, d1, d2] expert
    parameters in registration order (transformers >= 5's ``gate_up_proj``, ``down_proj``); ``transposed``: the
    family's experts are stored [E, in, out] (``is_transposed``); ``hf_shapes``: every HF tensor of the base."""
    folder = Path(folder)
    config = read_config(folder)
    tensors = _read_tensors(folder)
    pairs: dict[str, dict[str, Tensor]] = {}
    whole: dict[str, Tensor] = {}
    for raw, t in tensors.items():
        key = raw[len(PREFIX):] if raw.startswith(PREFIX) else raw
        key = re.sub(r"\.default(?=\.|$)", "", key)  # an adapter name left in (older PEFT saves)
        found = re.match(r"^(.*)\.(lora_A|lora_B)\.weight$", key) or re.match(r"^(.*)\.(lora_embedding_[AB])$", key)
        if found:
            pairs.setdefault(found[1], {})[found[2]] = t
        elif "lora_magnitude_vector" in key:
            raise _refuse(folder, f"{raw} is a DoRA magnitude; merge the adapter with PEFT and import the merged model")
        elif re.search(r"\.lora_[AB]\.bias$", key):
            raise _refuse(folder, f"{raw} is a LoRA bias; merge the adapter with PEFT and import the merged model")
        elif _SAVED_WHOLE.search(key):  # a module PEFT saved whole (the embedding layers next to their adapters,
            # save_embedding_layers)
            whole[_SAVED_WHOLE.sub(r".\1", key)] = t
        elif key in hf_shapes:
            whole[key] = t
        else:
            raise _refuse(folder, f"tensor {raw} is neither a LoRA factor nor a weight of the base checkpoint; is the "
                                  f"adapter for another model?")
    for key, t in whole.items():
        if tuple(t.shape) != hf_shapes[key]:
            raise _refuse(folder, f"{key} (modules_to_save) is {list(t.shape)}, the base's is {list(hf_shapes[key])}: "
                                  f"the adapter was trained on another model")
    targeted = [str(p) for p in (config.get("target_parameters") or [])]
    updates: list[Update] = []
    for module, f in sorted(pairs.items()):
        names = sorted(f)
        if names not in (["lora_A", "lora_B"], ["lora_embedding_A", "lora_embedding_B"]):
            raise _refuse(folder, f"{module} has {', '.join(names)} but not both factors; the file is incomplete")
        if "lora_embedding_A" in f:  # W [V, H] += s (B A)^T
            A, B = f["lora_embedding_A"].float(), f["lora_embedding_B"].float()
            shape, r = hf_shapes.get(f"{module}.weight"), A.shape[0]
            if shape is None or B.shape[1] != r or (A.shape[1], B.shape[0]) != shape:
                raise _refuse(folder, f"{module}: embedding adapter {list(A.shape)} / {list(B.shape)} does not fit the "
                                      f"base's {module}.weight {list(shape) if shape else '(none)'}")
            updates.append(Update(f"{module}.weight", None, A.t(), B.t(), _scale(config, module, r), module))
            continue
        A, B = f["lora_A"].float(), f["lora_B"].float()
        if A.dim() != 2 or B.dim() != 2:
            raise _refuse(folder, f"{module}: lora_A {list(A.shape)} / lora_B {list(B.shape)} are not matrices")
        linear = hf_shapes.get(f"{module}.weight")
        if linear is not None and len(linear) == 2:
            r = A.shape[0]
            if B.shape[1] != r or (B.shape[0], A.shape[1]) != linear:
                raise _refuse(folder, f"{module}: lora_B {list(B.shape)} @ lora_A {list(A.shape)} does not fit the "
                                      f"base's {module}.weight {list(linear)}: the adapter was trained on another "
                                      f"model")
            updates.append(Update(f"{module}.weight", None, B, A, _scale(config, module, r), module))
            continue
        container = re.sub(r"(\.base_layer)+$", "", module)
        depth = (len(module) - len(container)) // len(".base_layer")
        params = [(p, s) for p, s in fused_params.get(container, [])
                  if any(p == t or p.endswith("." + t) for t in targeted)]
        if not params:
            raise _refuse(folder, f"{module}: no module or target_parameters entry of the base checkpoint carries "
                                  f"this adapter (target_parameters {targeted}); is the adapter for another model?")
        if depth >= len(params):
            raise _refuse(folder, f"{module}: nested {depth} deep but {container} has {len(params)} targeted "
                                  f"parameter(s) ({', '.join(p for p, _ in params)})")
        param, shape = params[len(params) - 1 - depth]  # PEFT nests the first registered parameter deepest
        E, d1, d2 = shape
        rows, cols = (d2, d1) if transposed else (d1, d2)  # delta_e = B_e A_e is [rows, cols] (transposed: of W_e^T)
        if A.shape[0] % E or A.shape[1] != cols or B.shape != (rows, A.shape[0]):
            raise _refuse(folder, f"{module} ({param} {list(shape)}): lora_A {list(A.shape)} / lora_B "
                                  f"{list(B.shape)} do not fit {E} experts of [{rows}, {cols}]: the adapter was "
                                  f"trained on another model")
        r = A.shape[0] // E
        A_e = A.reshape(E, r, cols)  # [E, r, in]
        B_e = B.reshape(rows, r, E).permute(2, 0, 1)  # [E, out, r]
        scale = _scale(config, param, r)
        for e in range(E):
            L, R = (A_e[e].t(), B_e[e].t()) if transposed else (B_e[e], A_e[e])
            updates.append(Update(param, e, L, R, scale, module))
    seen = Counter((u.key, u.expert) for u in updates)
    twice = [k for k, n in seen.items() if n > 1]
    if twice:
        raise _refuse(folder, f"{twice[0][0]} gets two adapters (as a Linear and as a fused parameter?)")
    return Adapter(config, updates, whole)


class _Block(NamedTuple):
    """Part of one moekit adapter: A's rows ``a_val`` [n, r] at input indices ``a_idx``, B's at output ``b_idx``."""
    a_idx: Tensor
    a_val: Tensor
    b_idx: Tensor
    b_val: Tensor


def _axes(p_out: Tensor, p_in: Tensor, why: str) -> tuple[bool, Tensor, Tensor]:
    """(rows come from the output side, the moekit index of each row, of each column) of a 2-D HF tensor whose elements
    come from moekit output index ``p_out`` and input index ``p_in``."""
    try:
        return True, _one_along(p_out, 0, why), _one_along(p_in, 1, why)
    except ValueError:
        return False, _one_along(p_in, 0, why), _one_along(p_out, 1, why)


def _blocks(rule, shape: tuple[int, ...], expert_stack: bool, updates: list[tuple[int, Update]],
            scale: float) -> dict[int | None, list[_Block]]:
    """Per moekit expert (None: a Linear), the blocks of the adapter ``updates`` (source index, update) make on the
    moekit weight ``rule.target`` of ``shape``, their B sides times update scale / ``scale``."""
    probes = [rule.split(p) for p in _probes(shape)]
    out: dict[int | None, list[_Block]] = {}
    for k, u in updates:
        parts = [p[k] for p in probes]
        why = (f"{rule.target} -> {rule.sources[k]}: the HF tensor does not take its rows from one side of the moekit "
               f"weight and its columns from the other, so its adapter has no moekit form")
        if expert_stack:  # moekit [E, in, out]
            pe, pi, po = parts
            if u.expert is not None:  # one expert's slice of a fused [E', d1, d2] tensor
                pe, pi, po = pe[u.expert], pi[u.expert], po[u.expert]
            if pe.dim() != 2:
                raise ValueError(why)
            e, p_out, p_in = one_expert(pe, why), po, pi
        else:  # moekit [out, in]
            if parts[0].dim() != 2:
                raise ValueError(why)
            e, p_out, p_in = None, parts[0], parts[1]
        from_out, rows, cols = _axes(p_out, p_in, why)
        if u.L.shape[0] != rows.numel() or u.R.shape[1] != cols.numel():
            raise ValueError(f"{u.module}: its update is [{u.L.shape[0]}, {u.R.shape[1]}] but the base's "
                             f"{rule.sources[k]} is [{rows.numel()}, {cols.numel()}]")
        L, Rt = u.L, u.R.t()
        if from_out:
            block = _Block(cols, Rt, rows, L * (u.scale / scale))
        else:
            block = _Block(rows, L, cols, Rt * (u.scale / scale))
        same = next((i for i, b in enumerate(out.get(e, [])) if b.a_val.shape == block.a_val.shape
                     and torch.equal(b.a_idx, block.a_idx) and torch.equal(b.a_val, block.a_val)), None)
        if same is None:
            out.setdefault(e, []).append(block)
        else:  # one A for both (gate and up of moekit's own export): one block, B's rows of both
            b = out[e][same]
            out[e][same] = _Block(b.a_idx, b.a_val, torch.cat([b.b_idx, block.b_idx]), torch.cat([b.b_val, block.b_val]))
    return out


def _factors(blocks: dict[int | None, list[_Block]], rank: int, shape: tuple[int, ...]) -> tuple[Tensor, Tensor]:
    """The moekit factors (float32, ``rank`` wide) the blocks of one weight of ``shape`` make, each block at the next
    free ranks, the rest zero: a Linear's A [R, in], B [out, R] (B @ A), an expert stack's A [E, in, R], B [E, R, out]
    (A_e @ B_e)."""
    if len(shape) == 2:
        A, B = torch.zeros(rank, shape[1]), torch.zeros(shape[0], rank)
    else:
        A, B = torch.zeros(shape[0], shape[1], rank), torch.zeros(shape[0], rank, shape[2])
    for e, bs in blocks.items():
        o = 0
        for b in bs:
            r = b.a_val.shape[1]
            if e is None:
                A[o:o + r, b.a_idx] = b.a_val.t()
                B[b.b_idx, o:o + r] = b.b_val
            else:  # through expert e's view (A[e, idx, o:] would put the indexed dims first)
                A[e][b.a_idx, o:o + r] = b.a_val
                B[e][o:o + r, b.b_idx] = b.b_val.t()
            o += r
    return A, B


def _targets_setting(picked: list[str], candidates: list[str]) -> str:
    """model.lora_targets naming exactly ``picked`` among ``candidates``: "all" when it is all's choice, else each
    name with its layer index as * where that picks no other candidate."""
    from moekit.models.lora import chosen

    if set(chosen(candidates, "all")) == set(picked):
        return "all"
    out: list[str] = []
    for name in picked:
        pattern = re.sub(r"^(layers|mtp)\.\d+\.", r"\1.*.", name)
        hits = {c for c in candidates if fnmatch.fnmatchcase(c, pattern)}
        choice = pattern if hits <= set(picked) else name
        if choice not in out:
            out.append(choice)
    return ",".join(out)


@torch.no_grad()
def load_peft(model, folder: str | Path, family: str | None = None) -> ImportReport:
    """Put the PEFT adapter ``folder`` onto ``model``, a one-process moekit model of the adapter's base checkpoint
    without adapters (``load_hf(BASE)``), as moekit LoRA adapters (module docstring): the model then computes what
    PEFT's does on the base, and its config says the adapters' rank, alpha and targets. ValueError (naming the file,
    the tensor and the fix) for an adapter of another model or a kind moekit cannot carry."""
    from moekit.models.hf import FAMILIES, export_rules
    from moekit.models.lora import add_lora, candidates, folded, has_lora, lora_scale

    folder = Path(folder)
    if has_lora(model):
        raise ValueError("the model already has LoRA adapters; import a PEFT adapter onto the plain base model")
    name, per_expert, _ = export_rules(model, family, None, "per_expert")
    fused = export_rules(model, name, None, "fused")[1]
    state = model.state_dict()
    where: dict[str, tuple[object, int]] = {}  # HF key -> (rule, its index among the rule's sources)
    hf_shapes: dict[str, tuple[int, ...]] = {}
    fused_params: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
    for rule in per_expert + fused:
        pieces = rule.split(torch.empty(state[rule.target].shape, device="meta"))  # shapes only: no memory
        for k, key in enumerate(rule.sources):
            if key not in where:
                where[key], hf_shapes[key] = (rule, k), tuple(pieces[k].shape)
    for rule in fused:
        for key in rule.sources:
            if len(hf_shapes[key]) == 3 and state[rule.target].dim() == 3:
                fused_params.setdefault(key.rsplit(".", 1)[0], []).append((key, hf_shapes[key]))
    for params in fused_params.values():  # registration order: gate_up_proj (from w_in) before down_proj
        params.sort(key=lambda p: where[p[0]][0].target)
    adapter = read_adapter(folder, fused_params, FAMILIES[name].naming.experts_transposed, hf_shapes)
    if not adapter.updates and not adapter.whole:
        raise _refuse(folder, "the adapter file holds no LoRA factors")
    dropout = float(adapter.config.get("lora_dropout") or 0.0)
    scales = Counter(round(u.scale, 12) for u in adapter.updates)
    scale = scales.most_common(1)[0][0] if scales else 1.0
    by_target: dict[str, list[tuple[int, Update]]] = {}
    for u in adapter.updates:
        if u.key not in where:
            raise _refuse(folder, f"{u.module}: the base checkpoint ({name}) has no {u.key}; is the adapter for "
                                  f"another model?")
        rule, k = where[u.key]
        by_target.setdefault(rule.target, []).append((k, u))
    cands = candidates(model)
    blocks: dict[str, dict[int | None, list[_Block]]] = {}
    widened: list[str] = []
    for target, ups in by_target.items():
        rule = where[ups[0][1].key][0]
        blocks[target] = _blocks(rule, tuple(state[target].shape), state[target].dim() == 3, ups, scale)
        if any(len(bs) > 1 for bs in blocks[target].values()):
            widened.append(target)
    adapted = [t for t in blocks if t in cands]
    merged = [t for t in blocks if t not in cands]
    used = {t: max(sum(b.a_val.shape[1] for b in bs) for bs in blocks[t].values()) for t in blocks}
    rank = max((used[t] for t in adapted), default=0)
    rslora = bool(adapter.config.get("use_rslora"))
    alpha = scale * (math.sqrt(rank) if rslora else rank) if rank else 0.0
    params = dict(model.named_parameters())
    replaced = []
    for key, t in adapter.whole.items():  # modules_to_save: the HF tensor PEFT trained, through its rule
        rule, k = where[key]
        pieces = list(rule.split(state[rule.target]))
        if torch.equal(pieces[k], t.to(pieces[k].dtype)):
            continue  # the base's own (PEFT saves targeted embedding layers whole)
        pieces[k] = t.to(pieces[k].dtype)
        params[rule.target].copy_(rule.join(pieces))
        replaced.append(rule.target)
    for target in merged:  # W += scale (B A): what PEFT computes, in the weight itself
        W = params[target]
        W.copy_(folded(W, *_factors(blocks[target], used[target], tuple(W.shape)), scale, expert=W.dim() == 3))
    if adapted:
        targets = _targets_setting(sorted(adapted, key=list(cands).index), list(cands))
        picked = add_lora(model, rank, alpha, targets, rslora=rslora, dropout=dropout)
        assert sorted(picked) == sorted(adapted), (picked, adapted)
        model.config = dataclasses.replace(model.config, lora_rank=rank, lora_alpha=alpha, lora_targets=targets,
                                           lora_rslora=rslora, lora_dropout=dropout)
        assert abs(lora_scale(rank, alpha, rslora) - scale) <= 1e-9 * scale
        params = dict(model.named_parameters())
        for target in adapted:
            prefix, leaf = target.rsplit(".", 1)
            side = "" if leaf == "weight" else "_" + leaf[2:]  # an expert stack's w_in -> lora_a_in
            for param, value in zip((params[f"{prefix}.lora_a{side}"], params[f"{prefix}.lora_b{side}"]),
                                    _factors(blocks[target], rank, tuple(state[target].shape))):
                param.copy_(value)
    return ImportReport(name, rank, alpha, adapted, widened, [t for t in adapted if used[t] < rank], merged, replaced,
                        dropout if adapted else 0.0, adapter)


def merged_hf_tensors(hf: dict[str, Tensor], adapter: Adapter) -> dict[str, Tensor]:
    """HF tensors with an adapter's updates added and its modules_to_save in place (float32 arithmetic, each tensor
    back in its dtype): the base checkpoint as PEFT computes it, for checking an import in HF terms."""
    out = dict(hf)
    for key, t in adapter.whole.items():
        out[key] = t.to(out[key].dtype)
    for u in adapter.updates:
        W = out[u.key]
        delta = u.scale * (u.L @ u.R)
        if u.expert is None:
            out[u.key] = (W.float() + delta).to(W.dtype)
        else:
            W = W.clone() if W is hf.get(u.key) else W
            W[u.expert] = (W[u.expert].float() + delta).to(W.dtype)
            out[u.key] = W
    return out
