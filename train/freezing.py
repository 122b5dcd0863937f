"""Partial fine-tuning: which parameters train, and inside the routed-expert stacks, which experts.

    --train.trainable PATTERNS      only the parameters these name train ("" = all of them)
    --train.freeze PATTERNS         these stay as they are (applied after --train.trainable)
    --train.train_experts FILE      in each MoE layer, only the experts FILE lists train (expert-specialised
                                    fine-tuning, ESFT: FILE from ``moekit-eval --select-experts``)
    --train.lr_scale PAT=F,...      the parameters a pattern names train at lr x F (optimizer groups of their own,
                                    ``optimizer_groups``; the first matching pattern wins)

PATTERNS are comma-separated shell-style patterns (fnmatch: ``*`` matches across dots) over the one-process
parameter names, whatever the layout: ``embed.weight``, ``layers.3.attn.wq.weight``,
``layers.3.ffn.router.weight``, ``layers.3.ffn.experts.w_in`` (a layer's [E, ...] expert stack),
``layers.3.ffn.shared_expert.*``, ``norm.weight``, ``lm_head.weight``, ``mtp.0.*``. A router's aux-loss-free
``expert_bias`` is named too (``layers.3.ffn.router.expert_bias``): freezing it stops its per-step update, so
``--train.freeze '*.router.*'`` keeps the routing as it was. Every pattern must name something, and something
must train; both are checked before anything is built.

How a frozen parameter is held: ``requires_grad`` is off, so autograd computes no weight gradient for it (the
gradients of activations still flow through it), no gradient is reduced across ranks, and the optimizer holds
no state for it (AdamW's two moments: 8 bytes per frozen fp32 weight saved). It is still saved in checkpoints
and exported.

How a frozen expert is held (``train_experts``): the expert stacks stay one tensor per layer (the grouped GEMMs
and expert parallelism need them whole), so each stack is tagged with ``expert_trainable``, a [slots] bool mask of
its local rows (under expert parallelism and load-aware placement: the logical expert each slot holds,
``dispatcher.local_expert_ids``; re-tagged after every rebalance). After the gradients are reduced, the frozen
rows' gradients are set to zero (``mask_gradients``), so the gradient norm and clipping count the trained rows
alone. AdamW and Muon then leave those rows exactly as they are: with zero gradients their moments stay zero and
their update is 0 / (0 + eps) = 0. Their decoupled weight decay would still shrink them, so these stacks sit in
optimizer groups of their own with ``weight_decay`` 0 and ``row_decay`` set to the run's decay, which
``decay_rows`` applies to the trained rows just before the optimizer step: the same ``w * (1 - lr * wd)`` the
optimizer would have applied, in the same order, so a trained row's update is bitwise the one a fully trained
model's row gets from the same gradient.

A resumed run must keep the same choice (moekit.train.resume refuses a change): its optimizer state holds the
parameters that trained.
"""
from __future__ import annotations

import fnmatch
import math
import re
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from moekit.models.init import fold_layer_indices
from moekit.models.lora import is_adapter
from moekit.moe.load import moe_layers
from moekit.train import UserError

BIAS = "router.expert_bias"  # the one trained state that is not a parameter (aux-loss-free balancing)


def patterns(setting: str) -> tuple[str, ...]:
    """"a, b" -> ("a", "b")."""
    return tuple(p.strip() for p in setting.split(",") if p.strip())


def requested(cfg) -> bool:
    """Whether the run asks for any partial training (LoRA adapters, model.lora_rank > 0, are partial training:
    the adapters train, the base weights do not)."""
    t = cfg.train
    return bool(patterns(t.trainable) or patterns(t.freeze) or t.train_experts or lora(cfg))


def lora(cfg) -> bool:
    return bool(getattr(getattr(cfg, "model", None), "lora_rank", 0))


def lr_scales(setting: str) -> list[tuple[str, float]]:
    """"PATTERN=FACTOR,..." -> [(pattern, factor)] (--train.lr_scale); a UserError for a malformed entry."""
    out = []
    for entry in patterns(setting):
        pat, eq, value = entry.rpartition("=")
        try:
            factor = float(value)
        except ValueError:
            factor = math.nan
        if not eq or not pat.strip() or not (math.isfinite(factor) and factor > 0):
            raise UserError(f"--train.lr_scale entry {entry!r} is invalid; write PATTERN=FACTOR with a factor > 0, e.g. "
                            f"'*.router.*=0.1' (several: comma-separated, the first matching pattern wins)")
        out.append((pat.strip(), factor))
    return out


