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


def next_token(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> int:
    """One token id from logits [V]: argmax at temperature 0, else drawn from ``candidates``."""
    if sampling.temperature == 0:
        return int(logits.argmax())  # D2H sync: the token decides the next step
    ids, probs = candidates(logits, sampling)
    return int(ids[torch.multinomial(probs, 1, generator=generator)])


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

    @property
    def tokens_per_s(self) -> float:
        return len(self.new_ids) / self.seconds if self.seconds > 0 else float("inf")


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


def continuation(tokenizer, prompt_ids: list[int], new_ids: list[int]) -> str:
    """The text the new tokens add to the prompt's (decoded together: a tokenizer may join them)."""
    head, full = tokenizer.decode(prompt_ids), tokenizer.decode(prompt_ids + new_ids)
    return full[len(head):] if full.startswith(head) else tokenizer.decode(new_ids)
