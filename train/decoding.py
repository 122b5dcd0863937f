"""Decoding for moekit-generate (moekit.train.generate, the program): sampling one token from logits
(``candidates``, ``next_token``) and decoding a sequence with or without the KV cache (``generate``). The
sampling rules and the context window are described in moekit.train.generate's docstring.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from moekit.models.transformer import KVCache, Transformer
from moekit.train.generate import Sampling

# ---------------------------------------------------------------------------------------------------
# Sampling
# ---------------------------------------------------------------------------------------------------


def candidates(logits: torch.Tensor, sampling: Sampling) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids [n], probabilities [n] float64 summing to 1): what ``next_token`` draws from, most likely
    first, for one position's logits [V] and a temperature > 0."""
    scaled = logits.detach().to("cpu", torch.float64) / sampling.temperature  # [V]
    order = torch.sort(scaled, descending=True, stable=True).indices  # [V] ties: lower id first
    if sampling.top_k:
        order = order[: sampling.top_k]
    probs = torch.softmax(scaled[order], dim=0)  # [n]
    if sampling.top_p < 1:
        reach = int((probs.cumsum(0) < sampling.top_p).sum()) + 1  # smallest prefix whose mass reaches top_p
        order, probs = order[:reach], probs[:reach]
        probs = probs / probs.sum()
    return order, probs


def _pick(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator):
    """(token, its candidate ids, probabilities) from logits [V]; greedy: (argmax, None, None)."""
    if sampling.temperature == 0:
        return int(logits.argmax()), None, None  # D2H sync: the token decides the next step
    ids, probs = candidates(logits, sampling)
    return int(ids[torch.multinomial(probs, 1, generator=generator)]), ids, probs


