"""Evaluation for moekit-eval (moekit.train.evaluate, the program): which windows of which data
(``data_section``, ``load_split``, ``choose_windows``), the loss, bits per byte and expert load over them
(``evaluate``). What each number means is in moekit.train.evaluate's docstring.
"""
from __future__ import annotations

import dataclasses
import math
import time

import numpy as np
import torch
import torch.nn.functional as F

from moekit.models.loss import IGNORE_INDEX
from moekit.moe.load import collect_load, moe_layers
from moekit.train import UserError
from moekit.train.config import DataSection
from moekit.train.data import Split, gather, load_data, split_windows
from moekit.train.tokens import BYTES, TokenizerInfo, embedded_corpus

PROGRESS_EVERY_S = 5.0


# ---------------------------------------------------------------------------------------------------
# Data and windows
# ---------------------------------------------------------------------------------------------------


def data_section(run_config: dict | None, path: str | None) -> DataSection | None:
    """The [data] settings to read: --data FILE (the run's raw-id dtype kept), the run's own, or None."""
    saved = (run_config or {}).get("data")
    names = {f.name for f in dataclasses.fields(DataSection)}
    section = DataSection(**{k: v for k, v in saved.items() if k in names}) if isinstance(saved, dict) else None
    if path is not None:  # that file alone, its validation blocks held out of it
        return DataSection(path=path, dtype=section.dtype if section else DataSection.dtype,
                           val_fraction=section.val_fraction if section else DataSection.val_fraction)
    return section


# The data layer's messages name moekit-train's settings; moekit-eval's user has these instead.
EVAL_WORDING = (("a smaller --train.seq_len", "a smaller --seq-len"),
                ("set --model.vocab_size", "evaluate data prepared with the model's tokenizer (moekit-prepare)"),
                ("; --data.dtype)", "; the run's data.dtype)"), (", or a larger --data.val_fraction", ""))


def load_split(section: DataSection | None, tokenizer, vocab: int, seq_len: int) -> tuple[Split, str, TokenizerInfo]:
    """(the windows' split, a description, the tokenizer the data was made with)."""
    try:
        return _load_split(section, tokenizer, vocab, seq_len)
    except UserError as exc:
        message = str(exc)
        for train_words, eval_words in EVAL_WORDING:
            message = message.replace(train_words, eval_words)
        raise UserError(message) from None


def _load_split(section: DataSection | None, tokenizer, vocab: int, seq_len: int) -> tuple[Split, str, TokenizerInfo]:
    if section is not None:
        data = load_data(section, vocab)
        return data.split(seq_len, section.val_fraction), data.desc, data.tokenizer
    corpus, desc = embedded_corpus()
    if tokenizer is None or tokenizer.kind == "bytes":
        return split_windows(corpus, seq_len, DataSection.val_fraction), desc, BYTES
    ids = np.asarray(tokenizer.encode(bytes(corpus).decode("utf-8", errors="replace")), dtype=np.int64)
    info = TokenizerInfo("hf", str(tokenizer.path), tokenizer.sha256, tokenizer.vocab_size, tokenizer.eos_id)
    return (split_windows(ids, seq_len, DataSection.val_fraction), f"{desc}, {ids.size:,} tokens by {tokenizer.path}",
            info)


def check_tokenizers(data_tok: TokenizerInfo, tokenizer, where: str) -> None:
    """The data's token ids must come from the model's tokenizer (a set without metadata cannot be checked)."""
    if tokenizer is None or data_tok.kind == "unknown":
        return
    if data_tok.kind != tokenizer.kind or (data_tok.kind == "hf" and data_tok.sha256 != tokenizer.sha256):
        raise UserError(f"{where}: made with the {data_tok.describe()}, but the model's tokenizer is "
                        f"{tokenizer.describe()}; evaluate on data prepared with the model's tokenizer")


def choose_windows(split: Split, which: str, count: int | None) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    """(the tokens, their loss mask or None, the window starts) of ``which`` split; ``count`` windows (None: all)
    spread evenly, as the trainer does. "val": the held-out windows, a run's --data.val_path file when it had one;
    "all": every window of the data (the training data alone when validation was a file of its own)."""
    if which == "val":
        starts = split.val_starts
        return (split.held_out, split.held_out_mask,
                starts if count is None or count >= starts.size else split.validation(count))
    own = split.val_tokens is None  # the held-out windows are in the training data
    starts = np.sort(np.concatenate([split.train_starts, split.val_starts])) if own else split.train_starts
    if count is None or count >= starts.size:
        return split.tokens, split.mask, starts
    return split.tokens, split.mask, starts[np.linspace(0, starts.size - 1, count).round().astype(np.int64)]


