"""Multiple-choice tasks for downstream evaluation (``moekit-eval --tasks``, the trainer's ``--eval.tasks``): what
an item is, the file formats read, and the task built from held-out text (``@next-line``).

An item is a question with N choices, each a (context, continuation) pair of strings, and the index of the right
one. A model answers by the log-likelihood of each continuation given its context (moekit.train.task_eval), as
lm-evaluation-harness scores its multiple-choice tasks, so the numbers compare with the ones model cards report
(same prompts where the format is one of the public sets below; the prompts are written out here, not taken from
that project).

Files: ``.jsonl`` (one record per line), ``.json`` (a list of records) or ``.parquet`` (one record per row, as the
HuggingFace Hub serves datasets; needs pyarrow, the ``data`` extra). The format is recognised from the first
record's fields, and every record must have it:

    generic     {"context": str, "choices": [str, ...], "label": int}: each choice is appended to the context as it
                is (put the separating space in the choices)
    hellaswag   {"ctx" | "ctx_a" + "ctx_b", "endings": [...], "label", "activity_label"?}: "{activity}: {ctx}" then
                " {ending}", WikiHow's "[title]"-style markers cleaned
    arc         {"question": str, "choices": {"text": [...], "label": [...]}, "answerKey"} (the Hub's ARC; the
                original {"question": {"stem", "choices": [{"text", "label"}]}} too): "Question: {q}\\nAnswer:" then
                " {text}"
    openbookqa  {"question_stem", "choices": {"text", "label"}, "answerKey"}: the stem, then " {text}"
    piqa        {"goal", "sol1", "sol2", "label"}: "Question: {goal}\\nAnswer:" then " {sol}"
    sciq        {"question", "support", "distractor1..3", "correct_answer"}: "{support}\\nQuestion: {q}\\nAnswer:"
    mmlu        {"question", "choices": [...], "answer": int}: the question, its lettered choices and "Answer:",
                then " A", " B", ...
    winogrande  {"sentence" with one "_", "option1", "option2", "answer": "1" | "2"}: the option in place of the
                blank is the context, the rest of the sentence the continuation (the same for both choices)

Few-shot (``fewshot`` K: moekit-eval --fewshot, the trainer's --eval.task_fewshot): each item's contexts start with
K other items of the same file, solved (context and right continuation, then a blank line), as model cards' 5-shot
MMLU or 25-shot ARC are scored; the examples are drawn per item from a fixed seed.

Two tasks need no file, ``@next-line`` and ``@continuation`` (BUILTINS): moekit.train.builtin_tasks makes them from
the evaluation data's held-out text.
"""
from __future__ import annotations

import json
import math
import os
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from moekit.train import UserError

NEXT_LINE = "@next-line"
CONTINUATION = "@continuation"
BUILTINS = (NEXT_LINE, CONTINUATION)  # tasks built from held-out text (moekit.train.builtin_tasks)
BUILTIN_ITEMS = 500  # items of a built-in task by default (moekit-eval without --limit)


@dataclass
class Item:
    """One question: ``choices`` [(context, continuation)], ``label`` the right choice's index, ``where`` its record."""

    choices: list[tuple[str, str]]
    label: int
    where: str


@dataclass
class Task:
    name: str
    source: str  # the file, or a built-in's name (BUILTINS)
    format: str
    items: list[Item]
    fewshot: int = 0  # solved examples before each item (with_fewshot)


# ---------------------------------------------------------------------------------------------------
# Records of a file
# ---------------------------------------------------------------------------------------------------


def _records(path: str) -> Iterator[tuple[str, dict]]:
    """(where, record) of every record of a task file."""
    lower = path.lower()
    if lower.endswith(".parquet"):
        yield from _parquet_records(path)
        return
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        raise UserError(f"--tasks {path}: no such file; give a .jsonl, .json or .parquet task file, or "
                        f"{NEXT_LINE}") from None
    except IsADirectoryError:
        raise UserError(f"--tasks {path}: a directory; name the task file inside it") from None
    except OSError as exc:
        raise UserError(f"--tasks {path}: unreadable ({exc.strerror or exc})") from None
    try:
        text = raw.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as exc:
        raise UserError(f"--tasks {path}: not UTF-8 text (byte {exc.start}); task files are JSON Lines, JSON or "
                        f"Parquet") from None
    if lower.endswith(".json"):
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise UserError(f"--tasks {path}: invalid JSON ({exc})") from None
        if isinstance(data, dict) and isinstance(data.get("data"), list):
            data = data["data"]  # {"data": [...]}, as some exports wrap them
        if not isinstance(data, list):
            raise UserError(f"--tasks {path}: a .json task file holds a list of records, got "
                            f"{type(data).__name__}; or write one record per line to a .jsonl file")
        for number, record in enumerate(data, 1):
            yield f"{path} record {number}", record
        return
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path} line {number}"
        try:
            yield where, json.loads(line)
        except ValueError as exc:
            raise UserError(f"{where}: invalid JSON ({exc}); a .jsonl task file holds one JSON object per "
                            f"line") from None


