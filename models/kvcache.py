"""The KV cache of incremental decoding: each attention layer's keys and values of the positions decoded so far
(``Transformer.forward(tokens, cache=KVCache(config))``; models.attention reads it through ``LayerKV.extend``).

Shape legend: B batch, K key/value heads (MLA: its query heads, expanded), D head dims, P positions.
"""
from __future__ import annotations

import torch
from torch import Tensor

from moekit.models.config import ModelConfig
from moekit.models.sdpa import padded_mask

# A sliding-window layer's cache keeps its last window - 1 positions (all its next query can see) plus this many,
# so speculative decoding can take back that many rejected positions (models.kvcache.LayerKV.truncate).
KV_WINDOW_SLACK = 64


class LayerKV:
    """One attention layer's cached keys [B, K, slots, Dk] and values [B, K, slots, Dv] of ``length`` positions.

    ``window`` > 0 (a sliding-window layer) with a capacity larger than window - 1 + KV_WINDOW_SLACK: a ring of
    that many slots, position p in slot p % slots, so the layer's memory stays bounded however long the
    generation (gpt-oss-120b at 128k positions: 18 of 36 layers keep 191 positions instead of 131072). Otherwise
    slots = capacity, position p in slot p.

    Allocated at the first write with the keys' and values' batch, heads, widths, dtype and device (the model's
    compute dtype: autocast's when it is on), so one cache serves any model (GQA, MLA, whose key and value widths
    differ) without being told its layout."""

    def __init__(self, capacity: int, window: int = 0):
        self.capacity, self.length, self.window = capacity, 0, window
        self.ring = bool(window) and window - 1 + KV_WINDOW_SLACK < capacity
        self.slots = window - 1 + KV_WINDOW_SLACK if self.ring else capacity
        self.keys: Tensor | None = None
        self.values: Tensor | None = None
        self.padding: Tensor | None = None  # [B] left-padding slots per row (KVCache's ``padding``), or None
        self.masks: dict = {}  # this step's padded masks, shared by the cache's layers (``padded_mask``)

    def padded_mask(self, start: int, S: int, first: int, P: int, window: int, chunk: int, device) -> Tensor:
        """models.sdpa.padded_mask for this forward, made once per step and (window, chunk) for every layer."""
        key = (start, S, first, P, window, chunk)
        if key not in self.masks:
            if self.masks and next(iter(self.masks))[0] != start:  # an earlier step's: no layer asks again
                self.masks.clear()
            self.masks[key] = padded_mask(self.padding.to(device), start, S, first, P, window, chunk)
        return self.masks[key]

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write k [B, K, S, Dk], v [B, K, S, Dv] at positions length .. length+S-1; return every position's (a
        ring returns the positions ``extend`` does: ask it where they start)."""
        keys, values, _ = self.extend(k, v)
        return keys, values

    def extend(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, int]:
        """Write k, v at positions length .. length+S-1 and return (keys, values, first): the cached positions
        first .. length+S-1 in position order, every one the new positions' queries can see (first 0 unless this is
        a ring: then the window's)."""
        B, K, S, _ = k.shape
        start, end = self.length, self.length + S
        if end > self.capacity:
            raise ValueError(f"KV cache holds {self.capacity} positions; appending {S} at position {self.length} "
                             f"overflows it: make a larger cache (at most model.max_seq_len) or start a new one")
        if self.keys is None:
            self.keys = k.new_empty(B, K, self.slots, k.shape[-1])
            self.values = v.new_empty(B, v.shape[1], self.slots, v.shape[-1])
        elif self.keys.shape[0] != B or self.keys.dtype != k.dtype:
            raise ValueError(f"KV cache was filled with batch {self.keys.shape[0]} in {self.keys.dtype}, got batch "
                             f"{B} in {k.dtype}; use one cache per batch of sequences")
        self.length = end
        if not self.ring:
            self.keys[:, :, start:end] = k
            self.values[:, :, start:end] = v
            return self.keys[:, :, :end], self.values[:, :, :end], 0
        first = max(0, start - self.window + 1)  # the oldest position the first new query sees
        held = torch.arange(first, start, device=k.device) % self.slots  # read before the new writes reuse them
        keys = torch.cat((self.keys.index_select(2, held), k), dim=2)  # [B, K, start - first + S, Dk]
        values = torch.cat((self.values.index_select(2, held), v), dim=2)
        kept = min(S, self.slots)  # a prefill longer than the ring leaves its last positions
        slots = torch.arange(end - kept, end, device=k.device) % self.slots
        self.keys.index_copy_(2, slots, k[:, :, S - kept :])
        self.values.index_copy_(2, slots, v[:, :, S - kept :])
        return keys, values, first

    def truncate(self, length: int) -> None:
        """Forget the positions from ``length`` on (a rejected draft token's, speculative decoding). A ring can take
        back KV_WINDOW_SLACK positions: older ones it has overwritten."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a KV cache of {self.length} positions to {length}")
        if self.ring and self.length - length > KV_WINDOW_SLACK:
            raise ValueError(f"a sliding-window layer's KV cache keeps window - 1 + {KV_WINDOW_SLACK} positions; "
                             f"taking back {self.length - length} of them needs positions it overwrote: start a new "
                             f"cache from the prompt, or raise models.kvcache.KV_WINDOW_SLACK")
        self.length = length

    def select(self, rows: Tensor) -> None:
        """Keep only the batch rows ``rows`` (their order): a batched decode dropping the sequences that ended."""
        if self.keys is not None:
            rows = rows.to(self.keys.device)
            self.keys, self.values = self.keys.index_select(0, rows), self.values.index_select(0, rows)


class LayerState:
    """A linear-attention layer's cache (models.linear_attention): the last k - 1 inputs of its convolution
    ``conv`` [B, C, k - 1] and its states ``state`` [B, Nv, dk, dv] (float32) after ``length`` positions. Its size
    does not grow with the length. Positions can be taken back only within the last forward of at most
    ``linear_attention.STEPS_MAX`` positions (speculative decoding's check of a draft chain), whose
    per-position (state, conv) the layer records in ``snapshots``: the states before them are gone otherwise."""

    def __init__(self, capacity: int):
        self.capacity, self.length = capacity, 0
        self.conv: Tensor | None = None
        self.state: Tensor | None = None
        self.snapshots: dict[int, tuple[Tensor | None, Tensor | None]] = {}  # length -> (state, conv) there
        self.inputs: Tensor | None = None  # the last forward's convolution inputs [B, C, k - 1 + S]
        self.padding: Tensor | None = None  # [B] left-padding slots per row (KVCache's ``padding``), or None

    def advance(self, S: int) -> None:
        """Count S more positions (the layer writes ``conv`` and ``state`` itself)."""
        if self.length + S > self.capacity:
            raise ValueError(f"KV cache holds {self.capacity} positions; appending {S} at position {self.length} "
                             f"overflows it: make a larger cache (at most model.max_seq_len) or start a new one")
        self.length += S

    def truncate(self, length: int) -> None:
        if length == self.length:
            return
        if length not in self.snapshots:
            raise ValueError(f"a linear-attention layer's cache keeps its state after the last position and, after a "
                             f"forward of a few positions, after each of those; it cannot go back from {self.length} "
                             f"to {length} positions: start a new cache from the prompt")
        self.state, self.conv = self.snapshots[length]
        self.length = length
        self.snapshots = {n: snap for n, snap in self.snapshots.items() if n <= length}

    def select(self, rows: Tensor) -> None:
        """Keep only the batch rows ``rows``; positions written before cannot be taken back afterwards."""
        pick = lambda t: None if t is None else t.index_select(0, rows.to(t.device))  # noqa: E731
        self.conv, self.state, self.inputs = pick(self.conv), pick(self.state), pick(self.inputs)
        self.snapshots = {self.length: (self.state, self.conv)}


class KVCache:
    """Per-layer keys and values of the positions decoded so far (``Transformer.forward(tokens, cache=...)``).

    ``capacity``: the most positions it will hold (default and limit: model.max_seq_len). Memory is
    B * capacity * (K * D keys + K * D values) elements per GQA layer, B * capacity * N * (nope + rope + v) per MLA
    layer (expanded keys and values), B * (window - 1 + KV_WINDOW_SLACK) * 2 * K * D per sliding-window layer (a
    ring: LayerKV; a chunked layer's the same with its chunk for the window), B * (C * (k - 1) + Nv * dk * dv) per
    linear-attention layer (LayerState), allocated as the layers first write. A cache belongs to one batch of
    sequences that all share positions: start a new one for another prompt.

    ``padding`` [B] (a batch of prompts of different lengths, train.decoding.generate_batch): row b's first
    padding[b] positions are filler before its prompt (left padding). No query of the row sees them; a filler
    query sees only itself; linear-attention layers leave their state and convolution untouched by them; Llama 4's
    chunks and attention temperature count positions from the row's first real token. RoPE rotates by slot: its
    scores depend on the distance of two positions alone, so each row attends as it would alone, up to rounding.
    """

    def __init__(self, config: ModelConfig, capacity: int | None = None, padding: Tensor | None = None):
        capacity = config.max_seq_len if capacity is None else capacity
        if not 1 <= capacity <= config.max_seq_len:
            raise ValueError(f"KV cache capacity {capacity} is invalid; it must be in [1, model.max_seq_len="
                             f"{config.max_seq_len}]")
        self.capacity = capacity
        # a chunked layer's queries see at most the chunk - 1 positions before them (those of their chunk): the ring
        # of a window that long serves it (Llama 4 Scout at 1M positions: 3 of 4 layers keep 8255, not 1M)
        self.layers = [LayerState(capacity) if config.is_linear_layer(i)
                       else LayerKV(capacity, config.attention_window(i) or config.attention_chunk_of(i))
                       for i in range(config.num_layers)]
        self.padding = None
        if padding is not None:
            padding = torch.as_tensor(padding, dtype=torch.long)
            if padding.dim() != 1 or bool((padding < 0).any()) or bool((padding >= capacity).any()):
                raise ValueError(f"KV cache padding must be one count per row in [0, capacity={capacity}), got "
                                 f"{padding.tolist()}")
            self._set_padding(padding)

    def _set_padding(self, padding: Tensor) -> None:
        self.padding, masks = padding, {}  # a new padding (rows selected): new masks
        for layer in self.layers:
            layer.padding = padding
            layer.masks = masks

    @property
    def length(self) -> int:
        """Positions cached: the next token's position."""
        return self.layers[0].length if self.layers else 0

    def truncate(self, length: int) -> None:
        """Forget the positions from ``length`` on, in every layer."""
        for layer in self.layers:
            layer.truncate(length)

    def select(self, rows: Tensor | list[int]) -> None:
        """Keep only the batch rows ``rows`` (indices, in the order wanted) in every layer: a batched decode drops
        the sequences that have ended, so the next forwards run only those still going."""
        rows = torch.as_tensor(rows, dtype=torch.long)
        for layer in self.layers:
            layer.select(rows)
        if self.padding is not None:
            self._set_padding(self.padding.index_select(0, rows.to(self.padding.device)))
