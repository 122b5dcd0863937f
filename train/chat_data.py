"""``moekit-prepare --chat``: conversations into token ids and a loss mask over the assistants' replies.

Each record's ``--field`` (default ``messages``) is a conversation, as OpenAI's and HuggingFace's chat datasets
hold them: a list of ``{"role": ..., "content": ...}``. It is rendered with the tokenizer folder's chat template
(moekit.train.inference.ChatTemplate: the same jinja2 environment as transformers' ``apply_chat_template``) and
encoded as transformers encodes a rendered template (no tokens added; the turn markers in the text become their
special tokens). The mask is 1 on the tokens of each assistant message as the template writes it (its text and
its end-of-turn marker) and 0 elsewhere (system and user turns, the generation prompt before each reply):

    rendered   <|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\nHello!<|im_end|>\\n
    mask       0 ...................................................... 1 .............. 0

A reply's characters are found by rendering the conversation up to it twice: with the generation prompt and
before it (``before``), and with the reply (``upto``). The reply is what ``upto`` adds to ``before``, and each of
the two must be a prefix of the whole rendering. A template that rewrites earlier turns once later ones come (a
reasoning model that drops earlier thinking, say) is refused with the conversation it failed on, since no single
token sequence then holds every reply as trained. A token counts when its first character lies inside a reply.
"""
from __future__ import annotations

import bisect
import os
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import numpy as np

from moekit.train import UserError
from moekit.train.documents import Counts

if TYPE_CHECKING:
    from moekit.train.prepare_tokenizer import TokenizerSpec

CHAT_FIELD = "messages"


def read_conversations(path: str, field: str) -> Iterator[tuple[str, object]]:
    """(where, the record's ``field``) of every record of a JSONL or Parquet file (moekit.train.documents' readers)."""
    from moekit.train.documents import input_kind, jsonl_values, parquet_values

    kind = input_kind(path)
    if kind == "jsonl":
        yield from jsonl_values(path, field, "conversation")
    elif kind == "parquet":
        yield from parquet_values(path, field, "conversation")
    else:
        raise UserError(f"input {path}: --chat reads conversations from .jsonl / .parquet records (a list of "
                        f"{{\"role\", \"content\"}} messages in --field {field!r}), not text files")


# ShareGPT's layout ({"from": "human" | "gpt" | "system", "value": ...}, its "conversations" field), as many chat
# datasets keep it: read as the roles apply_chat_template knows
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
                  "bing": "assistant", "bard": "assistant", "system": "system", "tool": "tool", "function": "tool"}


def check_messages(value, where: str) -> list[dict[str, str]]:
    """The conversation ``value`` as a list of {"role", "content"} strings, or a one-line UserError naming it.
    ShareGPT's messages ({"from", "value"}) are read with its roles mapped (SHAREGPT_ROLES)."""
    if not isinstance(value, list) or not all(isinstance(m, dict) for m in value):
        raise UserError(f"{where}: the conversation must be a list of {{\"role\", \"content\"}} messages, got "
                        f"{type(value).__name__}")
    if value and all("from" in m and "value" in m and "role" not in m for m in value):
        unknown = sorted({str(m["from"]) for m in value} - set(SHAREGPT_ROLES))
        if unknown:
            raise UserError(f"{where}: ShareGPT messages from {unknown} have no chat role; known: "
                            f"{sorted(SHAREGPT_ROLES)}")
        value = [{"role": SHAREGPT_ROLES[str(m["from"])], "content": m["value"]} for m in value]
    for i, m in enumerate(value):
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or not isinstance(content, str):
            raise UserError(f"{where}: message {i} needs a string role and a string content, got role {role!r} and "
                            f"content of type {type(content).__name__}")
    return [{"role": m["role"], "content": m["content"]} for m in value]


class ChatEncoder:
    """Renders and encodes conversations with one tokenizer.json and the chat template of its folder."""

    def __init__(self, tokenizer_file: str):
        from moekit.train.prepare_tokenizer import load_hf

        self.template = self.template_of(tokenizer_file)
        self.tok = load_hf(tokenizer_file)
        self.tok.encode_special_tokens = False  # the template's turn markers are its special tokens

    @staticmethod
    def template_of(tokenizer_file: str):
        """The chat template of the tokenizer.json's folder (moekit.train.inference.ChatTemplate), compiled."""
        from moekit.train.inference import ChatTemplate

        folder = Path(os.path.dirname(os.path.abspath(tokenizer_file)))
        try:
            return ChatTemplate.load(folder)
        except UserError as exc:
            if "no chat template" not in str(exc):
                raise
            raise UserError(f"--chat: {folder} has no chat template (tokenizer_config.json's chat_template, "
                            f"chat_template.jinja or chat_template.json) to render the conversations with; use a chat "
                            f"model's tokenizer folder, or prepare plain text without --chat") from None

    def encode(self, messages: list[dict[str, str]], where: str) -> tuple[np.ndarray, np.ndarray, int] | None:
        """(ids, mask, UTF-8 bytes of the rendering) of one conversation; None when it has no assistant reply."""
        replies = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if not replies:
            return None
        render = self.template.render
        whole = render(messages, add_generation_prompt=False)
        spans = []
        for i in replies:
            before = render(messages[:i], add_generation_prompt=True)
            upto = render(messages[: i + 1], add_generation_prompt=False)
            if not (upto.startswith(before) and whole.startswith(upto)):
                raise UserError(f"{where}: the chat template {self.template.source} renders the conversation's earlier "
                                f"turns differently once message {i} (assistant) follows, so its replies have no "
                                f"single token sequence to train on; use a template that renders each turn the same "
                                f"whatever follows it, or prepare the text without --chat")
            spans.append((len(before), len(upto)))
        enc = self.tok.encode(whole, add_special_tokens=False)
        starts = np.fromiter((a for a, _ in enc.offsets), dtype=np.int64, count=len(enc.offsets))
        mask = np.zeros(len(enc.ids), dtype=np.uint8)
        for a, b in spans:
            mask[(starts >= a) & (starts < b)] = 1
        return np.asarray(enc.ids, dtype=np.uint32), mask, len(whole.encode("utf-8"))