def next_token(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> int:
    """One token id from logits [V]: argmax at temperature 0, else drawn from ``candidates``."""
    return _pick(logits, sampling, generator)[0]


# ---------------------------------------------------------------------------------------------------
# Decoding
# ---------------------------------------------------------------------------------------------------


@dataclass
class Generation:
    prompt_ids: list[int]
    new_ids: list[int]
    seconds: float  # the whole decode, prefill included
    first_token_s: float  # prompt forward and the first token (time to first token)
    stopped: str  # "eos" or "length"
    prompt_dropped: int = 0  # prompt tokens beyond the window (module docstring)
    shifts: int = 0  # times the window moved on
    drafted: int = 0  # speculative decoding: draft tokens the main model checked
    accepted: int = 0  # ... and kept
    forwards: int = 0  # main-model forwards (prefills included)

    @property
    def tokens_per_s(self) -> float:
        return len(self.new_ids) / self.seconds if self.seconds > 0 else float("inf")

    @property
    def acceptance(self) -> float:
        """Share of the drafted tokens the main model accepted (nan without drafts)."""
        return self.accepted / self.drafted if self.drafted else float("nan")


@torch.inference_mode()
def generate(model: Transformer, prompt_ids: list[int], max_new_tokens: int, sampling: Sampling = Sampling(), *,
             seed: int = 0, eos_ids: tuple[int, ...] = (), use_cache: bool = True) -> Generation:
    """Decode up to ``max_new_tokens`` after ``prompt_ids`` (one sequence), stopping at an id in ``eos_ids``.

    use_cache: KV cache (the prompt once, then one token per step) or the whole window every step."""
    if not prompt_ids:
        raise ValueError("generate() needs at least one prompt token")
    W = model.config.max_seq_len
    keep = max(1, W // 2)  # tokens kept when the window moves on
    device = model.embed.weight.device
    generator = torch.Generator().manual_seed(seed)
    seq = list(prompt_ids)
    start = max(0, len(seq) - W)  # first position of the window: seq[start:] is what the model sees
    cache, shifts, first, stopped = None, 0, None, "length"
    t0 = time.perf_counter()
    for step in range(max_new_tokens):
        if use_cache and cache is not None:
            logits = model(torch.tensor([seq[-1:]], device=device), cache=cache)  # [1, 1, V]
        else:
            window = torch.tensor([seq[start:]], device=device)  # [1, S]
            if use_cache:
                cache = KVCache(model.config, min(W, window.shape[1] + max_new_tokens - step))
            logits = model(window, cache=cache)  # [1, S, V]
        token = next_token(logits[0, -1], sampling, generator)
        if first is None:
            first = time.perf_counter() - t0
        if token in eos_ids:
            stopped = "eos"
            break
        seq.append(token)
        if len(seq) - start > W:  # the window is full: move on to the newest `keep` tokens
            start, cache, shifts = len(seq) - keep, None, shifts + 1
    seconds = time.perf_counter() - t0
    return Generation(list(prompt_ids), seq[len(prompt_ids):], seconds, first or seconds, stopped,
                      max(0, len(prompt_ids) - W), shifts)


# ---------------------------------------------------------------------------------------------------
# Speculative decoding with the model's multi-token-prediction depth (models.mtp)
# ---------------------------------------------------------------------------------------------------


def accept_draft(p_ids: torch.Tensor, p: torch.Tensor, q_ids: torch.Tensor, q: torch.Tensor, draft: int,
                 generator: torch.Generator) -> tuple[bool, int]:
    """Speculative sampling (Leviathan et al. 2023; Chen et al. 2023) of one position: ``draft`` was drawn from the
    draft distribution (ids ``q_ids``, probabilities ``q``), the target distribution is (``p_ids``, ``p``), both as
    ``candidates`` gives them. Keep the draft with probability min(1, p(draft) / q(draft)), else draw from the
    residual max(0, p - q), renormalised. The token returned is distributed exactly as p. -> (kept, token)."""
    table = {}  # id -> [p, q]
    for ids, probs, col in ((p_ids, p, 0), (q_ids, q, 1)):
        for i, pr in zip(ids.tolist(), probs.tolist()):
            table.setdefault(i, [0.0, 0.0])[col] = pr
    pd, qd = table[draft]
    if qd > 0 and torch.rand((), generator=generator, dtype=torch.float64).item() < min(1.0, pd / qd):
        return True, draft
    ids = list(table)
    residual = torch.tensor([max(0.0, table[i][0] - table[i][1]) for i in ids], dtype=torch.float64)
    if residual.sum() <= 0:  # p == q up to rounding: the draft was p's own draw after all
        residual = torch.tensor([table[i][0] for i in ids], dtype=torch.float64)
    return False, ids[int(torch.multinomial(residual / residual.sum(), 1, generator=generator))]


def draft_logits(model: Transformer, kv, h: torch.Tensor, ahead: torch.Tensor) -> torch.Tensor:
    """The first MTP depth (models.mtp) at the next n positions of its cache ``kv`` (a LayerKV; positions follow the
    main model's): main final hidden states h [B, n, H] and the tokens one ahead of them [B, n] -> logits [B, n, V]
    float32 of the token two ahead, as training computes depth 1's."""
    from moekit.models.rope import rope_tables

    depth = model.mtp[0]
    cos, sin = rope_tables(model.config, ahead.shape[1], ahead.device, kv.length)
    y = depth(h, model.embed(ahead), cos, sin, ahead, kv=kv)  # [B, n, H]
    weight = model.embed.weight if model.lm_head is None else model.lm_head.weight
    return torch.nn.functional.linear(depth.norm(y), weight).float()


@torch.inference_mode()
def generate_speculative(model: Transformer, prompt_ids: list[int], max_new_tokens: int,
                         sampling: Sampling = Sampling(), *, seed: int = 0, eos_ids: tuple[int, ...] = ()) -> Generation:
    """``generate`` with the KV cache, each main-model forward checking one token drafted by the model's first
    multi-token-prediction depth (DeepSeek-V3 section 5.4.3: its MTP module as the draft model).

    With the last committed token t at position m - 1 not yet in the cache and a draft d for position m:

        main forward on [t, d] (positions m-1, m)  -> hidden h_{m-1}, h_m and the logits for m and m+1
        token for m from the logits at m - 1: equal to d (greedy; speculative sampling's acceptance test when
            sampling) -> keep it and take m + 1 from the logits at m as well: two tokens for one forward;
            else the cache forgets position m and one token was made
        depth 1 on (h_i, embed(token at i + 1)) for the new positions i (its own cache) -> the next draft

    Greedy decoding gives exactly ``generate``'s tokens, and sampling the same distribution (not the same draws
    for a seed). The context window moves as in ``generate`` (a new prefill of both caches)."""
    if not prompt_ids:
        raise ValueError("generate() needs at least one prompt token")
    if not len(model.mtp):
        raise ValueError("speculative decoding drafts with the model's multi-token-prediction depths, and this model "
                         "has none (model.mtp_layers 0)")
    from moekit.models.attention import LayerKV

    cfg = model.config
    W = cfg.max_seq_len
    if W < 3:
        raise ValueError(f"speculative decoding needs model.max_seq_len >= 3, got {W}")
    keep = max(1, W // 2)
    device = model.embed.weight.device
    generator = torch.Generator().manual_seed(seed)
    seq = list(prompt_ids)
    start = max(0, len(seq) - W)
    out = Generation(list(prompt_ids), [], 0.0, 0.0, "length", max(0, len(prompt_ids) - W))
    t0 = time.perf_counter()

    def ids(tokens: list[int]) -> torch.Tensor:
        return torch.tensor([tokens], device=device)

    def run_depth(mtp_kv: LayerKV, h: torch.Tensor, ahead: list[int]) -> torch.Tensor:
        return draft_logits(model, mtp_kv, h, ids(ahead))[0, -1]  # [V]

    def commit(token: int) -> bool:
        """Append ``token``; True when decoding ends (EOS or the length)."""
        if token in eos_ids:
            out.stopped = "eos"
            return True
        seq.append(token)
        return len(seq) - len(prompt_ids) >= max_new_tokens

    def prefill():
        """Both caches from the window seq[start:]; -> (caches, the draft token and its distribution), or None
        when the token it commits ends decoding."""
        window = seq[start:]
        cache, mtp_kv = KVCache(cfg, W), LayerKV(W)
        logits, h = model(ids(window), cache=cache, return_hidden=True)  # [1, S, V], [1, S, H]
        out.forwards += 1
        token, _, _ = _pick(logits[0, -1], sampling, generator)
        if not out.first_token_s:
            out.first_token_s = time.perf_counter() - t0
        if commit(token):
            return None
        draft_logits = run_depth(mtp_kv, h, window[1:] + [token])
        return (cache, mtp_kv, *_pick(draft_logits, sampling, generator))

    state = prefill()
    while state is not None:  # the cache holds positions 0 .. cache.length - 1; seq[-1] is the next
        cache, mtp_kv, draft, q_ids, q = state
        if cache.length + 1 == W:  # seq[-1] takes the window's last position: no room for a draft
            logits = model(ids(seq[-1:]), cache=cache)  # [1, 1, V]
            out.forwards += 1
            if commit(_pick(logits[0, -1], sampling, generator)[0]):
                break
        if cache.length + 1 >= W:  # the window is full: move on to the newest `keep` tokens, as generate does
            start, out.shifts = len(seq) - keep, out.shifts + 1
            state = prefill()
            continue
        m = cache.length + 1  # position of the draft
        logits, h = model(ids([seq[-1], draft]), cache=cache, return_hidden=True)  # [1, 2, V], [1, 2, H]
        out.forwards += 1
        out.drafted += 1
        if sampling.temperature == 0:
            token = int(logits[0, 0].argmax())
            kept = token == draft
        else:
            p_ids, p = candidates(logits[0, 0], sampling)
            kept, token = accept_draft(p_ids, p, q_ids, q, draft, generator)
        if not kept:
            cache.truncate(m)  # the draft's position is forgotten: the next forward writes it again
            if commit(token):
                break
            state = (cache, mtp_kv, *_pick(run_depth(mtp_kv, h[:, :1], [token]), sampling, generator))
            continue
        out.accepted += 1
        if commit(token):
            break
        bonus, _, _ = _pick(logits[0, 1], sampling, generator)
        if commit(bonus):
            break
        state = (cache, mtp_kv, *_pick(run_depth(mtp_kv, h, [token, bonus]), sampling, generator))
    out.new_ids = seq[len(prompt_ids):]
    out.seconds = time.perf_counter() - t0
    out.first_token_s = out.first_token_s or out.seconds
    return out


def continuation(tokenizer, prompt_ids: list[int], new_ids: list[int]) -> str:
    """The text the new tokens add to the prompt's (decoded together: a tokenizer may join them)."""
    head, full = tokenizer.decode(prompt_ids), tokenizer.decode(prompt_ids + new_ids)
    return full[len(head):] if full.startswith(head) else tokenizer.decode(new_ids)
