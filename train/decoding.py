"""Decoding for moekit-generate (moekit.train.generate, the program): sampling one token from logits
(``candidates``, ``next_token``) and decoding a sequence with or without the KV cache (``generate``). The
sampling rules and the context window are described in moekit.train.generate's docstring.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from moekit.models.transformer import KVCache, Transformer, embed_tokens
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
    stopped: str  # "eos", "length", or "stop" (the caller's stop condition)
    prompt_dropped: int = 0  # prompt tokens beyond the window (module docstring)
    shifts: int = 0  # times the window moved on
    forwards: int = 0  # main-model forwards (prefills included)
    # speculative decoding, per drafting depth k = 1..D: depth k's drafts the main model checked, and those it kept
    # (a depth-k draft is kept only after depths 1..k-1's drafts of the same chain were)
    drafted_by_depth: list[int] = field(default_factory=list)
    accepted_by_depth: list[int] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return len(self.new_ids) / self.seconds if self.seconds > 0 else float("inf")

    @property
    def drafted(self) -> int:
        return sum(self.drafted_by_depth)

    @property
    def accepted(self) -> int:
        return sum(self.accepted_by_depth)

    @property
    def acceptance(self) -> float:
        """Share of the drafted tokens the main model accepted, all depths together (nan without drafts)."""
        return self.accepted / self.drafted if self.drafted else float("nan")

    @property
    def acceptance_by_depth(self) -> list[float]:
        """Per drafting depth, the share of its drafts the main model accepted (nan where it drafted none)."""
        return [a / d if d else float("nan") for a, d in zip(self.accepted_by_depth, self.drafted_by_depth)]

    @property
    def tokens_per_forward(self) -> float:
        return len(self.new_ids) / self.forwards if self.forwards else float("nan")


@torch.inference_mode()
def generate(model: Transformer, prompt_ids: list[int], max_new_tokens: int, sampling: Sampling = Sampling(), *,
             seed: int = 0, eos_ids: tuple[int, ...] = (), use_cache: bool = True,
             stop: Callable[[list[int]], bool] | None = None) -> Generation:
    """Decode up to ``max_new_tokens`` after ``prompt_ids`` (one sequence), stopping at an id in ``eos_ids``, or
    once ``stop(new ids so far)`` is true (a stop string: the caller decodes and looks; ``stopped`` is "stop").

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
        if stop is not None and stop(seq[len(prompt_ids):]):
            stopped = "stop"
            break
        if len(seq) - start > W:  # the window is full: move on to the newest `keep` tokens
            start, cache, shifts = len(seq) - keep, None, shifts + 1
    seconds = time.perf_counter() - t0
    return Generation(list(prompt_ids), seq[len(prompt_ids):], seconds, first or seconds, stopped,
                      max(0, len(prompt_ids) - W), shifts)


# ---------------------------------------------------------------------------------------------------
# Many prompts at once: a left-padded batch over one KV cache
# ---------------------------------------------------------------------------------------------------

# The filler token before a shorter prompt: any id does (no query of the row sees it); 0 is in every vocabulary.
FILLER_ID = 0


