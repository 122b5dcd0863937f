"""Generative tasks for ``moekit-eval --tasks``: the model writes an answer (greedy decoding, up to
``--max-new-tokens``, cut at the task's stop strings) and the answer is compared with the reference, as
lm-evaluation-harness scores its ``generate_until`` tasks (the prompts and rules are written out here, not taken
from that project). The multiple-choice tasks are moekit.train.tasks'; a file is one or the other by its first
record's fields.

    gsm8k   {"question": str, "answer": str ending "#### N"} (GSM8K's layout on the Hub): the prompt is
            "Question: {question}\\nAnswer:", the reference N (the number after "####"); the generation stops at a
            blank line or "Question:". ``exact_match``: the generation's own "#### M" with M == N (strict, what a
            model taught the format writes); ``flexible_match``: the last number in the generation == N. Numbers
            compare without thousands separators, "$" or a trailing "." (so "1,000." == "1000").
    qa      {"prompt": str, "answer": str | [str, ...]}: the prompt as it is; the generation stops at the end of its
            first line. ``exact_match``: the generation equals an answer, both lowercased, whitespace collapsed and
            trailing punctuation dropped; ``contains``: an answer (so normalised) occurs in it.

Few-shot (``--fewshot K``): K other items of the same file, solved (the prompt, then the whole reference answer:
GSM8K's worked solution ending in "#### N"), each followed by a blank line, before the item's prompt; drawn per item
from a fixed seed, as the multiple-choice tasks' (moekit.train.tasks.with_fewshot).

The trainer's ``--eval.tasks`` scores multiple-choice tasks only (one forward per choice under any layout); a
generative file is refused there with the way to score it after training.
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass

from moekit.train import UserError
from moekit.train.tasks import FEWSHOT_DELIMITER, fewshot_examples, stderr

GSM8K_STOPS = ("\n\n", "Question:")
QA_STOPS = ("\n",)
_NUMBER = re.compile(r"-?[$]?\d[\d,]*(?:\.\d+)?")
_STRICT = re.compile(r"####\s*(-?[$]?\d[\d,]*(?:\.\d+)?)")


@dataclass
class GenItem:
    prompt: str
    targets: list[str]  # the reference answers (normalised when compared)
    solution: str  # what a solved few-shot example shows after the prompt
    where: str


@dataclass
class GenTask:
    name: str
    source: str
    format: str  # one of GEN_FORMATS
    items: list[GenItem]
    stops: tuple[str, ...]
    fewshot: int = 0


def normalize_number(text: str) -> str:
    """"$1,000." -> "1000"; "-3.50" -> "-3.5"; "7.0" -> "7" (GSM8K's answers are integers; a model may write 7.0)."""
    s = text.strip().rstrip(".").replace(",", "").replace("$", "")
    if re.fullmatch(r"-?\d+\.\d+", s):
        s = s.rstrip("0").rstrip(".")
    return s


def normalize_text(text: str) -> str:
    return re.sub(r"\s+", " ", text.strip().lower()).rstrip(".!?;:, ")


def _gsm8k(r: dict, where: str) -> GenItem:
    q, a = r.get("question"), r.get("answer")
    if not isinstance(q, str) or not q.strip():
        raise UserError(f"{where}: gsm8k records need a non-empty string \"question\"")
    if not isinstance(a, str) or "####" not in a:
        raise UserError(f"{where}: a gsm8k \"answer\" must be a string ending \"#### N\" (the worked solution, then "
                        f"the number); got {str(a)[:60]!r}")
    final = _STRICT.search(a[a.rindex("####"):])
    if final is None:
        raise UserError(f"{where}: no number after \"####\" in the answer ({a[a.rindex('####'):][:40]!r})")
    return GenItem(f"Question: {q.strip()}\nAnswer:", [normalize_number(final[1])], " " + a.strip(), where)


def _qa(r: dict, where: str) -> GenItem:
    prompt, answer = r.get("prompt"), r.get("answer")
    if not isinstance(prompt, str) or not prompt:
        raise UserError(f"{where}: qa records need a non-empty string \"prompt\"")
    answers = [answer] if isinstance(answer, str) else answer
    if not isinstance(answers, list) or not answers or not all(isinstance(x, str) and x.strip() for x in answers):
        raise UserError(f"{where}: a qa \"answer\" must be a non-empty string or a list of them; got {answer!r:.60}")
    sep = "" if prompt[-1].isspace() else " "
    return GenItem(prompt, answers, sep + answers[0].strip(), where)


# name -> (the fields that identify it, the converter, the stop strings)
GEN_FORMATS = {
    "gsm8k": ({"question", "answer"}, _gsm8k, GSM8K_STOPS),
    "qa": ({"prompt", "answer"}, _qa, QA_STOPS),
}


def detect_gen_format(record: dict) -> str | None:
    for name, (keys, _, _) in GEN_FORMATS.items():
        if keys <= record.keys():
            return name
    return None


def gen_task(path: str, records, fmt: str, limit: int | None, fewshot: int, seed: int = 0) -> GenTask:
    """The items of a generative task file (``records``: its (where, record) pairs, moekit.train.tasks reads them)."""
    from pathlib import Path

    convert = GEN_FORMATS[fmt][1]
    items = []
    for where, record in records:
        if limit is not None and len(items) >= limit and not fewshot:
            break
        if not isinstance(record, dict):
            raise UserError(f"{where}: expected a JSON object, got {type(record).__name__}")
        items.append(convert(record, where))
    if fewshot:  # the multiple-choice tasks' examples (moekit.train.tasks.fewshot_examples), solved
        items = [GenItem("".join(items[j].prompt + items[j].solution + FEWSHOT_DELIMITER for j in others) + item.prompt,
                         item.targets, item.solution, item.where)
                 for item, others in zip(items, fewshot_examples(len(items), fewshot, seed, path))]
    return GenTask(Path(path).stem, path, fmt, items[:limit] if limit is not None else items, GEN_FORMATS[fmt][2],
                   fewshot)


def cut_at_stops(text: str, stops: tuple[str, ...]) -> str:
    """The generation up to its first stop string (the stop excluded)."""
    end = min((i for i in (text.find(s) for s in stops) if i >= 0), default=len(text))
    return text[:end]


def judge(task: GenTask, item: GenItem, generation: str) -> dict:
    """This item's verdicts on a generation already cut at the task's stops: {extracted, exact, second} where
    ``second`` is gsm8k's flexible match or qa's contains."""
    if task.format == "gsm8k":
        strict = _STRICT.search(generation)
        numbers = _NUMBER.findall(generation)
        extracted = normalize_number(strict[1]) if strict else None
        flexible = normalize_number(numbers[-1]) if numbers else None
        return {"extracted": extracted, "exact": extracted in item.targets, "second": flexible in item.targets}
    got = normalize_text(generation)
    targets = [normalize_text(t) for t in item.targets]
    return {"extracted": got, "exact": got in targets, "second": any(t and t in got for t in targets)}


SECOND = {"gsm8k": "flexible_match", "qa": "contains"}


def gen_result(task: GenTask, verdicts: list[dict], cut: int, max_new_tokens: int) -> dict:
    n = len(verdicts)
    exact = sum(v["exact"] for v in verdicts) / n
    second = sum(v["second"] for v in verdicts) / n
    name = SECOND[task.format]
    return {"name": task.name, "source": task.source, "format": task.format, "kind": "generative", "items": n,
            "exact_match": exact, "exact_match_stderr": stderr(exact, n), name: second,
            f"{name}_stderr": stderr(second, n), "fewshot": task.fewshot, "max_new_tokens": max_new_tokens,
            "prompts_cut": cut}


def generate_answers(task: GenTask, model, tokenizer, prefix: list[int], max_new_tokens: int,
                     progress=None, batch_size: int = 16, use_cache: bool = True) -> tuple[dict, list]:
    """A generative task's result and its samples: each item's answer decoded greedily (moekit.train.decoding),
    stopped at an end token or once the decoded text holds a stop string, cut there and judged. ``batch_size``
    items of similar length decode together (``decoding.generate_many``), each as it would alone; ``use_cache``
    False (a model whose routing is not per token: train.inference.cache_inexact): one at a time, every step over
    the whole window."""
    from moekit.train.decoding import generate_many  # torch and the models: only when a model answers

    window = model.config.max_seq_len
    room = max(1, window - max_new_tokens)  # the prompt's tokens that fit beside the answer
    prompts, cut = [], 0
    for item in task.items:
        ids = prefix + tokenizer.encode(item.prompt)
        if len(ids) > room:  # keep the end of the prompt (the item itself), as the choices' windows do
            ids, cut = ids[-room:], cut + 1
        prompts.append(ids)

    def stop(_index: int, new: list[int]) -> bool:  # the answer so far holds a stop string
        return any(s in tokenizer.decode(new) for s in task.stops)

    last, t0 = time.monotonic(), time.monotonic()

    def report_progress(done: int) -> None:
        nonlocal last
        if progress is not None and time.monotonic() - last > 5.0:
            rate = done / max(time.monotonic() - t0, 1e-9)
            progress(f"{task.name}: {done}/{len(prompts)} items ({rate:.2f} items/s)")
            last = time.monotonic()

    outs = generate_many(model, prompts, max_new_tokens, eos_ids=tuple(tokenizer.eos_ids), stop=stop,
                         batch_size=batch_size, use_cache=use_cache, progress=report_progress)
    verdicts, rows = [], []
    for i, (item, out) in enumerate(zip(task.items, outs)):
        text = cut_at_stops(tokenizer.decode(out.new_ids), task.stops)
        verdict = judge(task, item, text)
        verdicts.append(verdict)
        rows.append({"task": task.name, "index": i, "where": item.where, "prompt": item.prompt, "generation": text,
                     "targets": item.targets, "extracted": verdict["extracted"], "correct": verdict["exact"],
                     "stopped": out.stopped})
    return gen_result(task, verdicts, cut, max_new_tokens), rows


def report(results: list[dict]) -> str:
    lines = [f"{'generative task':<20} {'items':>6} {'exact_match':>16} {'second measure':>30} {'fewshot':>8}"]
    for r in results:
        name = SECOND[r["format"]]
        second = f"{name} {100 * r[name]:.1f} ± {100 * r[name + '_stderr']:.1f}%"
        lines.append(f"{r['name']:<20} {r['items']:>6} {100 * r['exact_match']:>9.1f} ± "
                     f"{100 * r['exact_match_stderr']:>3.1f}% {second:>30} {r['fewshot']:>8}")
        if r["prompts_cut"]:
            lines.append(f"  {r['prompts_cut']} prompt(s) cut from the left to fit the window")
    return "\n".join(lines)
