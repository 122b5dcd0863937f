"""OpenAI's harmony format (gpt-oss): the assistant's answer out of its generated messages.

gpt-oss answers a chat in channels. After its chat template's generation prompt (``<|start|>assistant``) the model
writes one or more messages, each a header and a body:

    <|channel|>analysis<|message|>  the reasoning ...           <|end|>
    <|start|>assistant<|channel|>final<|message|>  the answer   <|return|>

``<|end|>`` closes a message and another follows; ``<|return|>`` (or ``<|call|>``, a tool call) ends the turn. A
header may carry more after the channel name (``to=functions.f``, ``<|constrain|>json``). The markers are special
tokens, which decoding drops, so the raw continuation runs the reasoning and the answer together; moekit-generate
--chat prints the ``final`` channel instead (``--show-reasoning``: the others too, on stderr).
"""
from __future__ import annotations

from dataclasses import dataclass

MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>")
TURN_ENDS = ("<|return|>", "<|call|>")


@dataclass(frozen=True)
class Message:
    channel: str  # "analysis", "commentary", "final", ... ("" when the header names none)
    header: str  # the whole header text (role, channel, recipient, constraint)
    text: str  # the body
    complete: bool  # closed by <|end|>, <|return|> or <|call|> (else generation stopped inside it)


def marker_ids(tokenizer) -> dict[str, int] | None:
    """The harmony markers' token ids, or None when the tokenizer lacks any of them (not a harmony model)."""
    tok = getattr(tokenizer, "tok", None)  # HFTokenizer's tokenizers.Tokenizer; a byte tokenizer has none
    if tok is None:
        return None
    ids = {m: tok.token_to_id(m) for m in (*MARKERS, "<|call|>")}
    if any(ids[m] is None for m in MARKERS):
        return None
    return {m: i for m, i in ids.items() if i is not None}


def messages(tokenizer, ids: list[int], markers: dict[str, int]) -> list[Message]:
    """The messages of generated ``ids`` (which start inside the header of the first one: after the generation
    prompt's ``<|start|>assistant``). Text between a turn's end and the next ``<|start|>`` belongs to no message
    and is dropped."""
    by_id = {i: m for m, i in markers.items()}
    out: list[Message] = []
    header: list[int] = []
    body: list[int] | None = None  # None: reading a header
    inside = True  # the generation prompt opened the first message

    def close(complete: bool) -> None:
        out.append(Message(_channel(tokenizer, header, markers), tokenizer.decode(header).strip(),
                           tokenizer.decode(body or []), complete))

    for i in ids:
        mark = by_id.get(i)
        if mark == "<|start|>":
            if inside and (header or body):
                close(False)
            header, body, inside = [], None, True
        elif not inside:
            continue
        elif mark == "<|message|>" and body is None:
            body = []
        elif mark in ("<|end|>", *TURN_ENDS):
            close(True)
            header, body, inside = [], None, False
        elif body is None:
            header.append(i)
        else:
            body.append(i)
    if inside and (header or body):
        close(False)
    return out


def _channel(tokenizer, header: list[int], markers: dict[str, int]) -> str:
    """The word after ``<|channel|>`` in a header."""
    mark = markers["<|channel|>"]
    if mark not in header:
        return ""
    words = tokenizer.decode(header[header.index(mark) + 1:]).split()
    return words[0] if words else ""


def answer(found: list[Message]) -> str | None:
    """The final channel's text (the last final message's), or None when the model wrote none."""
    finals = [m.text for m in found if m.channel == "final"]
    return finals[-1].strip() if finals else None
