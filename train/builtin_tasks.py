"""The built-in tasks (moekit.train.tasks.BUILTINS): multiple-choice items made from the evaluation data's
held-out windows (the text the model did not train on), 4 choices each (chance 25%):

    @next-line     the lines before a line as context; that line and three other lines of the same text
    @continuation  a window's text as context; its last CONTINUATION_CHARS characters and the endings of three
                   other windows. The better smoke signal for small models: mixtral-tiny after README's 400
                   steps picks the right ending 48% of the time (26% after one step), the right line 29%
                   (acc_norm; 26% after one step)

``window_texts`` decodes the windows; ``builtin_task`` makes a task of them (moekit-eval --tasks, and the trainer's
--eval.tasks alike).
"""
from __future__ import annotations

import random

import numpy as np

from moekit.train import UserError
from moekit.train.tasks import CONTINUATION, NEXT_LINE, Item, Task

WINDOWS_PER_ITEM = 4  # held-out windows decoded per item wanted (a short window may hold no whole line)
CONTINUATION_CHARS = 32  # the ending a @continuation item asks for (shorter separates a trained model better)
NEXT_LINE_CHOICES = 4
NEXT_LINE_CONTEXT_LINES = 8  # lines before the answer given as context (fewer at a window's start)
NEXT_LINE_CHARS = (8, 120)  # a candidate line's length, stripped: long enough to be told apart, short to score


def window_texts(tokens, starts: np.ndarray, seq_len: int, tokenizer) -> list[str]:
    """The text of the windows of seq_len + 1 tokens at ``starts`` of ``tokens`` (an array, or a blend's tokens)."""
    ids = np.asarray(tokens[np.asarray(starts)[:, None] + np.arange(seq_len + 1)[None, :]])
    return [tokenizer.decode(row.tolist()) for row in ids]


def next_line_items(texts: list[str], count: int, seed: int = 0) -> list[Item]:
    """Up to ``count`` next-line items from ``texts`` (held-out windows' text, each cut at both ends): the context
    is up to NEXT_LINE_CONTEXT_LINES whole lines, the answer the next line, the distractors other lines of the texts
    with a different content. The items are spread evenly over the candidates; the choices' order and the
    distractors come from ``seed``."""
    lo, hi = NEXT_LINE_CHARS
    candidates: list[tuple[str, str]] = []  # (context, answer line)
    pool: set[str] = set()
    for text in texts:
        lines = text.split("\n")[1:-1]  # a window starts and ends mid-line: those partial lines go
        for j, line in enumerate(lines):
            if not lo <= len(line.strip()) <= hi:
                continue
            pool.add(line)
            before = lines[max(0, j - NEXT_LINE_CONTEXT_LINES) : j]
            if any(b.strip() for b in before):
                candidates.append(("\n".join(before) + "\n", line))
    distinct = {line.strip() for line in pool}
    if not candidates or len(distinct) < NEXT_LINE_CHOICES:
        raise UserError(f"{NEXT_LINE}: the held-out text has {len(candidates)} lines of {lo}-{hi} characters after "
                        f"another line and {len(distinct)} distinct such lines; it needs at least 1 and "
                        f"{NEXT_LINE_CHOICES}. Evaluate with a longer --seq-len, or more held-out data")
    rng = random.Random(seed)
    pool_list = sorted(pool)
    picks = spread(len(candidates), count)
    items = []
    for n, index in enumerate(picks):
        context, answer = candidates[index]
        others: list[str] = []
        seen = {answer.strip()}
        while len(others) < NEXT_LINE_CHOICES - 1:
            line = pool_list[rng.randrange(len(pool_list))]
            if line.strip() not in seen:
                seen.add(line.strip())
                others.append(line)
        label = rng.randrange(NEXT_LINE_CHOICES)
        lines = others[:label] + [answer] + others[label:]
        items.append(Item([(context, line) for line in lines], label, f"{NEXT_LINE} item {n + 1}"))
    return items


def spread(n: int, count: int) -> list[int]:
    """``min(count, n)`` distinct indices into ``n`` candidates, spread evenly from the first to the last."""
    m = min(count, n)
    return sorted({round(i * (n - 1) / max(m - 1, 1)) for i in range(m)})


def continuation_items(texts: list[str], count: int, seed: int = 0) -> list[Item]:
    """Up to ``count`` @continuation items from ``texts`` (held-out windows' text, spread evenly): the context is a
    text but its last CONTINUATION_CHARS characters, the answer those, the distractors the endings of three other
    texts (a different ending each). The choices' order and the distractors come from ``seed``."""
    k = CONTINUATION_CHARS
    usable = [t for t in texts if len(t) > 2 * k]  # some context before the ending
    endings = sorted({t[-k:] for t in usable})
    if len(endings) < NEXT_LINE_CHOICES:
        raise UserError(f"{CONTINUATION}: the held-out text gives {len(usable)} windows of more than {2 * k} "
                        f"characters with {len(endings)} different endings; it needs {NEXT_LINE_CHOICES}. Evaluate "
                        f"with a longer --seq-len, or more held-out data")
    rng = random.Random(seed)
    picks = spread(len(usable), count)
    items = []
    for n, index in enumerate(picks):
        text = usable[index]
        answer = text[-k:]
        others = rng.sample([e for e in endings if e != answer], NEXT_LINE_CHOICES - 1)
        label = rng.randrange(NEXT_LINE_CHOICES)
        choices = others[:label] + [answer] + others[label:]
        items.append(Item([(text[:-k], c) for c in choices], label, f"{CONTINUATION} item {n + 1}"))
    return items


def builtin_task(name: str, texts: list[str], count: int) -> Task:
    """A built-in task (BUILTINS) of up to ``count`` items from held-out ``texts``."""
    if name == NEXT_LINE:
        return Task(NEXT_LINE, NEXT_LINE, "next-line", next_line_items(texts, count))
    return Task(CONTINUATION, CONTINUATION, "continuation", continuation_items(texts, count))


