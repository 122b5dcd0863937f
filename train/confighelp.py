"""``moekit-train --help-config [SECTION]``: every setting with its type, default and meaning.

The meanings are the config classes' own field comments (``name: type = default  # meaning``), read from
their source, so the help cannot drift from the code: a field without a comment is listed as such, and
tests/test_confighelp.py fails on it.
"""
from __future__ import annotations

import dataclasses
import inspect
import io
import textwrap
import tokenize
import typing

from moekit.train import UserError


def field_comments(cls: type) -> dict[str, str]:
    """{field name: its trailing comment} for a dataclass whose fields are written one per line. A comment line
    right below a field (indented past the fields, or at their indent as ``#   text``: a hash and at least two
    spaces, where a section heading has one) continues its text."""
    source = textwrap.dedent(inspect.getsource(cls))
    names = {f.name for f in dataclasses.fields(cls)}
    comments: dict[str, str] = {}
    line_field: dict[int, str] = {}
    last, last_line = None, -1  # the field a comment-only line right below continues, and that line
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    for i, tok in enumerate(tokens):
        if tok.type == tokenize.NAME and tok.string in names and tok.start[1] == 4 and i + 1 < len(tokens) \
                and tokens[i + 1].string == ":":
            line_field[tok.start[0]] = tok.string
        elif tok.type == tokenize.COMMENT:
            text = tok.string.lstrip("#").strip()
            row = tok.start[0]
            if row in line_field:
                comments[line_field[row]] = text
                last, last_line = line_field[row], row
            elif last is not None and tok.line.strip().startswith("#") and row == last_line + 1 \
                    and (tok.start[1] > 4 or tok.string.startswith("#  ")):
                comments[last] += " " + text
                last_line = row
    return comments


def _type_name(tp) -> str:
    if isinstance(tp, type):
        return tp.__name__
    text = str(tp).replace("typing.", "")
    return text


def sections(cfg) -> dict[str, object]:
    """Section name -> its current value object (a train.config.TrainConfig's model, train, data, ...)."""
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name != "preset"}


def describe(cfg, which: str = "all") -> str:
    """The help text for ``which`` ("all" or a section name), defaults taken from ``cfg`` (the preset's)."""
    secs = sections(cfg)
    if which != "all" and which not in secs:
        raise UserError(f"--help-config {which}: no such section; sections are {list(secs)}")
    out = []
    for name, value in secs.items():
        if which not in ("all", name):
            continue
        cls = type(value)
        hints, comments = typing.get_type_hints(cls), field_comments(cls)
        doc = (cls.__doc__ or "").strip().splitlines()
        own = doc and not doc[0].startswith(f"{cls.__name__}(")  # not the dataclass's generated signature
        out.append(f"[{name}]" + (f"  {doc[0]}" if own else ""))
        for f in dataclasses.fields(cls):
            default = getattr(value, f.name)
            shown = "none" if default is None else (str(default).lower() if isinstance(default, bool) else repr(default)
                                                    if isinstance(default, str) else str(default))
            out.append(f"  --{name}.{f.name} {_type_name(hints[f.name])} (default {shown})")
            out.append(textwrap.fill(comments.get(f.name, "(no description)"), 100, initial_indent="      ",
                                     subsequent_indent="      "))
        out.append("")
    out.append(f"model defaults are the preset's ({cfg.preset}); --preset NAME --help-config model shows another's")
    return "\n".join(out)