@torch.inference_mode()
def generate_batch(model: Transformer, prompts: list[list[int]], max_new_tokens: int,
                   sampling: Sampling = Sampling(), *, seed: int | list[int] = 0, eos_ids: tuple[int, ...] = (),
                   stop: Callable[[int, list[int]], bool] | None = None) -> list[Generation]:
    """Decode after every prompt together: the prompts left-padded to the longest into one batch and one KV cache
    (models.kvcache.KVCache's ``padding``), one forward per step for all the sequences still going. A sequence ends
    at an id in ``eos_ids``, at ``max_new_tokens``, or once ``stop(row, its new ids so far)`` is true, and leaves
    the batch (``KVCache.select``): the next steps run only the others.

    Row i's tokens are ``generate(model, prompts[i], ..., seed=seed)``'s up to rounding: a row attends only to its
    own tokens, RoPE depends on distances alone, and each row samples from its own generator seeded ``seed`` (or
    ``seed[i]``: one seed per prompt, e.g. several samples of one prompt). That
    holds when the model routes each token alone (train.inference.cache_inexact is None: no expert_choice router,
    no capacity) and every prompt fits the window beside its answer: ``generate_many`` sends the others to
    ``generate``."""
    if not prompts:
        return []
    W = model.config.max_seq_len
    for i, ids in enumerate(prompts):
        if not ids:
            raise ValueError(f"generate_batch(): prompt {i} is empty; every prompt needs at least one token")
        if len(ids) + max_new_tokens > W:
            raise ValueError(f"generate_batch(): prompt {i} has {len(ids)} tokens, and {max_new_tokens} new ones "
                             f"would outgrow the window of {W}: decode it with generate() (which moves its window) "
                             f"or shorten it")
    device = model.embed.weight.device
    B, P = len(prompts), max(map(len, prompts))
    padding = [P - len(ids) for ids in prompts]
    tokens = torch.tensor([[FILLER_ID] * pad + list(ids) for pad, ids in zip(padding, prompts)], device=device)
    seeds = _seeds(seed, len(prompts))
    generators = [torch.Generator().manual_seed(row_seed) for row_seed in seeds]
    new: list[list[int]] = [[] for _ in prompts]
    stopped, seconds = ["length"] * B, [0.0] * B
    alive = list(range(B))  # the batch's rows, in the cache's order
    t0 = time.perf_counter()
    cache = KVCache(model.config, P + max_new_tokens, padding=torch.tensor(padding, device=device))
    logits, forwards = model(tokens, cache=cache)[:, -1], 1  # [B, V]: every row's last slot is P - 1
    first = None
    for step in range(max_new_tokens):
        if sampling.temperature == 0:  # one transfer for the whole batch
            picked = logits.argmax(-1).tolist()
        else:
            picked = [next_token(logits[j], sampling, generators[row]) for j, row in enumerate(alive)]
        if first is None:
            first = time.perf_counter() - t0
        keep = []
        for j, (row, token) in enumerate(zip(alive, picked)):
            if token in eos_ids:
                stopped[row] = "eos"
            else:
                new[row].append(token)
                if stop is not None and stop(row, new[row]):
                    stopped[row] = "stop"
                else:
                    keep.append(j)
                    continue
            seconds[row] = time.perf_counter() - t0
        if not keep or step == max_new_tokens - 1:
            break
        if len(keep) < len(alive):
            cache.select(torch.tensor(keep, device=device))
            alive = [alive[j] for j in keep]
        logits = model(torch.tensor([[new[row][-1]] for row in alive], device=device), cache=cache)[:, -1]
        forwards += 1
    end = time.perf_counter() - t0
    return [Generation(list(ids), new[i], seconds[i] or end, first or end, stopped[i], forwards=forwards)
            for i, ids in enumerate(prompts)]


def _seeds(seed: int | list[int], n: int) -> list[int]:
    if isinstance(seed, int):
        return [seed] * n
    if len(seed) != n:
        raise ValueError(f"{len(seed)} seeds for {n} prompts; give one seed, or one per prompt")
    return list(seed)