# ---------------------------------------------------------------------------------------------------
# Encoding in moekit-prepare's worker processes, in chunks of conversations
# ---------------------------------------------------------------------------------------------------

CHAT_CHUNK = 256  # conversations per chunk a worker encodes
_CHAT: tuple[TokenizerSpec, ChatEncoder] | None = None  # (spec, its chat encoder), per process


def init_chat(spec: TokenizerSpec, single_threaded: bool) -> None:
    global _CHAT
    if single_threaded:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        _CHAT = (spec, ChatEncoder(spec.file))
    except Exception as exc:  # raised with the first chunk: a pool respawns a worker whose initializer raised, forever
        _CHAT = (spec, exc)


def encode_chat_chunk(records: list[tuple[str, object]]) -> list[tuple[np.ndarray, int, np.ndarray] | None]:
    """(ids, UTF-8 bytes, loss mask) of each conversation, EOS (mask 0) after it; None for one without a reply."""
    spec, encoder = _CHAT
    if isinstance(encoder, Exception):
        raise encoder
    eos = None if spec.eos_id is None else np.array([spec.eos_id], dtype=np.uint32)
    out = []
    for where, value in records:
        got = encoder.encode(check_messages(value, where), where)
        if got is None:
            out.append(None)
            continue
        ids, mask, nbytes = got
        if eos is not None:
            ids, mask = np.concatenate([ids, eos]), np.concatenate([mask, np.zeros(1, np.uint8)])
        out.append((ids, nbytes, mask))
    return out


def chat_encoded(spec: TokenizerSpec, files: list[str], field: str, counts: Counts, workers: int) -> Iterator:
    """(ids, UTF-8 bytes, loss mask) of each conversation with a reply, in input order (``workers`` processes; the
    template already checked in this one: prepare)."""
    def chunked():
        chunk = []
        for path in files:
            for record in read_conversations(path, field):
                chunk.append(record)
                if len(chunk) == CHAT_CHUNK:
                    yield chunk
                    chunk = []
        if chunk:
            yield chunk

    from moekit.train.prepare import in_order  # the worker pool plain documents use too

    for results in in_order(chunked(), workers, init_chat, spec, encode_chat_chunk):
        for got in results:
            if got is None:  # nothing for the loss to count
                counts.empty += 1
                continue
            counts.documents += 1
            yield got


# ---------------------------------------------------------------------------------------------------
# --pack N: whole conversations in sequences of N tokens (best fit), so that no training window cuts one
# ---------------------------------------------------------------------------------------------------

PACK_OPEN = 1024  # sequences being filled at once: more fill them better and hold more conversations in memory


class Packer:
    """Conversations (ids and mask, each ending with EOS) into sequences of exactly ``length`` tokens, each holding
    whole conversations then EOS padding (mask 0): a training window of ``length`` tokens that starts at a sequence
    then holds every conversation whole, and every window starts after an EOS (so moekit.train.data.counted, which
    drops the targets of a conversation a window began inside, drops none).

    Best fit over the open sequences (at most ``open_limit``; past it the fullest is written out): a conversation
    goes where it leaves the least room, else opens a sequence. One longer than ``length`` keeps its first
    ``length - 1`` tokens and an EOS of mask 0 (its replies past that do not train; counted in ``cut``)."""

    def __init__(self, length: int, eos: int, open_limit: int = PACK_OPEN):
        if length < 2:
            raise ValueError(f"pack length {length}: must be at least 2")
        self.length, self.eos, self.open_limit = length, eos, open_limit
        self.room: list[int] = []  # free tokens of each open sequence, ascending
        self.bins: list[list[tuple[np.ndarray, np.ndarray]]] = []  # the parts of each, in self.room's order
        self.sequences = self.pad = self.cut = 0

    def add(self, ids: np.ndarray, mask: np.ndarray) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Place one conversation; yield the sequences (ids, mask) that are complete or pushed out by it."""
        n = ids.size
        if n > self.length:
            self.cut += 1
            ids = np.concatenate([ids[: self.length - 1], np.array([self.eos], ids.dtype)])
            mask = np.concatenate([mask[: self.length - 1], np.zeros(1, mask.dtype)])
            n = self.length
        i = bisect.bisect_left(self.room, n)  # the open sequence with the least room that still fits
        if i < len(self.room):
            room, parts = self.room.pop(i), self.bins.pop(i)
        else:
            room, parts = self.length, []
        parts.append((ids, mask))
        room -= n
        if room == 0:
            yield self._close(parts, 0)
        else:
            j = bisect.bisect_left(self.room, room)
            self.room.insert(j, room)
            self.bins.insert(j, parts)
        if len(self.room) > self.open_limit:  # the fullest leaves
            yield self._close(self.bins.pop(0), self.room.pop(0))

    def finish(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """The open sequences, fullest first."""
        while self.room:
            yield self._close(self.bins.pop(0), self.room.pop(0))

    def _close(self, parts: list[tuple[np.ndarray, np.ndarray]], room: int) -> tuple[np.ndarray, np.ndarray]:
        dtype = parts[0][0].dtype
        ids = np.concatenate([p[0] for p in parts] + [np.full(room, self.eos, dtype)])
        mask = np.concatenate([p[1] for p in parts] + [np.zeros(room, np.uint8)])
        self.sequences += 1
        self.pad += room
        return ids, mask