def _parquet_records(path: str) -> Iterator[tuple[str, dict]]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError(f"--tasks {path}: reading Parquet needs pyarrow: pip install 'moekit[data]' "
                        f"(or pip install pyarrow)") from None
    if not os.path.isfile(path):
        raise UserError(f"--tasks {path}: no such file; give a .jsonl, .json or .parquet task file, or "
                        f"{NEXT_LINE}")
    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowException) as exc:
        raise UserError(f"--tasks {path}: not a readable Parquet file ({str(exc).splitlines()[0]})") from None
    for number, record in enumerate(table.to_pylist(), 1):
        yield f"{path} row {number}", record


# ---------------------------------------------------------------------------------------------------
# Formats
# ---------------------------------------------------------------------------------------------------


def _need(record: dict, where: str, key: str, kind: type | tuple[type, ...], fmt: str):
    value = record.get(key)
    if not isinstance(value, kind) or isinstance(value, bool):
        got = "missing" if key not in record else f"{type(value).__name__} {str(value)[:40]!r}"
        want = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise UserError(f"{where}: field {key!r} must be a {want} in the {fmt} format, got {got}; fix the record")
    return value


def _texts(values, where: str, key: str, fmt: str) -> list[str]:
    if not isinstance(values, list) or len(values) < 2 or not all(isinstance(v, str) for v in values):
        raise UserError(f"{where}: {key!r} must be a list of at least 2 strings in the {fmt} format, got "
                        f"{str(values)[:80]}; fix the record")
    return values


def _index(label, count: int, where: str, key: str, offset: int = 0) -> int:
    """An integer label (or its digits as a string, as the Hub stores some) in [0, count) after ``offset``."""
    if isinstance(label, str) and label.strip().lstrip("-").isdigit():
        label = int(label)
    if not isinstance(label, int) or isinstance(label, bool):
        hint = " (a test split without answers?); evaluate on a split that has them" if label in ("", None) else ""
        raise UserError(f"{where}: {key!r} is {label!r}, not the index of a choice{hint}")
    if not 0 <= label - offset < count:
        raise UserError(f"{where}: {key!r} is {label}, outside the {count} choices "
                        f"({offset}..{count - 1 + offset}); fix the record")
    return label - offset


def _lettered(choices, answer, where: str, fmt: str) -> tuple[list[str], int]:
    """{"text": [...], "label": ["A", ...]} (or a list of {"text", "label"}) and the answer's label."""
    if isinstance(choices, list) and all(isinstance(c, dict) for c in choices):  # the original ARC / OBQA files
        choices = {"text": [c.get("text") for c in choices], "label": [c.get("label") for c in choices]}
    if not isinstance(choices, dict):
        raise UserError(f"{where}: 'choices' must be {{\"text\": [...], \"label\": [...]}} in the {fmt} format, got "
                        f"{str(choices)[:80]}; fix the record")
    texts = _texts(choices.get("text"), where, "choices.text", fmt)
    labels = [str(v) for v in choices.get("label") or ()]
    if len(labels) != len(texts):
        raise UserError(f"{where}: {len(texts)} choice texts but {len(labels)} labels; fix the record")
    if str(answer) not in labels:
        raise UserError(f"{where}: answerKey {answer!r} is none of the choices' labels {labels}; fix the record")
    return texts, labels.index(str(answer))


def _clean(text: str) -> str:
    """HellaSwag's WikiHow text: " [title]" starts a new sentence, other [markers] go, spaces are single."""
    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return re.sub(r"  +", " ", text).strip()


def _generic(r: dict, where: str) -> Item:
    context = _need(r, where, "context", str, "generic")
    choices = _texts(r.get("choices"), where, "choices", "generic")
    return Item([(context, c) for c in choices], _index(r.get("label"), len(choices), where, "label"), where)


def _hellaswag(r: dict, where: str) -> Item:
    if isinstance(r.get("ctx"), str):
        ctx = r["ctx"]
    else:
        ctx_a, ctx_b = (_need(r, where, k, str, "hellaswag") for k in ("ctx_a", "ctx_b"))
        ctx = f"{ctx_a} {ctx_b[:1].upper()}{ctx_b[1:]}" if ctx_b else ctx_a
    endings = _texts(r.get("endings"), where, "endings", "hellaswag")
    activity = r.get("activity_label")
    context = _clean(f"{activity}: {ctx}" if isinstance(activity, str) and activity else ctx)
    return Item([(context, " " + _clean(e)) for e in endings], _index(r.get("label"), len(endings), where, "label"),
                where)


