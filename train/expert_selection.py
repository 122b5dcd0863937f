"""Which routed experts to fine-tune on a task: expert selection for expert-specialised fine-tuning (ESFT).

ESFT (DeepSeek, "Let the Expert Stick to His Last", 2024) fine-tunes only the routed experts a task actually
uses and freezes the rest of the model: less to train and store, and the experts other tasks rely on keep their
weights. ``moekit-eval RUN_OR_HF_DIR --data TASK.bin --split all --select-experts esft.json`` runs the model over
the task's windows (``--split all``: every window of the token file, the task's training data, not a held-out
slice) and scores every routed expert of every MoE layer by one of two criteria, each a share summing to 1 over
the layer's experts:

    token  (ESFT-Token)  slots routed to the expert / all kept slots of the layer (a token has top_k slots;
                         capacity-dropped slots count for no expert)
    gate   (ESFT-Gate)   the router's combine weights (``Routing.weights``) of the slots routed to the expert,
                         summed over tokens / the same sum over all experts
    reap   (REAP, 2025)  the mean over the tokens routed to the expert of its gate weight times the norm of its
                         output, g_e(x) ||f_e(x)||, normalised to sum 1: how much the expert adds when it is used,
                         not only how often (``ExpertRelevance(saliency=True)`` runs each layer's experts again on
                         its routed rows to measure the norms: moekit-eval --select-by reap)

Per layer the selection is the smallest set of experts, highest scores first (ties: the lower id first), whose
shares add up to at least the threshold p (``--select-threshold``, default 0.2). A layer whose routing is spread
evenly needs more experts to reach p than one where a few experts take the task; a layer with a dominant expert
may need one.

The file (``write_selection``; JSON, meant to be read and hand-edited: one line per layer, ``selected`` first)::

    {"format": "moekit-expert-selection", "version": 1, "criterion": "token" | "gate", "threshold": 0.2,
     "model": "<model config name>", "tokens": <tokens evaluated>,
     "source": {"path", "checkpoint", "step", "data", "split", "seq_len", "windows", "capacity"},
     "layers": [{"name": "layers.1.ffn", "experts_count": 16, "selected": [3, 7, 9], "covered": 0.23,
                 "token_share": [E floats], "gate_share": [E floats]}, ...]}

``covered`` is the chosen criterion's share the selected experts hold (>= threshold); the shares are for reading
(6 significant digits), the selection is ``selected`` alone. Layer names are ``moe_layers(model)``'s
(``layers.1.ffn``; an MTP depth's ``mtp.0.block.ffn``). An empty ``selected`` is valid: no expert of that layer trains.

Training with it: ``moekit-train ... --train.trainable '*.experts.*' --train.train_experts esft.json``: the
trainable pattern freezes every parameter but the routed experts' weights, and the selection file narrows those
to the listed experts' rows of each layer's expert weights (the trainer reads it with ``read_selection``, which
checks it against the model being trained: every MoE layer present, each with the model's number of experts).
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import torch

from moekit.moe.load import in_backward, moe_layers
from moekit.train import UserError

FORMAT = "moekit-expert-selection"
VERSION = 1
CRITERIA = ("token", "gate", "reap")
DEFAULT_THRESHOLD = 0.2
TOLERANCE = 1e-12  # a cumulative share this close below the threshold reaches it (floating-point sums)
SHARE_DIGITS = 6  # significant digits of the shares written to the file (for reading; not used by read_selection)


class ExpertRelevance:
    """Scores every routed expert of a model's MoE layers while the model runs: ``attach(model)``, forwards
    (``begin_batch(x)`` before each counts the input tokens, as moekit.train.evaluation.evaluate's observer
    protocol calls it), ``result()``, ``detach()``.

    Per layer it keeps, on the routing's device, the kept slots per expert (int64: exact counts) and the summed
    combine weight per expert (float64), added by a forward hook on the layer's router without a host sync;
    ``result()`` moves them to the host once. Forwards recomputed inside backward (activation checkpointing)
    are not counted twice."""

    def __init__(self, saliency: bool = False):
        self.layers: dict[str, dict] = {}
        self.handles: list = []
        self.tokens = 0  # input tokens told by begin_batch
        self.saliency = saliency  # also REAP's g_e(x) ||f_e(x)|| per expert (the experts run again on their rows)
        self.modules: dict[str, torch.nn.Module] = {}

    def attach(self, model: torch.nn.Module) -> "ExpertRelevance":
        for name, layer in moe_layers(model):
            self.layers[name] = {"E": layer.num_experts, "slots": None, "gate": None, "routed": 0, "dropped": None,
                                 "saliency": None}
            self.modules[name] = layer
            self.handles.append(layer.router.register_forward_hook(
                lambda _m, args, routing, name=name: self._record(name, routing, args[0])))
        if not self.layers:
            raise UserError("the model has no MoE layers: there are no routed experts to select")
        return self

    def detach(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def begin_batch(self, x: torch.Tensor) -> None:
        """``x`` [b, S] the input token ids of the next forward."""
        self.tokens += x.numel()

    def _record(self, name: str, routing, x: torch.Tensor | None = None) -> None:
        if in_backward():
            return
        if self.saliency and x is not None:
            self._saliency(name, routing, x)
        st = self.layers[name]
        E = st["E"]
        idx, w = routing.indices.detach(), routing.weights.detach()  # [T, k] expert per slot (-1: dropped), weight
        if idx.device.type == "mps":  # no float64 there: count on the host
            idx, w = idx.cpu(), w.cpu()
        kept = (idx >= 0) & (idx < E)
        col = torch.where(kept, idx, E).flatten().long()  # dropped slots land in a spare bin E, cut below
        # index_add_, not bincount: bincount's output size needs the max on the host (a sync on CUDA)
        slots = torch.zeros(E + 1, dtype=torch.int64, device=idx.device).index_add_(
            0, col, torch.ones_like(col))[:E]
        gate = torch.zeros(E + 1, dtype=torch.float64, device=idx.device).index_add_(
            0, col, torch.where(kept, w, 0).flatten().to(torch.float64))[:E]
        dropped = (~kept).sum()
        if st["slots"] is None:
            st["slots"], st["gate"], st["dropped"] = slots, gate, dropped
        else:
            st["slots"] += slots
            st["gate"] += gate
            st["dropped"] += dropped
        st["routed"] += idx.shape[0]

    @torch.no_grad()
    def _saliency(self, name: str, routing, x: torch.Tensor) -> None:
        """Add each expert's sum of g_e(x) ||f_e(x)|| over its kept slots: the layer's experts run on the rows
        routed to them (the router's input x [T, H], grouped by expert as a dispatch groups them)."""
        layer, st = self.modules[name], self.layers[name]
        E = st["E"]
        experts = layer.experts
        if getattr(experts, "num_experts", E) != E:  # expert parallelism: this rank holds some experts only
            raise UserError(f"{name}: the REAP criterion runs every expert on its tokens; score it in one process")
        idx, w = routing.indices.detach().flatten(), routing.weights.detach().flatten()
        token = torch.arange(x.shape[0], device=x.device).repeat_interleave(routing.indices.shape[1])
        kept = (idx >= 0) & (idx < E)
        idx, w, token = idx[kept], w[kept], token[kept]
        order = torch.argsort(idx, stable=True)
        counts = torch.zeros(E, dtype=torch.int64, device=x.device).index_add_(0, idx, torch.ones_like(idx))
        rows = x.detach()[token[order]]
        from moekit.moe.precision import compute_dtype

        out = experts(rows.to(compute_dtype(rows)), counts)  # [N, H] expert-major, as the layer computes them
        value = out.float().norm(dim=-1).double() * w[order].double()
        total = torch.zeros(E, dtype=torch.float64, device=x.device).index_add_(0, idx[order], value)
        st["saliency"] = total if st["saliency"] is None else st["saliency"] + total

    def result(self) -> dict:
        """{"tokens": input tokens (begin_batch's; without it, the most tokens a layer routed), "layers": [{name,
        experts_count, tokens (routed by the layer), slots [E], dropped (slots), gate [E] (summed combine
        weights), token_share [E], gate_share [E]}]}; the shares are 0 in a layer that saw no tokens."""
        layers = []
        for name, st in self.layers.items():
            E = st["E"]
            slots = st["slots"].cpu().numpy().astype(np.int64) if st["slots"] is not None else np.zeros(E, np.int64)
            gate = st["gate"].cpu().numpy() if st["gate"] is not None else np.zeros(E)
            n_slots, n_gate = int(slots.sum()), float(gate.sum())
            layers.append({"name": name, "experts_count": E, "tokens": st["routed"], "slots": slots.tolist(),
                           "dropped": int(st["dropped"]) if st["dropped"] is not None else 0, "gate": gate.tolist(),
                           "token_share": (slots / n_slots if n_slots else np.zeros(E)).tolist(),
                           "gate_share": (gate / n_gate if n_gate > 0 else np.zeros(E)).tolist()})
            if self.saliency:  # REAP: the mean over an expert's slots of g ||f||, as shares of the layer's sum
                total = st["saliency"].cpu().numpy() if st["saliency"] is not None else np.zeros(E)
                mean = np.divide(total, slots, out=np.zeros(E), where=slots > 0)
                layers[-1]["reap"] = mean.tolist()
                layers[-1]["reap_share"] = (mean / mean.sum() if mean.sum() > 0 else np.zeros(E)).tolist()
        tokens = self.tokens or max((layer["tokens"] for layer in layers), default=0)
        return {"tokens": int(tokens), "layers": layers}


def select(scores, threshold: float, layer: str = "scores") -> list[int]:
    """The smallest set of experts whose ``scores`` (any non-negative numbers; taken as shares of their sum)
    reach ``threshold`` (0 < threshold <= 1) of the total: highest scores first, ties the lower id first, taken
    until the cumulative share >= threshold (less TOLERANCE, for floating-point sums). Sorted ids. Experts with
    score 0 are never needed. All scores 0 (the layer saw no tokens): a UserError naming ``layer``."""
    check_threshold(threshold, "threshold")
    s = np.asarray(scores, dtype=np.float64)
    if s.ndim != 1 or not np.isfinite(s).all() or (s < 0).any():
        raise ValueError(f"{layer}: scores must be a list of finite numbers >= 0, got {scores!r}")
    total = s.sum()
    if not total > 0:
        raise UserError(f"{layer}: no token was routed to any expert, so there is nothing to select experts by; "
                        f"evaluate more (or other) data")
    order = np.lexsort((np.arange(s.size), -s))  # score descending, then id ascending
    reached = np.cumsum(s[order] / total) >= threshold - TOLERANCE  # False ... False True ... True
    count = int(reached.argmax()) + 1 if reached.any() else s.size  # the shortest prefix that reaches it
    return sorted(order[:count].tolist())


def check_threshold(value, what: str = "--select-threshold") -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and 0 < value <= 1
    if not ok:
        raise UserError(f"{what} {value!r} is invalid; it must be a share in (0, 1]: the part of each layer's "
                        f"routing the selected experts hold (ESFT's p, e.g. 0.1 or 0.2)")


def _digits(values) -> list[float]:
    return [float(f"{v:.{SHARE_DIGITS}g}") for v in values]


def selection_record(relevance: dict, criterion: str, threshold: float, model_name: str, source: dict) -> dict:
    """The file's content (module docstring) from ``ExpertRelevance.result()``: per layer the experts
    ``select`` picks by ``criterion`` ("token", "gate", or "reap" from ExpertRelevance(saliency=True)) at
    ``threshold``."""
    if criterion not in CRITERIA:
        raise UserError(f"criterion {criterion!r} is invalid; choose one of {', '.join(CRITERIA)}")
    check_threshold(threshold, "threshold")
    layers = []
    for layer in relevance["layers"]:
        if f"{criterion}_share" not in layer:
            raise UserError(f"criterion {criterion!r}: the scores have no {criterion}_share (REAP's needs "
                            f"ExpertRelevance(saliency=True), moekit-eval --select-by reap)")
        shares = layer[f"{criterion}_share"]
        chosen = select(shares, threshold, layer=f"MoE layer {layer['name']}")
        layers.append({"name": layer["name"], "experts_count": layer["experts_count"], "selected": chosen,
                       "covered": float(f"{math.fsum(shares[e] for e in chosen):.{SHARE_DIGITS}g}"),
                       "token_share": _digits(layer["token_share"]), "gate_share": _digits(layer["gate_share"])})
        if "reap_share" in layer:
            layers[-1]["reap_share"] = _digits(layer["reap_share"])
    return {"format": FORMAT, "version": VERSION, "criterion": criterion, "threshold": threshold,
            "model": model_name, "tokens": int(relevance["tokens"]), "source": source, "layers": layers}


def dumps(record: dict) -> str:
    """The record as JSON for people: one key a line, one line per layer."""
    head = [f" {json.dumps(k)}: {json.dumps(v)}," for k, v in record.items() if k != "layers"]
    layers = ",\n".join(f"  {json.dumps(layer)}" for layer in record["layers"])
    return "{\n" + "\n".join(head) + '\n "layers": [\n' + layers + "\n ]\n}\n"


def write_selection(path: str | Path, record: dict) -> None:
    """Write the record (through a partial file: a failed write leaves no half file under ``path``)."""
    path = Path(path)
    part = path.with_name(f"{path.name}.partial")
    try:
        part.write_text(dumps(record), encoding="utf-8")
        os.replace(part, path)
    except OSError as exc:
        from moekit.train.runlock import describe_os_error

        part.unlink(missing_ok=True)
        raise UserError(f"--select-experts {path}: cannot write it: {describe_os_error(exc)}") from None


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def read_selection(path: str | Path, layers: dict[str, int]) -> dict[str, tuple[int, ...]]:
    """The selected experts of each MoE layer, from a file ``write_selection`` wrote (or a person edited), checked
    against the model being trained: ``layers`` maps each of its MoE layer names (``moe_layers(model)``'s) to its
    number of experts. Returns layer name -> sorted expert ids (empty: no expert of that layer trains). Every
    problem is a UserError naming the file and the fix."""
    redo = f"write it with moekit-eval RUN_OR_HF_DIR --data TASK.bin --split all --select-experts {path}"
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        from moekit.train.runlock import describe_os_error

        why = describe_os_error(exc) if isinstance(exc, OSError) else f"not UTF-8 text ({exc.reason})"
        raise UserError(f"expert selection {path}: cannot read it: {why}; {redo}") from None
    try:
        record = json.loads(text)
    except ValueError as exc:
        raise UserError(f"expert selection {path}: not JSON ({exc}); fix the edit or {redo}") from None
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        got = record.get("format") if isinstance(record, dict) else type(record).__name__
        raise UserError(f"expert selection {path}: not an expert selection file (format {got!r}, expected "
                        f"{FORMAT!r}); {redo}")
    if record.get("version") != VERSION:
        raise UserError(f"expert selection {path}: version {record.get('version')!r} is not supported (this moekit "
                        f"reads version {VERSION}); {redo} with this moekit")
    entries = record.get("layers")
    if not isinstance(entries, list) or not all(isinstance(e, dict) and isinstance(e.get("name"), str)
                                                for e in entries):
        raise UserError(f"expert selection {path}: \"layers\" must be a list of {{\"name\", \"experts_count\", "
                        f"\"selected\"}} objects; {redo}")
    by_name: dict[str, dict] = {}
    for e in entries:
        if e["name"] in by_name:
            raise UserError(f"expert selection {path}: layer {e['name']} is listed twice; keep one entry")
        by_name[e["name"]] = e
    missing = [n for n in layers if n not in by_name]
    extra = [n for n in by_name if n not in layers]
    other = f"the file was written for another model (the model's MoE layers: {', '.join(layers) or 'none'})"
    if missing:
        raise UserError(f"expert selection {path}: no entry for the model's MoE layer{'s' * (len(missing) > 1)} "
                        f"{', '.join(missing)}; {other}; {redo} from this model")
    if extra:
        raise UserError(f"expert selection {path}: layer{'s' * (len(extra) > 1)} {', '.join(extra)} "
                        f"{'are' if len(extra) > 1 else 'is'} not a MoE layer of the model; {other}; {redo} from "
                        f"this model")
    out = {}
    for name, E in layers.items():
        e = by_name[name]
        count = e.get("experts_count")
        if count != E or not _is_int(count):
            raise UserError(f"expert selection {path}: layer {name} has experts_count {count!r}, the model's has "
                            f"{E} experts; the file was written for another model: {redo} from this model")
        chosen = e.get("selected")
        if not isinstance(chosen, list):
            raise UserError(f"expert selection {path}: layer {name}: \"selected\" must be a list of expert ids "
                            f"(0..{E - 1}; [] for none), got {chosen!r}")
        bad = [v for v in chosen if not _is_int(v) or not 0 <= v < E]
        if bad:
            raise UserError(f"expert selection {path}: layer {name}: expert id {bad[0]!r} is invalid; ids are "
                            f"integers 0..{E - 1}")
        if len(set(chosen)) != len(chosen):
            dup = next(v for v in chosen if chosen.count(v) > 1)
            raise UserError(f"expert selection {path}: layer {name}: expert {dup} is selected twice; list each "
                            f"expert once")
        out[name] = tuple(sorted(chosen))
    return out


def report(record: dict, path: str | Path, ids: int = 16) -> str:
    """The stdout table: per layer the experts selected / E, the share they cover and their ids (the first
    ``ids`` of them; the file has all), then the training command."""
    what = "ESFT-Token: share of routed slots" if record["criterion"] == "token" else \
        "ESFT-Gate: share of summed gate weights"
    out = [f"expert selection ({what}; threshold {record['threshold']:g}): {record['tokens']:,} tokens, "
           f"{len(record['layers'])} MoE layers -> {path}",
           f"  {'layer':<16} {'selected':>9} {'covered':>8}  experts"]
    for layer in record["layers"]:
        sel = layer["selected"]
        shown = " ".join(map(str, sel[:ids])) + (f" ... (+{len(sel) - ids} more)" if len(sel) > ids else "")
        out.append(f"  {layer['name']:<16} {len(sel):>4}/{layer['experts_count']:<4} {100 * layer['covered']:>7.1f}%  "
                   f"{shown or '-'}")
    out.append(f"fine-tune only these experts (ESFT): moekit-train ... --train.trainable '*.experts.*' "
               f"--train.train_experts {path}")
    return "\n".join(out)