def generate_many(model: Transformer, prompts: list[list[int]], max_new_tokens: int,
                  sampling: Sampling = Sampling(), *, seed: int | list[int] = 0, eos_ids: tuple[int, ...] = (),
                  stop: Callable[[int, list[int]], bool] | None = None, batch_size: int = 16,
                  use_cache: bool = True, progress: Callable[[int], None] | None = None) -> list[Generation]:
    """``generate`` for each prompt (``stop(index, new ids)``), in batches of up to ``batch_size`` prompts of
    similar length (``generate_batch``), returned in the prompts' order. A prompt whose answer would outgrow the
    window decodes alone (``generate`` moves its window), as does every prompt with ``batch_size`` 1 or without the
    cache (``use_cache`` False: a model whose routing is not per token, train.inference.cache_inexact).
    ``progress(done)`` is called after each batch with the prompts decoded so far."""
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} is invalid; it must be >= 1")
    seeds = _seeds(seed, len(prompts))
    W = model.config.max_seq_len
    out: list[Generation | None] = [None] * len(prompts)
    alone = [i for i, ids in enumerate(prompts)
             if batch_size == 1 or not use_cache or not ids or len(ids) + max_new_tokens > W]
    together = sorted(set(range(len(prompts))) - set(alone), key=lambda i: (len(prompts[i]), i))
    done = 0
    for i in alone:
        out[i] = generate(model, prompts[i], max_new_tokens, sampling, seed=seeds[i], eos_ids=eos_ids,
                          use_cache=use_cache, stop=None if stop is None else (lambda ids, i=i: stop(i, ids)))
        done += 1
        if progress is not None:
            progress(done)
    for b in range(0, len(together), batch_size):
        rows = together[b : b + batch_size]
        results = generate_batch(model, [prompts[i] for i in rows], max_new_tokens, sampling,
                                 seed=[seeds[i] for i in rows],
                                 eos_ids=eos_ids, stop=None if stop is None else (lambda j, ids: stop(rows[j], ids)))
        for i, result in zip(rows, results):
            out[i] = result
        done += len(rows)
        if progress is not None:
            progress(done)
    return out


# ---------------------------------------------------------------------------------------------------
# Speculative decoding with the model's multi-token-prediction depths (models.mtp)
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


def check_drafts(logits: torch.Tensor, drafts: list, sampling: Sampling,
                 generator: torch.Generator) -> tuple[list[int], int]:
    """The main model's verdict on a chain of drafts d_1..d_n, from its logits [n + 1, V] at [last token, d_1..d_n]
    (row j: the distribution of the token after d_j, d_0 being the last token). ``drafts[j]``: (d_{j+1}, its
    candidate ids, probabilities) as ``_pick`` drew it from depth j + 1's logits (ids and probabilities None when
    greedy). Draft by draft: greedy keeps d_j while it is the argmax of row j - 1; sampling applies ``accept_draft``.
    The first rejected draft is replaced by the main model's token (the argmax, or the residual draw) and ends the
    chain; when all are kept, row n adds a bonus token. -> (the tokens to append, the number of drafts kept)."""
    if sampling.temperature == 0:
        top = logits.argmax(-1).tolist()  # [n + 1]: one D2H sync for the chain
        kept = next((j for j, (draft, _, _) in enumerate(drafts) if top[j] != draft), len(drafts))
        return top[: kept + 1], kept
    tokens = []
    for j, (draft, q_ids, q) in enumerate(drafts):
        p_ids, p = candidates(logits[j], sampling)
        ok, token = accept_draft(p_ids, p, q_ids, q, draft, generator)
        tokens.append(token)
        if not ok:
            return tokens, j
    return tokens + [_pick(logits[len(drafts)], sampling, generator)[0]], len(drafts)


def mtp_states(model: Transformer, k: int, kv, h: torch.Tensor, ahead: torch.Tensor) -> torch.Tensor:
    """MTP depth ``k`` (1-based, models.mtp) at the next n positions of its cache ``kv`` (a LayerKV): the previous
    depth's states there, h [B, n, H] (the main model's final normed hidden states for depth 1), and the tokens k
    ahead of those positions [B, n] -> depth k's states [B, n, H] (before its norm: depth k + 1's input). Position i
    of every depth is the main model's position i (RoPE included), as ``models.mtp.depth_states`` chains them."""
    from moekit.models.rope import rope_tables

    cos, sin = rope_tables(model.config, ahead.shape[1], ahead.device, kv.length)
    return model.mtp[k - 1](h, embed_tokens(model, ahead), cos, sin, ahead, kv=kv)