def _arc(r: dict, where: str) -> Item:
    question = r.get("question")
    choices = r.get("choices")
    if isinstance(question, dict):  # the original release: the choices inside the question
        choices, question = question.get("choices"), question.get("stem")
    if not isinstance(question, str):
        raise UserError(f"{where}: 'question' must be a string (or {{\"stem\", \"choices\"}}) in the arc format; "
                        f"fix the record")
    texts, label = _lettered(choices, r.get("answerKey"), where, "arc")
    return Item([(f"Question: {question}\nAnswer:", " " + t) for t in texts], label, where)


def _openbookqa(r: dict, where: str) -> Item:
    stem = _need(r, where, "question_stem", str, "openbookqa")
    texts, label = _lettered(r.get("choices"), r.get("answerKey"), where, "openbookqa")
    return Item([(stem, " " + t) for t in texts], label, where)


def _piqa(r: dict, where: str) -> Item:
    goal = _need(r, where, "goal", str, "piqa")
    sols = [_need(r, where, k, str, "piqa") for k in ("sol1", "sol2")]
    return Item([(f"Question: {goal}\nAnswer:", " " + s) for s in sols], _index(r.get("label"), 2, where, "label"),
                where)


def _sciq(r: dict, where: str) -> Item:
    question = _need(r, where, "question", str, "sciq")
    support = r.get("support") if isinstance(r.get("support"), str) else ""
    answers = [_need(r, where, k, str, "sciq") for k in ("distractor1", "distractor2", "distractor3", "correct_answer")]
    context = f"{support.strip()}\nQuestion: {question}\nAnswer:".lstrip("\n")
    return Item([(context, " " + a) for a in answers], 3, where)


def _mmlu(r: dict, where: str) -> Item:
    question = _need(r, where, "question", str, "mmlu")
    choices = _texts(r.get("choices"), where, "choices", "mmlu")
    if len(choices) > 26:
        raise UserError(f"{where}: {len(choices)} choices; the mmlu format letters at most 26")
    letters = [chr(ord("A") + i) for i in range(len(choices))]
    body = "\n".join(f"{letter}. {c}" for letter, c in zip(letters, choices))
    context = f"{question.strip()}\n{body}\nAnswer:"
    return Item([(context, " " + letter) for letter in letters], _index(r.get("answer"), len(choices), where,
                                                                          "answer"), where)


def _winogrande(r: dict, where: str) -> Item:
    sentence = _need(r, where, "sentence", str, "winogrande")
    if sentence.count("_") != 1:
        raise UserError(f"{where}: the winogrande sentence must hold one '_' (the blank), it holds "
                        f"{sentence.count('_')}; fix the record")
    options = [_need(r, where, k, str, "winogrande") for k in ("option1", "option2")]
    before, after = sentence.split("_")
    rest = " " + after.strip()
    if not after.strip():
        raise UserError(f"{where}: nothing follows the blank, so there is no continuation to score; fix the record")
    return Item([(before + o, rest) for o in options], _index(r.get("answer"), 2, where, "answer", offset=1), where)


# name -> (the fields that identify it, the converter); checked in this order
FORMATS = {
    "generic": ({"context", "choices", "label"}, _generic),
    "hellaswag": ({"endings", "label"}, _hellaswag),
    "winogrande": ({"sentence", "option1", "option2", "answer"}, _winogrande),
    "piqa": ({"goal", "sol1", "sol2", "label"}, _piqa),
    "sciq": ({"question", "correct_answer", "distractor1"}, _sciq),
    "openbookqa": ({"question_stem", "choices", "answerKey"}, _openbookqa),
    "arc": ({"question", "answerKey"}, _arc),
    "mmlu": ({"question", "choices", "answer"}, _mmlu),
}


def detect_format(record: dict, where: str) -> str:
    for name, (keys, _) in FORMATS.items():
        if keys <= record.keys():
            return name
    from moekit.train.gen_tasks import detect_gen_format

    generative = detect_gen_format(record)
    if generative is not None:  # read_any reads it; the trainer's in-loop scoring does not
        raise UserError(f"{where}: a generative task ({generative}: the model writes its answer); the trainer's "
                        f"--eval.tasks scores multiple-choice tasks only: score it after training with moekit-eval "
                        f"--tasks {re.sub(r' (line|record|row) [0-9]+$', '', where)}")
    known = "; ".join(f"{name} {{{', '.join(sorted(keys))}}}" for name, (keys, _) in FORMATS.items())
    raise UserError(f"{where}: a record with fields {sorted(record)[:12]} is no task format moekit reads; the "
                    f"formats and the fields that identify them: {known}")