# ---------------------------------------------------------------------------------------------------
# Evaluation
# ---------------------------------------------------------------------------------------------------


def record_eval_load(model: torch.nn.Module) -> list:
    """Record every MoE layer's routing into its ExpertLoad in eval mode too (MoELayer records only in
    training); returns the hook handles to remove."""
    handles = []
    for _, layer in moe_layers(model):
        layer.load.reset()
        hook = layer.router.register_forward_hook(lambda _m, _a, routing, load=layer.load: load.record(routing))
        handles.append(hook)
    return handles


@torch.no_grad()
def expert_similarity(layer: torch.nn.Module, max_features: int = 1 << 16) -> float | None:
    """How alike the routed experts of MoE ``layer`` are: the mean cosine similarity over pairs of experts of their
    weights (w_in and w_out flattened; 1 = copies, as plain upcycling starts, ~0 = independent random ones). Over
    more than ``max_features`` weights per expert, the same fixed random ``max_features`` of them for every
    expert (an estimate, within ~1 / sqrt(max_features) of the whole). None for a single expert."""
    experts = layer.experts
    w = torch.cat([experts.w_in.detach().flatten(1), experts.w_out.detach().flatten(1)], dim=1)
    E, n = w.shape
    if E < 2:
        return None
    if n > max_features:
        pick = torch.randperm(n, generator=torch.Generator().manual_seed(0))[:max_features].sort().values
        w = w[:, pick.to(w.device)]
    w = F.normalize(w.float(), dim=1)
    gram = w @ w.t()
    return float((gram.sum() - gram.diagonal().sum()) / (E * (E - 1)))


def load_summary(model: torch.nn.Module) -> dict:
    """Per MoE layer and overall: imbalance (max/mean), cv (std/mean), dead experts, dropped slots, and how alike
    its experts' weights are (``expert_similarity``). Layers that routed nothing are left out: the
    multi-token-prediction depths', which run only in training (models.mtp)."""
    layers, modules = [], dict(moe_layers(model))
    for name, s in collect_load(model).items():
        if not s.forwards:
            continue
        counts = np.asarray(s.tokens_per_expert, dtype=np.float64)
        mean = counts.mean()
        layers.append({"name": name, "imbalance": s.imbalance, "cv": float(counts.std() / mean) if mean > 0 else 0.0,
                       "dead_experts": int((counts == 0).sum()), "dropped_slots": s.dropped_slots,
                       "dropped_fraction": s.dropped_fraction, "tokens_per_expert": s.tokens_per_expert,
                       "assigned_per_expert": s.assigned_per_expert,
                       "similarity": expert_similarity(modules[name]) if name in modules else None})
    if not layers:
        return {"layers": []}
    assigned = sum(sum(layer["assigned_per_expert"]) for layer in layers)
    return {"imbalance_mean": float(np.mean([layer["imbalance"] for layer in layers])),
            "imbalance_max": max(layer["imbalance"] for layer in layers),
            "cv_mean": float(np.mean([layer["cv"] for layer in layers])),
            "dead_experts": sum(layer["dead_experts"] for layer in layers),
            "dropped_fraction": sum(layer["dropped_slots"] for layer in layers) / max(assigned, 1), "layers": layers}