def draft_logits(model: Transformer, k: int, states: torch.Tensor) -> torch.Tensor:
    """Depth k's prediction from its states [..., H] (``mtp_states``): its norm, then the shared head -> logits
    [..., V] float32 of the token k + 1 after each position, as training computes depth k's."""
    weight = model.embed.weight if model.lm_head is None else model.lm_head.weight
    return torch.nn.functional.linear(model.mtp[k - 1].norm(states), weight).float()


class DraftChain:
    """The caches of ``generate_speculative`` in one context window: depth 0 is the main model, depth k (1 <= k <=
    ``depths``) its k-th MTP depth. ``caches[k]`` is depth k's attention cache (the main model's KVCache; a LayerKV
    per depth) and ``states[k]`` [1, W, H] its hidden states at the cached positions, which depth k + 1 reads. Depth k
    at position i reads depth k - 1 at i and the token at i + k (training's chain, models.mtp.depth_states), so the
    depths' caches can lag the main model's, each by its own amount, and catch up in ``draft``."""

    def __init__(self, model: Transformer, depths: int):
        from moekit.models.attention import LayerKV

        W = model.config.max_seq_len
        self.model = model
        self.caches = [KVCache(model.config, W), *(LayerKV(W) for _ in range(depths))]
        self.states: list[torch.Tensor | None] = [None] * (depths + 1)  # allocated at the first write

    def _ids(self, tokens: list[int]) -> torch.Tensor:
        return torch.tensor([tokens], device=self.model.embed.weight.device)

    def _keep(self, k: int, start: int, states: torch.Tensor) -> None:
        if self.states[k] is None:
            self.states[k] = states.new_empty(1, self.model.config.max_seq_len, states.shape[-1])
        self.states[k][:, start : start + states.shape[1]] = states

    def forward(self, tokens: list[int]) -> torch.Tensor:
        """The main model on the tokens at its next positions -> their logits [n, V]."""
        start = self.caches[0].length
        logits, h = self.model(self._ids(tokens), cache=self.caches[0], return_hidden=True)  # [1, n, V], [1, n, H]
        self._keep(0, start, h)
        return logits[0]

    def rollback(self, length: int) -> None:
        """The tokens at positions < ``length`` are settled (what the main model read); the token at ``length`` may
        differ from the draft the states read there. Forget every state that read a later token: depth k keeps its
        first length - k positions."""
        for k, cache in enumerate(self.caches):
            cache.truncate(min(cache.length, max(0, length - k)))

    def draft(self, window: list[int], n: int, pick) -> list:
        """Depths 1..n catch up with the main model and draft a chain: ``window`` holds the tokens at positions
        0 .. m (m = the main cache's length: the next token it reads), depth k's last position m - 1 reads the
        token at m - 1 + k, which for k >= 2 is depth k - 1's draft. -> [(d_k, ids, probs)] for k = 1..n, ``pick``'s
        result for depth k's logits at m - 1 (d_k: the token for position m + k)."""
        tokens, end, drafts = list(window), self.caches[0].length, []
        for k in range(1, n + 1):
            start = self.caches[k].length
            y = mtp_states(self.model, k, self.caches[k], self.states[k - 1][:, start:end],
                           self._ids(tokens[start + k : end + k]))  # [1, end - start, H]
            self._keep(k, start, y)
            drafts.append(pick(draft_logits(self.model, k, y[0, -1])))
            tokens.append(drafts[-1][0])
        return drafts


