"""Expert specialisation: which tokens each expert receives, from a checkpoint run over data.

``moekit-eval RUN --specialisation`` (stdout table, ``--out`` JSON) and ``moekit-heatmap --specialisation``
(a section of the HTML report; RUN/specialisation.json, computed when missing) run the model over the
evaluation windows and, in every MoE layer, attribute each routed slot to the input token at that
position (its id, and its position in the window). Per layer:

    expert_share       [E] share of the layer's kept slots per expert
    position_share     [P, E] per position bucket (0, 1, 2-3, 4-7, ..., powers of two), the share of that
                       bucket's slots per expert: do some experts take the first tokens of a window?
    experts            per expert: share, and top_tokens: the token ids it receives, ranked by
                       count x specificity, where count = slots of that id routed to the expert and
                       specificity = count / occurrences of the id (the share of the id's occurrences the
                       expert takes, 0..1)
    tokens             the most frequent token ids: occurrences, their top experts and specificities
    token_concentration  occurrence-weighted mean over token ids of the largest specificity: 1 when every
                       occurrence of an id goes to the same expert (hash routing); about k/E when routing
                       ignores the token id
Token text comes from the run's tokenizer (moekit.train.tokenizer.load_tokenizer); ids are shown as #id
when the run recorded none. Counts are kept sparse (expert x token-id pairs seen), so large vocabularies
cost memory in proportion to the tokens evaluated, not to E x V.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch

from moekit.moe.load import moe_layers
from moekit.train import UserError

SPEC_FILE = "specialisation.json"
TOP_TOKENS = 8  # per expert
FREQUENT_TOKENS = 20  # per layer: the most frequent ids and where they go
COMPACT_EVERY = 1 << 22  # pending (expert, token) pairs before they are folded into the sparse counts
DEFAULT_TOKENS = 32768  # tokens evaluated by for_run_dir


def position_buckets(seq_len: int) -> tuple[np.ndarray, list[str]]:
    """([seq_len] bucket of each position, bucket labels): 0, 1, 2-3, 4-7, ... (powers of two)."""
    pos = np.arange(seq_len)
    bucket = np.where(pos == 0, 0, np.floor(np.log2(np.maximum(pos, 1))).astype(np.int64) + 1)
    labels = []
    for b in range(int(bucket.max()) + 1):
        lo, hi = (0, 0) if b == 0 else (2 ** (b - 1), min(2**b - 1, seq_len - 1))
        labels.append(str(lo) if lo == hi else f"{lo}-{hi}")
    return bucket, labels


def token_text(tokenizer, tok: int) -> str:
    """A token id as readable text: its decoded string with whitespace made visible, or #id."""
    if tokenizer is None:
        return f"#{tok}"
    if getattr(tokenizer, "kind", "") == "bytes":
        if 32 < tok < 127:
            return chr(tok)
        return {32: "\u2423", 10: "\\n", 9: "\\t", 13: "\\r"}.get(tok, f"<0x{tok:02x}>" if tok < 256 else f"#{tok}")
    try:
        text = tokenizer.decode([tok])
    except Exception:  # an id the tokenizer cannot decode alone
        return f"#{tok}"
    if not text:
        return f"#{tok}"
    return text.replace(" ", "\u2423").replace("\n", "\\n").replace("\t", "\\t")


class _Sparse:
    """Counts of int64 keys, accumulated in batches and folded with np.unique."""

    def __init__(self):
        self.keys = np.zeros(0, dtype=np.int64)
        self.counts = np.zeros(0, dtype=np.int64)
        self.pending: list[np.ndarray] = []
        self.size = 0

    def add(self, keys: np.ndarray) -> None:
        self.pending.append(keys)
        self.size += keys.size
        if self.size > COMPACT_EVERY:
            self.compact()

    def compact(self) -> None:
        if not self.pending:
            return
        new = np.concatenate(self.pending)
        allk = np.concatenate([self.keys, new])
        w = np.concatenate([self.counts, np.ones(new.size, dtype=np.int64)])
        self.keys, inv = np.unique(allk, return_inverse=True)
        self.counts = np.bincount(inv, weights=w, minlength=self.keys.size).astype(np.int64)
        self.pending, self.size = [], 0