def scale_of(name: str, scales: list[tuple[str, float]]) -> float:
    """The learning-rate factor of parameter ``name``: its first matching --train.lr_scale pattern's, else 1."""
    return next((f for pat, f in scales if fnmatch.fnmatchcase(name, pat)), 1.0)


def check_lr_scales(model: nn.Module, cfg) -> None:
    """Every --train.lr_scale pattern names a parameter, and every scaled lr is a valid one (as --train.lr is)."""
    from moekit.train.config import MAX_LR

    t = cfg.train
    names = [n for n, _ in model.named_parameters()]
    for pat, factor in lr_scales(t.lr_scale):
        if not any(fnmatch.fnmatchcase(n, pat) for n in names):
            shown = collapse(names)
            raise UserError(f"--train.lr_scale pattern {pat!r} names no parameter of this model; its parameters are "
                            f"{', '.join(shown[:40])}{' ...' if len(shown) > 40 else ''} (N: a layer index)")
        lr = t.lr * factor
        if lr > MAX_LR or lr * t.weight_decay >= 1:
            raise UserError(f"--train.lr_scale {pat}={factor:g}: lr {t.lr:g} x {factor:g} = {lr:g} is invalid; the "
                            f"scaled learning rate must be at most {MAX_LR:g}, with lr x weight_decay < 1")


def collapse(names) -> list[str]:
    """Names with layer indices folded (``layers.N.attn.wq.weight``), in first-seen order: for messages."""
    return fold_layer_indices(names)


@dataclass
class FreezePlan:
    """What trains, by one-process name (``plan``): ``trainable`` parameters, ``frozen`` ones and frozen router
    biases, and per MoE layer the experts that train (None: every expert of a trainable stack)."""

    trainable: set[str]
    frozen: set[str]
    frozen_biases: set[str]  # MoE layer names whose router's expert_bias stays as it is
    experts: dict[str, tuple[int, ...]] | None = None
    counts: dict[str, int] = field(default_factory=dict)  # trainable / total parameters (expert rows pro rata)
    routers_frozen: bool = False  # every MoE layer's gate is frozen
    lora: str = ""  # with LoRA adapters (model.lora_rank): what carries them, for the opening line

    def describe(self) -> str:
        t, n = self.counts.get("trainable", 0), self.counts.get("total", 0)
        share = f"{100 * t / n:.1f}%" if n else "-"
        line = f"partial training: {_size(t)} of {_size(n)} parameters train ({share})"
        if self.lora:
            line = f"{self.lora}; {line}; the base weights are frozen"
            extra = sorted((n for n in self.trainable if not is_adapter(n)), key=_order)
            if extra:
                shown = collapse(extra)
                line += f" except {', '.join(shown[:8])}{' ...' if len(shown) > 8 else ''}"
        elif self.frozen:
            shown = collapse(sorted(self.frozen, key=_order))
            line += f"; frozen: {', '.join(shown[:8])}{' ...' if len(shown) > 8 else ''}"
        if self.frozen_biases:
            line += f"; router expert_bias frozen in {len(self.frozen_biases)} layer(s)"
        if self.experts is not None:
            picked = [len(v) for v in self.experts.values()]
            line += (f"; experts: {sum(picked)} of {self.counts.get('experts', 0)} train "
                     f"({min(picked, default=0)}-{max(picked, default=0)} per layer)")
        return line