@torch.inference_mode()
def evaluate(model, tokens, starts: np.ndarray, seq_len: int, batch_size: int, tokenizer=None,
             progress=None, observer=None, mask: np.ndarray | None = None, eos: int | None = None,
             sources: list[str] | None = None) -> dict:
    """Loss over the windows at ``starts`` (each predicts seq_len tokens; with a loss ``mask``, the targets it
    counts, as the trainer counts them: data.counted, with the data's end-of-document id ``eos``), bytes for bits
    per byte, expert load. ``observer``: a specialisation.Specialisation attached to the model, told each batch's
    input ids. ``sources``: each window's set (a blend's path), for the loss per set ("by_source")."""
    device = model.embed.weight.device
    handles = record_eval_load(model)
    nats, byte_count, count, last = 0.0, 0, 0, time.perf_counter()
    by_source: dict[str, list[float]] = {}  # set -> [nats, counted targets]
    depths = len(getattr(model, "mtp", ()))
    mtp = torch.zeros(depths, 4, dtype=torch.float64)  # per depth: nats, correct, agreeing, predictions
    try:
        for i in range(0, starts.size, batch_size):
            x, y = gather(tokens, starts[i : i + batch_size], seq_len, mask, eos)  # [b, S] each
            if observer is not None:
                observer.begin_batch(x)
            logits, hidden = model(x.to(device), return_hidden=True)  # [b, S, V], [b, S, H]
            if depths:
                mtp += mtp_counts(model, x.to(device), y.to(device), logits, hidden)
            per_row = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten().to(device),
                                      reduction="none").view(y.shape).sum(1)  # [b] nats (ignored targets: 0)
            rows = per_row.tolist()  # D2H sync: once per batch
            kept = y != IGNORE_INDEX  # [b, S] (CPU) the targets a loss mask counts
            row_counts = kept.sum(1).tolist()
            nats += sum(rows)
            count += sum(row_counts)
            if sources is not None:
                for name, row_nats, row_count in zip(sources[i : i + batch_size], rows, row_counts):
                    acc = by_source.setdefault(name, [0.0, 0])
                    acc[0] += row_nats
                    acc[1] += row_count
            if tokenizer is not None:
                byte_count += sum(tokenizer.byte_count(row[keep].tolist()) for row, keep in zip(y, kept))
            done = min(i + batch_size, starts.size)
            if progress is not None and time.perf_counter() - last > PROGRESS_EVERY_S and done < starts.size:
                progress(f"{done:,}/{starts.size:,} windows, loss so far {nats / max(count, 1):.4f}")
                last = time.perf_counter()
    finally:
        for h in handles:
            h.remove()
    loss = nats / max(count, 1)
    return {"loss": loss, "perplexity": math.exp(loss) if loss < 700 else math.inf,
            "bits_per_byte": nats / math.log(2) / byte_count if byte_count else None, "tokens": count,
            "bytes": byte_count if tokenizer is not None else None, "windows": int(starts.size),
            "expert_load": load_summary(model),
            "by_source": {name: {"loss": n / max(c, 1), "tokens": c} for name, (n, c) in by_source.items()} or None,
            "mtp": [{"depth": k + 1, "loss": row[0] / row[3], "accuracy": row[1] / row[3], "agreement": row[2] / row[3],
                     "predictions": int(row[3])} for k, row in enumerate(mtp.tolist()) if row[3]]}


def window_sources(split: Split, tokens, starts: np.ndarray) -> list[str] | None:
    """Each window's set when ``tokens`` are a blend's (moekit.train.data.BlendTokens), else None."""
    offsets = getattr(tokens, "offsets", None)
    names = getattr(split, "names", ())
    if offsets is None or not names:
        return None
    return [names[i] for i in (np.searchsorted(offsets, starts, side="right") - 1).tolist()]


def mtp_counts(model, x: torch.Tensor, y: torch.Tensor, logits: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """The multi-token-prediction depths (models.mtp) on one batch, as training runs them: per depth k, [summed
    cross-entropy against the token k + 1 ahead, its top-1 hits, agreements of its top-1 with the main model's
    top-1 for the same position (the acceptance greedy speculative decoding would see on this text), predictions].
    x, y [b, S]; logits [b, S, V] and hidden [b, S, H], the main model's."""
    from moekit.models.mtp import depth_states
    from moekit.models.transformer import embed_tokens
    from moekit.models.rope import rope_tables

    weight = model.embed.weight if model.lm_head is None else model.lm_head.weight
    cos, sin = rope_tables(model.config, x.shape[1], x.device)
    main_top = logits.argmax(-1)  # [b, S]: the main model's prediction of y[:, i]
    rows = [[0.0] * 4 for _ in model.mtp]  # depths the sequence is too short for stay empty
    for k, h in depth_states(model, hidden, embed_tokens(model, x), x, cos, sin):
        out = F.linear(h, weight).float()  # [b, S - k, V]: position i predicts y[:, i + k]
        top, want = out.argmax(-1), y[:, k:]
        kept = want != IGNORE_INDEX  # a loss mask's targets only
        rows[k - 1] = [float(F.cross_entropy(out.flatten(0, 1), want.flatten(), reduction="sum")),
                       float(((top == want) & kept).sum()), float(((top == main_top[:, k:]) & kept).sum()),
                       float(kept.sum())]
    return torch.tensor(rows, dtype=torch.float64)