@torch.inference_mode()
def generate_speculative(model: Transformer, prompt_ids: list[int], max_new_tokens: int,
                         sampling: Sampling = Sampling(), *, seed: int = 0, eos_ids: tuple[int, ...] = (),
                         draft_depths: int | None = None) -> Generation:
    """``generate`` with the KV cache, each main-model forward checking a chain of tokens drafted by the model's
    first ``draft_depths`` multi-token-prediction depths (default: all; DeepSeek-V3 section 5.4.3 drafts with its
    MTP module). With the last committed token t at position m, not yet in the main cache:

        depth 1 on (h_i, embed(token at i + 1)) for its new positions i (its own cache) -> draft d_1 for m + 1
        depth k on (depth k-1's state at i, embed(token at i + k)) -> d_k for m + k, reading d_{k-1} at i = m - 1
        main forward on [t, d_1..d_n] (positions m .. m + n) -> the logits for m + 1 .. m + n + 1
        ``check_drafts``: the longest kept prefix d_1..d_a, then the main model's own token for m + a + 1
        every cache forgets what read a token after m + a (``DraftChain.rollback``)

    so one forward makes 1 to n + 1 tokens. n is smaller where the window or ``max_new_tokens`` leaves less room.
    Greedy decoding gives exactly ``generate``'s tokens, and sampling the same distribution (not the same draws for
    a seed). The context window moves as in ``generate`` (a new prefill, every depth restarting)."""
    if not prompt_ids:
        raise ValueError("generate() needs at least one prompt token")
    if not len(model.mtp):
        raise ValueError("speculative decoding drafts with the model's multi-token-prediction depths, and this model "
                         "has none (model.mtp_layers 0)")
    depths = len(model.mtp) if draft_depths is None else draft_depths
    if not 1 <= depths <= len(model.mtp):
        raise ValueError(f"draft_depths={draft_depths} is invalid; the model has {len(model.mtp)} MTP depths")
    W = model.config.max_seq_len
    keep = max(1, W // 2)
    generator = torch.Generator().manual_seed(seed)
    seq = list(prompt_ids)
    start = max(0, len(seq) - W)
    out = Generation(list(prompt_ids), [], 0.0, 0.0, "length", max(0, len(prompt_ids) - W),
                     drafted_by_depth=[0] * depths, accepted_by_depth=[0] * depths)
    t0 = time.perf_counter()

    def pick(logits: torch.Tensor):
        return _pick(logits, sampling, generator)

    def commit(tokens: list[int]) -> bool:
        """Append the tokens; True when decoding ends (EOS or the length)."""
        for token in tokens:
            if token in eos_ids:
                out.stopped = "eos"
                return True
            seq.append(token)
            if len(seq) - len(prompt_ids) >= max_new_tokens:
                return True
        return False

    def prefill() -> tuple[DraftChain, list[int]]:
        chain = DraftChain(model, depths)
        logits = chain.forward(seq[start:])
        out.forwards += 1
        token = pick(logits[-1])[0]
        out.first_token_s = out.first_token_s or time.perf_counter() - t0
        return chain, [token]

    chain, tokens = prefill()
    while not commit(tokens):
        m = len(seq) - 1 - start  # the position of seq[-1]: the main cache holds (at least) 0 .. m - 1
        if m >= W:  # it is past the window: move on to the newest `keep` tokens, as generate does
            start, out.shifts = len(seq) - keep, out.shifts + 1
            chain, tokens = prefill()
            continue
        chain.rollback(m)
        n = min(depths, W - 1 - m, max_new_tokens - (len(seq) - len(prompt_ids)) - 1)  # positions m + 1 .. m + n
        drafts = chain.draft(seq[start:], n, pick)
        logits = chain.forward([seq[-1], *(d for d, _, _ in drafts)])  # [n + 1, V]
        out.forwards += 1
        tokens, kept = check_drafts(logits, drafts, sampling, generator)
        for j in range(n):
            out.drafted_by_depth[j] += 1
            out.accepted_by_depth[j] += j < kept
    out.new_ids = seq[len(prompt_ids):]
    out.seconds = time.perf_counter() - t0
    out.first_token_s = out.first_token_s or out.seconds
    return out


def continuation(tokenizer, prompt_ids: list[int], new_ids: list[int], head: str | None = None) -> str:
    """The text the new tokens add to the prompt's (decoded together: a tokenizer may join them). ``head``: the
    prompt's decoded text, when the caller keeps it (a check after every new token)."""
    head = tokenizer.decode(prompt_ids) if head is None else head
    full = tokenizer.decode(prompt_ids + new_ids)
    return full[len(head):] if full.startswith(head) else tokenizer.decode(new_ids)