def _size(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def _order(name: str):
    return [int(x) if x.isdigit() else x for x in name.split(".")]


def plan(model: nn.Module, cfg) -> FreezePlan | None:
    """The run's FreezePlan from ``model`` (the whole one-process model; the meta device will do) and cfg.train's
    trainable / freeze / train_experts, or None when the run trains everything. Every problem is a UserError."""
    if not requested(cfg):
        return None
    t = cfg.train
    keep, drop = patterns(t.trainable), patterns(t.freeze)
    params = dict(model.named_parameters())
    layers = dict(moe_layers(model))
    biases = {f"{name}.{BIAS}": name for name, layer in layers.items()
              if getattr(layer.router, "expert_bias", None) is not None}
    names = list(params) + list(biases)
    for flag, pats in (("--train.trainable", keep), ("--train.freeze", drop)):
        for pat in pats:
            if not any(fnmatch.fnmatchcase(n, pat) for n in names):
                shown = collapse(names)
                raise UserError(f"{flag} pattern {pat!r} names no parameter of this model; its parameters are "
                                f"{', '.join(shown[:40])}{' ...' if len(shown) > 40 else ''} (N: a layer index; "
                                f"* matches any characters, dots too)")

    adapters = lora(cfg)

    def trains(name: str) -> bool:
        if adapters:  # LoRA: the adapters, and what --train.trainable adds; the base weights stay
            picked = is_adapter(name) or any(fnmatch.fnmatchcase(name, p) for p in keep)
        else:
            picked = not keep or any(fnmatch.fnmatchcase(name, p) for p in keep)
        return picked and not any(fnmatch.fnmatchcase(name, p) for p in drop)

    trainable = {n for n in params if trains(n)}
    frozen = set(params) - trainable
    frozen_biases = {layer for b, layer in biases.items() if not trains(b)}
    if not trainable:
        raise UserError(f"--train.trainable {t.trainable!r} / --train.freeze {t.freeze!r} leave no parameter to "
                        f"train; name at least one that should")
    experts = None
    if t.train_experts:
        from moekit.train.expert_selection import read_selection

        experts = read_selection(t.train_experts, {n: layer.num_experts for n, layer in layers.items()})
        for name, layer in layers.items():
            stacks = [f"{name}.experts.{p}" for p in layer.experts.param_names()]
            if adapters:  # LoRA: the chosen experts' adapters train, their frozen base rows stay (ESFT on adapters)
                stacks = [s for s in stacks if is_adapter(s)] or stacks
            idle = [s for s in stacks if s not in trainable]
            if idle and experts.get(name):
                fix = ("give the experts adapters (--model.lora_targets '*.experts.*' or all)" if adapters and
                       not any(is_adapter(s) for s in stacks) else "let them train (e.g. --train.trainable '*.experts.*')")
                raise UserError(f"--train.train_experts {t.train_experts} picks experts {list(experts[name])} of "
                                f"{name}, but --train.trainable / --train.freeze freeze its expert weights "
                                f"({', '.join(idle)}); {fix}")
    if t.qk_clip:
        frozen_qk = sorted(n for n in frozen if re.search(r"\.attn\.(wq|wk|wq_a|wq_b|wkv_a|wkv_b)\b", n))
        if frozen_qk:
            raise UserError(f"--train.qk_clip {t.qk_clip} rescales query and key weights after each step, but "
                            f"{', '.join(collapse(frozen_qk)[:4])} are frozen; drop --train.qk_clip (frozen "
                            f"weights cannot raise the logits) or let the attention train")
    out = FreezePlan(trainable, frozen, frozen_biases, experts)
    gates = [f"{n}.router.weight" for n in layers if f"{n}.router.weight" in params]
    out.routers_frozen = bool(gates) and all(g in frozen for g in gates)
    if adapters:
        m = cfg.model
        carriers = {n.rsplit(".", 1)[0] for n in params if is_adapter(n)}
        out.lora = (f"LoRA rank {m.lora_rank}, alpha {m.lora_alpha:g}{' (rsLoRA)' if m.lora_rslora else ''}"
                    f"{f', dropout {m.lora_dropout:g}' if m.lora_dropout else ''} on "
                    f"{len(carriers)} module(s) ({m.lora_targets})")
    out.counts = _counts(params, layers, trainable, experts)
    return out


def _counts(params: dict, layers: dict, trainable: set[str], experts) -> dict[str, int]:
    rows = {}  # expert stack name -> share of its rows that train
    total_experts = 0
    for name, layer in layers.items():
        total_experts += layer.num_experts
        if experts is not None:
            for p in layer.experts.param_names():
                rows[f"{name}.experts.{p}"] = len(experts.get(name, ())) / layer.num_experts
    total = sum(p.numel() for p in params.values())
    train = sum(p.numel() * rows.get(n, 1.0) for n, p in params.items() if n in trainable)
    return {"total": int(total), "trainable": int(round(train)), "experts": total_experts}


def _local(t: Tensor) -> Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def slot_experts(layer: nn.Module) -> list[int]:
    """The logical expert of each local row of ``layer``'s expert stacks (this rank's slots under expert
    parallelism and placement; all experts in one process)."""
    ids = getattr(layer.dispatcher, "local_expert_ids", None)
    return [int(e) for e in ids] if ids is not None else list(range(layer.num_experts))


def apply(model: nn.Module, fp: FreezePlan | None) -> None:
    """Turn ``fp`` on for ``model`` (this rank's share, one-process names; after it is parallelised and its
    storage allocated, before the optimizer is made): requires_grad, frozen router biases, expert row masks."""
    if fp is None:
        return
    for name, p in model.named_parameters():
        if name not in fp.trainable and name not in fp.frozen:
            raise RuntimeError(f"parameter {name} is not in the freeze plan (made from another model)")
        p.requires_grad_(name in fp.trainable)
    for name, layer in moe_layers(model):
        if name in fp.frozen_biases:
            layer.router.bias_update_rate = 0.0  # the bias stays; observe_load stops collecting for it
    tag_experts(model, fp)


def tag_experts(model: nn.Module, fp: FreezePlan | None) -> None:
    """Mark each trainable expert stack with ``expert_trainable`` ([local slots] bool) under ``fp.experts``. Call
    after ``apply`` and again after every rebalance (the slots hold other experts then)."""
    if fp is None or fp.experts is None:
        return
    for name, layer in moe_layers(model):
        chosen = set(fp.experts.get(name, ()))
        slots = slot_experts(layer)
        for pname in layer.experts.param_names():
            p = getattr(layer.experts, pname)
            if not p.requires_grad:
                continue
            w = _local(p)
            if w.shape[0] != len(slots):
                raise RuntimeError(f"{name}.experts.{pname}: {w.shape[0]} local rows for {len(slots)} expert slots")
            p.expert_trainable = torch.tensor([e in chosen for e in slots], dtype=torch.bool, device=w.device)


def _row_mask(mask: Tensor, like: Tensor) -> Tensor:
    return mask.to(like.device).view((-1,) + (1,) * (like.dim() - 1))


@torch.no_grad()
def mask_gradients(params) -> None:
    """Zero the gradients of frozen expert rows (after the gradients are reduced, before their norm)."""
    for p in params:
        mask = getattr(p, "expert_trainable", None)
        if mask is not None and p.grad is not None:
            g = _local(p.grad)
            g.masked_fill_(~_row_mask(mask, g), 0)


def optimizer_groups(groups: list[dict], fp: FreezePlan | None, model: nn.Module | None = None, lr: float = 0.0,
                     scales: list[tuple[str, float]] | None = None) -> list[dict]:
    """The optimizer's parameter groups without frozen parameters; with ``fp.experts``, each group followed by one
    holding its masked expert stacks (``weight_decay`` 0, ``row_decay`` the group's: ``decay_rows``); with
    ``scales`` (--train.lr_scale; ``model`` names the parameters), each group split further by learning-rate factor,
    a scaled one holding ``lr`` x factor and ``lr_scale``. Groups left empty are dropped: torch's distributed
    optimizer state dict (DCP checkpoints) takes at most one."""
    if fp is None and not scales:
        return groups
    names = {id(p): n for n, p in model.named_parameters()} if scales else {}
    out = []
    for g in groups:
        chunks = g.get("chunks")
        split: dict[tuple[bool, float], list[int]] = {}  # (masked rows, lr factor) -> indices into g["params"]
        for i, p in enumerate(g["params"]):
            if p.requires_grad:
                rows = fp is not None and getattr(p, "expert_trainable", None) is not None
                split.setdefault((rows, scale_of(names[id(p)], scales) if scales else 1.0), []).append(i)

        def pick(idx: list[int], **extra) -> dict:
            d = {**g, "params": [g["params"][i] for i in idx], **extra}
            if chunks is not None:
                d["chunks"] = [chunks[i] for i in idx]
            return d

        factors = sorted({f for _, f in split} | {1.0}, key=lambda f: (f != 1.0, f))  # unscaled first
        for factor in factors:
            extra = {} if factor == 1.0 else {"lr": lr * factor, "lr_scale": factor}
            out.append(pick(split.get((False, factor), []), **extra))
            if fp is not None and fp.experts is not None:
                out.append(pick(split.get((True, factor), []), weight_decay=0.0,
                                row_decay=g.get("weight_decay", 0.0), **extra))
    return [g for g in out if g["params"]] or [out[0]]


@torch.no_grad()
def decay_rows(optimizer) -> None:
    """Decoupled weight decay on the trained rows of masked expert stacks (groups with ``row_decay``), just before
    ``optimizer.step()``: AdamW and Muon decay first as well, so the trained rows end exactly as unmasked ones."""
    for g in optimizer.param_groups:
        wd = g.get("row_decay", 0.0)
        if not wd:
            continue
        factor = 1 - g["lr"] * wd
        for p in g["params"]:
            w = _local(p)
            # in the optimizer's arithmetic (a bf16 weight times an fp32 factor), not a factor rounded to bf16
            scale = torch.where(_row_mask(p.expert_trainable, w), factor, 1.0)
            w.mul_(scale.to(torch.promote_types(w.dtype, torch.float32)))