def read_task(path: str, limit: int | None = None, fewshot: int = 0, seed: int = 0) -> Task:
    """The items of a task file (the first ``limit``, or all); with ``fewshot`` K, each item's contexts start with
    K solved items of the same file (``with_fewshot``), drawn from all of its items."""
    items, fmt = [], None
    for where, record in _records(path):
        if limit is not None and len(items) >= limit and not fewshot:
            break
        if not isinstance(record, dict):
            raise UserError(f"{where}: expected a JSON object, got {type(record).__name__}")
        if fmt is None:
            fmt = detect_format(record, where)
        items.append(FORMATS[fmt][1](record, where))
    if not items:
        raise UserError(f"--tasks {path}: holds no record; give a task file with items")
    if fewshot:
        items = with_fewshot(items, fewshot, seed, path)
    return Task(Path(path).stem, path, fmt, items[:limit] if limit is not None else items, fewshot)


def read_any(path: str, limit: int | None = None, fewshot: int = 0, seed: int = 0):
    """A multiple-choice Task (``read_task``) or a generative one (moekit.train.gen_tasks.GenTask), by the first
    record's fields (moekit-eval --tasks)."""
    import itertools

    from moekit.train.gen_tasks import detect_gen_format, gen_task

    records = _records(path)
    first = next(records, None)
    if first is None:
        raise UserError(f"--tasks {path}: holds no record; give a task file with items")
    record = first[1]
    if isinstance(record, dict) and not any(keys <= record.keys() for keys, _ in FORMATS.values()):
        fmt = detect_gen_format(record)
        if fmt is not None:
            return gen_task(path, itertools.chain([first], records), fmt, limit, fewshot, seed)
    return read_task(path, limit, fewshot, seed)


FEWSHOT_DELIMITER = "\n\n"  # between solved examples, and before the item itself


def fewshot_examples(count: int, k: int, seed: int, path: str) -> list[list[int]]:
    """For each of ``count`` items, the indices of its K examples: K others, drawn with random.Random("seed:i"), so
    they depend neither on which items are scored (--limit) nor on the process. A UserError when there are too few."""
    if count <= k:
        raise UserError(f"--fewshot {k} needs at least {k + 1} items in {path} (K examples besides each item); it "
                        f"has {count}: use a smaller --fewshot")
    return [[j if j < i else j + 1 for j in random.Random(f"{seed}:{i}").sample(range(count - 1), k)]
            for i in range(count)]


def with_fewshot(items: list[Item], k: int, seed: int, path: str) -> list[Item]:
    """Each item with K other items of ``items``, solved (the context and the right continuation), before each of
    its contexts, FEWSHOT_DELIMITER after each. The examples of item i are drawn with random.Random((seed, i)),
    so they do not depend on which other items are scored (--limit) nor on the process."""
    out = []
    for item, others in zip(items, fewshot_examples(len(items), k, seed, path)):
        shots = "".join("".join(items[j].choices[items[j].label]) + FEWSHOT_DELIMITER for j in others)
        out.append(Item([(shots + c, cont) for c, cont in item.choices], item.label, item.where))
    return out


def parse_specs(value: str | list[str], flag: str = "--tasks") -> list[str]:
    """``flag``'s values: paths and built-in names (BUILTINS), comma-separated or repeated; duplicates refused."""
    parts = value.split(",") if isinstance(value, str) else [p for v in value for p in v.split(",")]
    specs = [p.strip() for p in parts if p.strip()]
    if not specs:
        raise UserError(f"{flag} is empty; name task files (.jsonl, .json, .parquet) or {' / '.join(BUILTINS)}")
    for spec in specs:
        if spec.startswith("@") and spec not in BUILTINS:
            raise UserError(f"{flag} {spec}: no built-in task by that name; the built-in ones are "
                            f"{', '.join(BUILTINS)}")
    names = [s if s in BUILTINS else Path(s).stem for s in specs]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise UserError(f"{flag} names two tasks {dup!r} (a task is named by its file's stem); rename one file")
    return specs


def check_specs(value: str, flag: str) -> list[str]:
    """``parse_specs``, and every named file exists (read later, by every rank)."""
    specs = parse_specs(value, flag)
    for spec in specs:
        if spec not in BUILTINS and not os.path.isfile(spec):
            what = "a directory" if os.path.isdir(spec) else "no such file"
            raise UserError(f"{flag} {spec}: {what}; give .jsonl, .json or .parquet task files, or "
                            f"{' / '.join(BUILTINS)}")
    return specs


def chance(items: list[Item]) -> float:
    """Accuracy of guessing: the mean of 1 / the number of choices."""
    return sum(1 / len(item.choices) for item in items) / len(items)


def stderr(p: float, n: int) -> float:
    """Standard error of an accuracy ``p`` over ``n`` items (the sample standard deviation over sqrt(n))."""
    return math.sqrt(p * (1 - p) / (n - 1)) if n > 1 else math.nan
