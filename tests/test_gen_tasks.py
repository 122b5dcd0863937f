"""Generative tasks of moekit-eval --tasks (moekit.train.gen_tasks): GSM8K and {prompt, answer} records into prompts
and references, few-shot prompts, the verdicts on hand-written generations, bad records in one line, the trainer's
in-loop scoring refusing them, and a run's answers against greedy decoding called directly."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from moekit.train import UserError
from moekit.train.evaluate import main as eval_main
from moekit.train.gen_tasks import GSM8K_STOPS, GenItem, GenTask, cut_at_stops, judge, normalize_number
from moekit.train.loop import main as train_main
from moekit.train.tasks import read_any, read_task
from tests.tiny import TINY_MODEL

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


def write(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def gsm8k_records(n: int) -> list[dict]:
    rng = random.Random()
    out = []
    for _ in range(n):
        a, b = rng.randint(100, 5000), rng.randint(1, 99)
        out.append({"question": f"Tom has {a} apples and buys {b} more. How many now?",
                    "answer": f"He has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} apples.\n#### {a + b:,}"})
    return out


def test_gsm8k_and_qa_records_become_prompts_references_and_few_shot_prompts(tmp_path):
    records = gsm8k_records(6)
    task = read_any(str(write(tmp_path / "gsm.jsonl", records)))
    assert isinstance(task, GenTask) and task.format == "gsm8k" and task.stops == GSM8K_STOPS
    for item, r in zip(task.items, records):
        total = r["answer"].rsplit("#### ", 1)[1].replace(",", "")
        assert item.prompt == f"Question: {r['question']}\nAnswer:" and item.targets == [total]
    shot = read_any(str(tmp_path / "gsm.jsonl"), limit=3, fewshot=2)
    assert len(shot.items) == 3 and shot.fewshot == 2
    for i, item in enumerate(shot.items):
        blocks = item.prompt.split("\n\n")
        assert len(blocks) == 3 and blocks[-1] == task.items[i].prompt  # two solved examples, then the item
        solved = [b for b in blocks[:2]]
        assert all(b.startswith("Question: ") and "\n#### " in b for b in solved)
        assert task.items[i].prompt not in solved[0] and task.items[i].prompt not in solved[1]  # never itself
    assert [x.prompt for x in read_any(str(tmp_path / "gsm.jsonl"), limit=3, fewshot=2).items] == \
        [x.prompt for x in shot.items]  # the examples are fixed per item
    qa = read_any(str(write(tmp_path / "qa.jsonl", [{"prompt": "Capital of France:", "answer": "Paris"},
                                                    {"prompt": "Q: 2+2=", "answer": ["4", "four"]}])), fewshot=1)
    assert qa.format == "qa" and qa.items[0].targets == ["Paris"] and qa.items[1].targets == ["4", "four"]
    assert qa.items[0].prompt == "Q: 2+2= 4\n\nCapital of France:"


@pytest.mark.parametrize("fmt, generation, targets, exact, second", [
    ("gsm8k", " 3 + 4 = 7 apples.\n#### 7", ["7"], True, True),
    ("gsm8k", " he has #### 1,000.", ["1000"], True, True),
    ("gsm8k", " #### 7.0 so", ["7"], True, True),
    ("gsm8k", " the answer is 7", ["7"], False, True),  # no "####": only the flexible match
    ("gsm8k", " #### 7 but then 8", ["7"], True, False),  # the last number is 8
    ("gsm8k", " #### -12", ["-12"], True, True),
    ("gsm8k", " no number here", ["7"], False, False),
    ("qa", " Paris.", ["paris"], True, True),
    ("qa", " It is   Paris", ["Paris"], False, True),
    ("qa", " four", ["4", "Four"], True, True),
    ("qa", "", ["x"], False, False),
])
def test_verdicts_on_written_generations(fmt, generation, targets, exact, second):
    item = GenItem("p", [normalize_number(t) for t in targets] if fmt == "gsm8k" else targets, "", "here")
    got = judge(GenTask("t", "t.jsonl", fmt, [item], ()), item, generation)
    assert (got["exact"], got["second"]) == (exact, second), got


def test_a_generation_is_cut_at_its_first_stop():
    assert cut_at_stops(" 7 apples.\n#### 7\n\nQuestion: next", GSM8K_STOPS) == " 7 apples.\n#### 7"
    assert cut_at_stops(" x Question: y\n\nz", GSM8K_STOPS) == " x "
    assert cut_at_stops("no stop", GSM8K_STOPS) == "no stop"


@pytest.mark.parametrize("record, words", [
    ({"question": "q", "answer": "no final number"}, 'must be a string ending "#### N"'),
    ({"question": "q", "answer": "#### none"}, 'no number after "####"'),
    ({"question": "", "answer": "#### 3"}, 'need a non-empty string "question"'),
    ({"prompt": "p", "answer": []}, 'a qa "answer" must be a non-empty string or a list'),
    ({"prompt": "", "answer": "a"}, 'need a non-empty string "prompt"'),
])
def test_bad_generative_records_are_one_line(tmp_path, record, words):
    path = write(tmp_path / "bad.jsonl", [record])
    with pytest.raises(UserError, match="bad.jsonl line 1: ") as err:
        read_any(str(path))
    assert words in str(err.value)


def test_the_trainers_in_loop_tasks_refuse_a_generative_file(tmp_path):
    path = write(tmp_path / "gsm.jsonl", gsm8k_records(2))
    with pytest.raises(UserError, match=r"a generative task \(gsm8k"):
        read_task(str(path))
    with pytest.raises(UserError, match=f"moekit-eval --tasks {path}$"):
        read_task(str(path))


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("gen") / "run"
    assert train_main([*TINY_MODEL, "--steps", "3", "--run-dir", str(run), "--checkpoint.every", "3"]) == 0
    return run


def test_a_runs_answers_are_greedy_decoding_cut_at_the_stops(run, tmp_path):
    """moekit-eval's generations against moekit.train.decoding.generate called here on the same prompt ids (the
    run's EOS first, as its training documents; none for byte tokens), cut at the stops; exact_match counts the
    items whose reference was set to that answer."""
    from moekit.train.decoding import generate
    from moekit.train.gen_tasks import normalize_text
    from moekit.train.inference import load_for_inference

    model, tokenizer, _ = load_for_inference(run, "cpu")
    prefix = [tokenizer.eos_id] if tokenizer.eos_id is not None else []
    prompts = ["def ", "import ", "class A:\n    ", "return ", "for i in ", "if x == ", "print(", "self."]
    refs = []
    for p in prompts:
        out = generate(model, prefix + tokenizer.encode(p), 12, eos_ids=tokenizer.eos_ids)
        refs.append(cut_at_stops(tokenizer.decode(out.new_ids), ("\n",)))
    hit = [i % 2 == 0 and normalize_text(r) != "" for i, r in enumerate(refs)]
    records = [{"prompt": p, "answer": r if h else "zz-not-this"} for p, r, h in zip(prompts, refs, hit)]
    path = write(tmp_path / "qa.jsonl", records)
    samples, out = tmp_path / "s.jsonl", tmp_path / "o.json"
    assert eval_main([str(run), "--tasks", str(path), "--max-new-tokens", "12", "--samples", str(samples), "--out",
                      str(out), "--quiet"]) == 0
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    assert [r["generation"] for r in rows] == refs
    result = json.loads(out.read_text())["tasks"][0]
    assert result["kind"] == "generative" and result["items"] == len(prompts)
    assert result["exact_match"] == pytest.approx(sum(hit) / len(prompts))
    assert [r["correct"] for r in rows] == hit