class Specialisation:
    """Collects routing per MoE layer while a model runs: ``attach(model)``, then for each batch
    ``begin_batch(x)`` before its forward; ``result(tokenizer)`` at the end; ``detach()``."""

    def __init__(self, vocab_size: int, seq_len: int):
        self.vocab, self.seq_len = vocab_size, seq_len
        self.bucket, self.labels = position_buckets(seq_len)
        self.layers: dict[str, dict] = {}
        self.handles: list = []
        self.x: np.ndarray | None = None
        self.occurrences = np.zeros(vocab_size, dtype=np.int64)
        self.tokens = 0

    def attach(self, model: torch.nn.Module) -> "Specialisation":
        for name, layer in moe_layers(model):
            E = layer.num_experts
            self.layers[name] = {"E": E, "pairs": _Sparse(), "positions": np.zeros((len(self.labels), E), np.int64),
                                 "experts": np.zeros(E, np.int64)}
            self.handles.append(layer.router.register_forward_hook(
                lambda _m, _a, routing, name=name: self._record(name, routing)))
        if not self.layers:
            raise UserError("the model has no MoE layers: there is no routing to analyse")
        return self

    def detach(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def begin_batch(self, x: torch.Tensor) -> None:
        """``x`` [b, S] the input token ids of the next forward."""
        self.x = x.detach().cpu().numpy().astype(np.int64)
        flat = self.x.ravel()
        self.occurrences += np.bincount(flat, minlength=self.vocab)[: self.vocab]
        self.tokens += flat.size

    def _record(self, name: str, routing) -> None:
        if self.x is None:
            return
        idx = routing.indices.detach().cpu().numpy().astype(np.int64)  # [T, k] expert per slot, -1 dropped
        b, S = self.x.shape
        if idx.shape[0] != b * S:  # split tokens (sequence / tensor parallel): not attributable here
            raise UserError(f"{name}: routed {idx.shape[0]} tokens for a batch of {b} x {S}; run the "
                            f"specialisation analysis in one process")
        st = self.layers[name]
        E = st["E"]
        tok = np.repeat(self.x.ravel(), idx.shape[1])
        pos = np.repeat(np.tile(np.arange(S), b), idx.shape[1])
        e = idx.ravel()
        ok = (e >= 0) & (e < E)
        tok, pos, e = tok[ok], pos[ok], e[ok]
        st["pairs"].add(e * self.vocab + tok)
        st["experts"] += np.bincount(e, minlength=E)
        P = len(self.labels)
        st["positions"] += np.bincount(self.bucket[pos] * E + e, minlength=P * E).reshape(P, E)

    def result(self, tokenizer=None, top: int = TOP_TOKENS, frequent: int = FREQUENT_TOKENS) -> dict:
        occ = self.occurrences
        common = np.argsort(-occ, kind="stable")[:frequent]
        common = common[occ[common] > 0]
        layers = []
        for name, st in self.layers.items():
            E = st["E"]
            st["pairs"].compact()
            keys, counts = st["pairs"].keys, st["pairs"].counts
            ex, tok = keys // self.vocab, keys % self.vocab
            spec = counts / np.maximum(occ[tok], 1)
            score = counts * spec
            total = st["experts"].sum()
            experts = []
            for e in range(E):
                sel = np.flatnonzero(ex == e)
                best = sel[np.argsort(-score[sel], kind="stable")[:top]]
                experts.append({"expert": e, "share": float(st["experts"][e] / total) if total else 0.0,
                                "top_tokens": [{"id": int(tok[i]), "text": token_text(tokenizer, int(tok[i])),
                                                "count": int(counts[i]), "specificity": float(spec[i])}
                                               for i in best]})
            # per token id: the largest specificity, occurrence-weighted
            best_spec = np.zeros(self.vocab)
            np.maximum.at(best_spec, tok, spec)
            seen = occ > 0
            concentration = float((best_spec[seen] * occ[seen]).sum() / occ[seen].sum()) if seen.any() else 0.0
            freq = []
            for t in common:
                sel = np.flatnonzero(tok == t)
                order = sel[np.argsort(-counts[sel], kind="stable")[:3]]
                freq.append({"id": int(t), "text": token_text(tokenizer, int(t)), "occurrences": int(occ[t]),
                             "experts": [{"expert": int(ex[i]), "specificity": float(spec[i])} for i in order]})
            pos = st["positions"].astype(np.float64)
            pos_share = pos / np.maximum(pos.sum(axis=1, keepdims=True), 1)
            layers.append({"name": name, "experts_count": E,
                           "expert_share": (st["experts"] / max(total, 1)).tolist(),
                           "position_share": pos_share.tolist(), "position_slots": st["positions"].tolist(),
                           "token_concentration": concentration, "experts": experts, "tokens": freq})
        return {"format": "moekit-specialisation", "version": 1, "tokens": int(self.tokens),
                "seq_len": self.seq_len, "vocab_size": self.vocab, "position_buckets": self.labels,
                "layers": layers}


def report(spec: dict, experts: int = 8, layers: int = 4) -> str:
    """The stdout table: per layer (at most ``layers``, spread over depth), the concentration, the position
    bucket each expert favours most, and the top tokens of the busiest ``experts`` experts."""
    out = [f"expert specialisation: {spec['tokens']:,} tokens, {len(spec['layers'])} MoE layers; specificity = share "
           f"of the token's occurrences sent to the expert"]
    chosen = spec["layers"][:: max(1, math.ceil(len(spec["layers"]) / layers))][:layers]
    for layer in chosen:
        E = layer["experts_count"]
        out.append(f"{layer['name']}: token-id concentration {layer['token_concentration']:.2f} (1 = each id always "
                   f"goes to one expert), {E} experts")
        pos = np.asarray(layer["position_share"])
        if pos.shape[0] > 1:
            first = int(pos[0].argmax())
            out.append(f"  position {spec['position_buckets'][0]}: expert {first} takes {100 * pos[0, first]:.0f}% "
                       f"(uniform {100 / E:.0f}%)")
        busiest = sorted(layer["experts"], key=lambda e: -e["share"])[:experts]
        out.append(f"  {'expert':>6} {'share':>6}  top tokens: count (specificity)")
        for e in busiest:
            toks = "  ".join(f"{t['text']!s} {t['count']} ({100 * t['specificity']:.0f}%)" for t in e["top_tokens"][:6])
            out.append(f"  {e['expert']:>6} {100 * e['share']:>5.1f}%  {toks}")
    return "\n".join(out)


def _run_config(run_dir) -> dict | None:
    try:
        return json.loads((Path(run_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def for_run_dir(run_dir: str | Path, max_tokens: int | None = None, refresh: bool = False,
                cache: bool = True) -> dict:
    """RUN_DIR/specialisation.json, computed (and written, unless not ``cache``: a read-only run directory) from
    the run's newest checkpoint on ``max_tokens`` (default DEFAULT_TOKENS) of its validation windows when
    missing or ``refresh``."""
    max_tokens = max_tokens or DEFAULT_TOKENS
    path = Path(run_dir) / SPEC_FILE
    if path.exists() and not refresh:
        try:
            spec = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise UserError(f"{path}: unreadable ({exc}); delete it to recompute") from None
        spec["source"] = str(path)
        return spec
    from moekit.train import evaluate

    seq_len = evaluate._run_defaults(_run_config(run_dir))[0] or 1024
    result = evaluate.run(evaluate.build_parser().parse_args(
        [str(run_dir), "--max-tokens", str(max_tokens), "--batch-size", str(max(1, 8192 // seq_len)),
         "--specialisation", "--quiet"]))
    spec = result["specialisation"]
    spec["source"] = f"{result['checkpoint']} (step {result['step']}{'' if cache else '; not cached'})"
    if cache:
        path.write_text(json.dumps(spec) + "\n", encoding="utf-8")
    return spec
