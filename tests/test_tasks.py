"""Downstream multiple-choice tasks: the formats (moekit.train.tasks), encoding and scoring (task_eval), and
``moekit-eval --tasks``. The references: strings written out by hand for each public format, each choice's
log-likelihood decoded token by token through the KV cache (another code path than the batched, padded forward),
and accuracies counted by hand from chosen log-likelihoods."""
from __future__ import annotations

import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from moekit.models.config import ModelConfig
from moekit.models.transformer import KVCache, build_model
from moekit.train import UserError
from moekit.train.evaluate import main as eval_main
from moekit.train.inference import inference_routing
from moekit.train.loop import main as train_main
from moekit.train.task_eval import batches, encode_task, score_requests, task_result
from moekit.train.builtin_tasks import CONTINUATION_CHARS, continuation_items, next_line_items, spread
from moekit.train.tasks import CONTINUATION, NEXT_LINE, Item, Task, parse_specs, read_task
from moekit.train.tokenizer import ByteTokenizer

from tests.tiny import TINY_MODEL

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


def write_jsonl(path: Path, records: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


# ---------------------------------------------------------------------------------------------------
# Formats
# ---------------------------------------------------------------------------------------------------

FORMAT_CASES = {
    "generic": ({"context": "2 + 2 =", "choices": [" 4", " 5"], "label": 0},
                [("2 + 2 =", " 4"), ("2 + 2 =", " 5")], 0),
    "hellaswag": ({"activity_label": "Baking", "ctx_a": "She mixes the flour.", "ctx_b": "then she",
                   "endings": ["bakes [title] the  bread.", "sings."], "label": "1"},
                  [("Baking: She mixes the flour. Then she", " bakes. the bread."),
                   ("Baking: She mixes the flour. Then she", " sings.")], 1),
    "arc": ({"question": "What falls?", "choices": {"text": ["rain", "smoke", "heat"], "label": ["A", "B", "C"]},
             "answerKey": "A"},
            [("Question: What falls?\nAnswer:", " rain"), ("Question: What falls?\nAnswer:", " smoke"),
             ("Question: What falls?\nAnswer:", " heat")], 0),
    "openbookqa": ({"question_stem": "The sun is", "choices": {"text": ["cold", "a star"], "label": ["1", "2"]},
                    "answerKey": "2"},
                   [("The sun is", " cold"), ("The sun is", " a star")], 1),
    "piqa": ({"goal": "Open a jar", "sol1": "twist the lid", "sol2": "eat the lid", "label": 0},
             [("Question: Open a jar\nAnswer:", " twist the lid"), ("Question: Open a jar\nAnswer:", " eat the lid")],
             0),
    "sciq": ({"question": "H2O is?", "support": "Water is H2O.", "distractor1": "salt", "distractor2": "air",
              "distractor3": "iron", "correct_answer": "water"},
             [("Water is H2O.\nQuestion: H2O is?\nAnswer:", f" {a}") for a in ("salt", "air", "iron", "water")], 3),
    "mmlu": ({"question": "Capital of France?", "subject": "geo", "choices": ["Rome", "Paris"], "answer": 1},
             [("Capital of France?\nA. Rome\nB. Paris\nAnswer:", " A"),
              ("Capital of France?\nA. Rome\nB. Paris\nAnswer:", " B")], 1),
    "winogrande": ({"sentence": "The cup fell off the table because _ was round.", "option1": "the cup",
                    "option2": "the table", "answer": "1"},
                   [("The cup fell off the table because the cup", " was round."),
                    ("The cup fell off the table because the table", " was round.")], 0),
}


@pytest.mark.parametrize("fmt", sorted(FORMAT_CASES))
def test_each_public_format_gives_its_prompts(tmp_path, fmt):
    record, choices, label = FORMAT_CASES[fmt]
    task = read_task(write_jsonl(tmp_path / f"{fmt}.jsonl", [record, record]))
    assert (task.name, task.format, len(task.items)) == (fmt, fmt, 2)
    assert task.items[0].choices == choices and task.items[0].label == label


def test_the_original_arc_layout_and_the_json_and_parquet_files_read_alike(tmp_path):
    hub = {"question": "Q?", "choices": {"text": ["a", "b"], "label": ["A", "B"]}, "answerKey": "B"}
    original = {"question": {"stem": "Q?", "choices": [{"text": "a", "label": "A"}, {"text": "b", "label": "B"}]},
                "answerKey": "B"}
    want = read_task(write_jsonl(tmp_path / "hub.jsonl", [hub])).items
    assert read_task(write_jsonl(tmp_path / "orig.jsonl", [original])).items[0].choices == want[0].choices
    records = [dict(FORMAT_CASES["piqa"][0], label=i % 2) for i in range(5)]
    jsonl = read_task(write_jsonl(tmp_path / "p.jsonl", records))
    (tmp_path / "p.json").write_text(json.dumps({"data": records}))
    pytest.importorskip("pyarrow")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(records), tmp_path / "p.parquet")
    for other in ("p.json", "p.parquet"):
        got = read_task(str(tmp_path / other))
        assert [(i.choices, i.label) for i in got.items] == [(i.choices, i.label) for i in jsonl.items]
    assert [i.label for i in read_task(str(tmp_path / "p.parquet"), limit=3).items] == [0, 1, 0]


@pytest.mark.parametrize("records, message", [
    ([{"context": "c", "choices": ["a", "b"], "label": 2}], r"line 1: 'label' is 2, outside the 2 choices"),
    ([{"context": "c", "choices": ["a", "b"], "label": 0}, {"context": "c", "choices": ["a"], "label": 0}],
     r"line 2: 'choices' must be a list of at least 2 strings"),
    ([{"ctx": "c", "endings": ["a", "b"], "label": ""}], r"'label' is '', not the index of a choice \(a test split"),
    ([{"text": "hello"}], r"line 1: a record with fields \['text'\] is no task format"),
    ([{"sentence": "no blank", "option1": "a", "option2": "b", "answer": "1"}], r"must hold one '_'"),
    ([{"question": "q", "choices": {"text": ["a", "b"], "label": ["A", "B"]}, "answerKey": "C"}],
     r"answerKey 'C' is none of the choices' labels"),
    ([], r"holds no record"),
])
def test_bad_task_files_name_the_record_and_the_fix(tmp_path, records, message):
    with pytest.raises(UserError, match=message):
        read_task(write_jsonl(tmp_path / "t.jsonl", records))


def test_task_file_errors(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"context": "c", "choices": ["a", "b"], "label": 0}\n{oops\n')
    with pytest.raises(UserError, match=r"bad.jsonl line 2: invalid JSON"):
        read_task(str(tmp_path / "bad.jsonl"))
    with pytest.raises(UserError, match=r"no such file"):
        read_task(str(tmp_path / "missing.jsonl"))
    (tmp_path / "obj.json").write_text('{"a": 1}')
    with pytest.raises(UserError, match=r"holds a list of records, got dict"):
        read_task(str(tmp_path / "obj.json"))
    with pytest.raises(UserError, match=r"no built-in task by that name"):
        parse_specs("@hellaswag")
    with pytest.raises(UserError, match=r"two tasks 'arc'"):
        parse_specs(["a/arc.jsonl", "b/arc.parquet"])
    assert parse_specs(["x.jsonl,@next-line", "y.json"]) == ["x.jsonl", NEXT_LINE, "y.json"]


def test_fewshot_items_start_with_other_items_solved(tmp_path):
    rng = random.Random()
    records = [{"context": f"q{i}:", "choices": [f" a{i}", f" b{i}", f" c{i}"], "label": rng.randrange(3)}
               for i in range(9)]
    path = write_jsonl(tmp_path / "g.jsonl", records)
    k = rng.randint(1, 4)
    task = read_task(path, fewshot=k)
    assert task.fewshot == k and len(task.items) == 9
    for i, item in enumerate(task.items):
        shots = item.choices[0][0].removesuffix(f"q{i}:").split("\n\n")
        assert shots[-1] == "" and len(shots) == k + 1  # K examples, each followed by a blank line
        used = []
        for shot in shots[:-1]:
            j = int(shot.split(":")[0][1:])
            assert j != i and shot == f"q{j}:" + records[j]["choices"][records[j]["label"]]
            used.append(j)
        assert len(set(used)) == k
        assert all(c == item.choices[0][0] for c, _ in item.choices)  # one context for every choice
        assert [cont for _, cont in item.choices] == records[i]["choices"]
    assert [it.choices for it in read_task(path, limit=3, fewshot=k).items] == [it.choices for it in task.items[:3]]
    assert [it.choices for it in read_task(path, fewshot=k).items] == [it.choices for it in task.items]  # seeded
    with pytest.raises(UserError, match=r"--fewshot 9 needs at least 10 items"):
        read_task(path, fewshot=9)


# ---------------------------------------------------------------------------------------------------
# @next-line
# ---------------------------------------------------------------------------------------------------


def test_next_line_items_are_the_texts_next_lines_among_other_lines():
    rng = random.Random()
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
    texts = ["\n".join(" ".join(rng.choice(words) for _ in range(rng.randint(2, 6))) for _ in range(30))
             for _ in range(4)]
    items = next_line_items(texts, 40, seed=rng.randrange(1 << 30))
    assert 20 <= len(items) <= 40
    joined = "\n".join(texts)
    for item in items:
        assert len(item.choices) == 4 and len({c for _, c in item.choices}) == 4
        context, answer = item.choices[item.label]
        assert context + answer in joined  # the answer is the line after the context
        assert all(c == context for c, _ in item.choices)
        for _, other in item.choices:
            assert other in joined and 8 <= len(other.strip()) <= 120
    assert len({item.label for item in items}) > 1  # the right answer's place is not fixed
    with pytest.raises(UserError, match=r"needs at least 1 and 4"):
        next_line_items(["short\nx\ny\n"], 10)


def test_items_are_spread_over_all_the_candidates():
    rng = random.Random()
    for _ in range(100):
        n, count = rng.randint(1, 300), rng.randint(1, 300)
        picks = spread(n, count)
        assert len(picks) == min(n, count) and picks == sorted(set(picks)) and 0 <= picks[0] and picks[-1] < n
        assert picks[-1] == n - 1 or min(n, count) == 1  # to the last candidate, even with fewer candidates than asked


def test_continuation_items_are_each_windows_ending_among_other_endings():
    rng = random.Random()
    texts = ["".join(rng.choices("abcdef \n", k=rng.randint(2 * CONTINUATION_CHARS + 1, 200))) for _ in range(30)]
    texts.append("x" * CONTINUATION_CHARS)  # too short to leave a context: not used
    items = continuation_items(texts, 12, seed=rng.randrange(1 << 30))
    assert len(items) == 12
    endings = {t[-CONTINUATION_CHARS:] for t in texts[:-1]}
    for item in items:
        context, answer = item.choices[item.label]
        assert context + answer in texts and len(answer) == CONTINUATION_CHARS
        assert len({c for _, c in item.choices}) == 4 and {c for _, c in item.choices} <= endings
        assert all(c == context for c, _ in item.choices)
    assert len({item.label for item in items}) > 1
    with pytest.raises(UserError, match=r"it needs 4"):
        continuation_items(texts[:3], 5)


# ---------------------------------------------------------------------------------------------------
# Encoding and scoring
# ---------------------------------------------------------------------------------------------------


def test_encoding_moves_the_contexts_spaces_and_cuts_contexts_from_the_left():
    tok = ByteTokenizer(eos_id=256, vocab_size=257)
    task = Task("t", "t", "generic", [Item([("ab ", "cd"), ("x" * 20, "yz")], 0, "i")])
    reqs, cut = encode_task(task, tok, 10, [256])
    assert reqs[0].ids == [256, *b"ab cd"] and reqs[0].cont == 3 and reqs[0].chars == 2
    assert reqs[1].ids == [*b"x" * 9, *b"yz"] and reqs[1].cont == 2 and cut == 1  # 11 tokens: 10 inputs
    with pytest.raises(UserError, match=r"choice 1 is 4 tokens, more than the 3"):
        encode_task(Task("t", "t", "generic", [Item([("a", "bcde"), ("a", "b")], 0, "i")]), tok, 3, [])
    with pytest.raises(UserError, match=r"the context is empty"):
        encode_task(Task("t", "t", "generic", [Item([("", "bcde"), ("a", "b")], 0, "i")]), tok, 30, [])


def test_batches_hold_every_request_once_within_the_budget():
    tok = ByteTokenizer()
    rng = random.Random()
    items = [Item([("c" * rng.randint(1, 30), "d" * rng.randint(1, 9)) for _ in range(3)], 0, "i") for _ in range(20)]
    reqs, _ = encode_task(Task("t", "t", "generic", items), tok, 64, [])
    groups = batches(reqs, 80)
    assert sorted(r for g in groups for r in g) == list(range(len(reqs)))
    for g in groups:
        assert len(g) == 1 or len(g) * max(len(reqs[r].ids) - 1 for r in g) <= 80


def tiny_model(**over) -> torch.nn.Module:
    cfg = ModelConfig(**{**dict(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, ffn_hidden_size=64,
                                moe_ffn_hidden_size=32, num_experts=4, top_k=2, max_seq_len=64, vocab_size=257),
                         **over})
    model = build_model(cfg)
    model.init_weights(seed=random.randrange(1 << 30))
    model.eval()
    inference_routing(model)
    return model


def cached_loglik(model, ids: list[int], cont: int) -> float:
    """The continuation's log-likelihood decoded one token at a time through the KV cache."""
    cache = KVCache(model.config)
    total = 0.0
    with torch.inference_mode():
        logits = model(torch.tensor([ids[:-cont]]), cache=cache)[0, -1]
        for t in ids[-cont:]:
            total += float(torch.log_softmax(logits.double(), -1)[t])
            logits = model(torch.tensor([[t]]), cache=cache)[0, -1]
    return total


@pytest.mark.parametrize("budget", [1, 200])
def test_scores_are_the_token_by_token_log_likelihoods(budget):
    model = tiny_model()
    tok = ByteTokenizer(eos_id=256, vocab_size=257)
    rng = random.Random()
    letters = "abcdefgh \n"
    items = [Item([("".join(rng.choices(letters, k=rng.randint(0, 40))), "".join(rng.choices(letters, k=rng.randint(1, 12))))
                   for _ in range(rng.randint(2, 4))], 0, "i") for _ in range(8)]
    reqs, _ = encode_task(Task("t", "t", "generic", items), tok, 48, [256])
    got = score_requests(model, reqs, budget, torch.device("cpu"))
    want = np.array([cached_loglik(model, r.ids, r.cont) for r in reqs])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert (got < 0).all()


def test_accuracies_count_the_most_likely_choice():
    items = [Item([("c", "a"), ("c", "bbbb")], 1, "i0"), Item([("c", "a"), ("c", "bb"), ("c", "c")], 0, "i1"),
             Item([("c", "aaaa"), ("c", "b")], 0, "i2")]
    task = Task("t", "t", "generic", items)
    reqs, _ = encode_task(task, ByteTokenizer(), 16, [])
    # item 0: raw picks choice 0 (-1 > -2), per character choice 1 (-0.5 > -1): acc 0, acc_norm 1
    # item 1: choice 0 either way; item 2: raw picks 1 (-3 > -4), per character 0 (-1 > -3)
    ll = np.array([-1.0, -2.0, -0.5, -3.0, -2.0, -4.0, -3.0])
    r = task_result(task, reqs, ll)
    assert (r["acc"], r["acc_norm"], r["items"]) == (pytest.approx(1 / 3), pytest.approx(1.0), 3)
    assert r["chance"] == pytest.approx((1 / 2 + 1 / 3 + 1 / 2) / 3)
    assert r["acc_stderr"] == pytest.approx(math.sqrt((1 / 3) * (2 / 3) / 2))
    assert r["correct_nll"] == pytest.approx((2.0 / 4 + 0.5 / 1 + 4.0 / 4) / 3)  # per token of the right choice


# ---------------------------------------------------------------------------------------------------
# moekit-eval --tasks
# ---------------------------------------------------------------------------------------------------


IN_LOOP_ITEMS = 5
FEWSHOT = 1  # the file's items start with one solved item (not @next-line's)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A tiny run that scored a HellaSwag-style file (ragged contexts and endings; one-shot), @next-line and
    @continuation after its last step (--eval.tasks), with its weights and with their running average
    (--train.ema_decay: tasks_ema)."""
    root = tmp_path_factory.mktemp("tasks")
    rng = random.Random()
    words = "the a cat runs over slowly and then jumps into water".split()
    text = lambda lo, hi: " ".join(rng.choices(words, k=rng.randint(lo, hi)))  # noqa: E731
    # at most ~160 bytes a choice with its example: the trainer scores them in windows of 160 or fewer
    # (train.task_loop's width), not the run's 256
    write_jsonl(root / "hs.jsonl", [{"ctx": text(2, 6), "endings": [text(1, 3) for _ in range(4)],
                                     "label": rng.randrange(4)} for _ in range(8)])
    run = root / "run"
    flags = [*TINY_MODEL, "--model.max_seq_len", "256", "--train.seq_len", "256", "--steps", "2",
             "--run-dir", str(run), "--eval.tasks", f"{root / 'hs.jsonl'},{NEXT_LINE},{CONTINUATION}",
             "--eval.task_items", str(IN_LOOP_ITEMS), "--eval.task_fewshot", str(FEWSHOT), "--train.ema_decay", "0.5"]
    assert train_main(flags) == 0
    return run


def test_the_trainers_task_scores_are_moekit_evals(run, tmp_path, capsys):
    """In the loop (each choice one padded window through the trainer's loss: the short HellaSwag-style task in a
    narrower one, @next-line in the run's) and in moekit-eval (batched logits) the same items get the same
    scores."""
    in_loop = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["tasks"]
    out = tmp_path / "eval.json"
    hs = str(run.parent / "hs.jsonl")
    assert eval_main([str(run), "--tasks", f"{hs},{NEXT_LINE},{CONTINUATION}", "--limit", str(IN_LOOP_ITEMS),
                      "--fewshot", str(FEWSHOT), "--out", str(out)]) == 0
    evals = {t["name"]: t for t in json.loads(out.read_text())["tasks"]}
    assert set(in_loop) == set(evals) == {"hs", NEXT_LINE, CONTINUATION}
    for name, got in in_loop.items():
        want = evals[name]
        assert got["items"] == want["items"] == IN_LOOP_ITEMS
        assert got["correct_nll"] == pytest.approx(want["correct_nll"], rel=1e-4)
        assert (got["acc"], got["acc_norm"]) == (want["acc"], want["acc_norm"])


def test_the_trainers_scores_of_the_average_are_moekit_eval_emas(run, tmp_path):
    """tasks_ema (the same items, the parameter average swapped in) equals moekit-eval --ema on the final checkpoint,
    and is another model's score than the trained weights'."""
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    out = tmp_path / "eval.json"
    hs = str(run.parent / "hs.jsonl")
    assert eval_main([str(run), "--ema", "--tasks", f"{hs},{NEXT_LINE},{CONTINUATION}", "--limit", str(IN_LOOP_ITEMS),
                      "--fewshot", str(FEWSHOT), "--out", str(out), "--quiet"]) == 0
    evals = {t["name"]: t for t in json.loads(out.read_text())["tasks"]}
    assert set(last["tasks_ema"]) == set(evals)
    for name, got in last["tasks_ema"].items():
        assert got["correct_nll"] == pytest.approx(evals[name]["correct_nll"], rel=1e-4)
        assert (got["acc"], got["acc_norm"]) == (evals[name]["acc"], evals[name]["acc_norm"])
    assert any(last["tasks_ema"][n]["correct_nll"] != last["tasks"][n]["correct_nll"] for n in evals)


def test_eval_tasks_scores_files_and_next_line(run, tmp_path, capsys):
    records = [dict(FORMAT_CASES["arc"][0], answerKey=random.choice("ABC")) for _ in range(6)]
    arc = write_jsonl(tmp_path / "arc.jsonl", records)
    out, samples = tmp_path / "tasks.json", tmp_path / "samples.jsonl"
    assert eval_main([str(run), "--tasks", f"{arc},{NEXT_LINE}", "--limit", "5", "--out", str(out),
                      "--samples", str(samples)]) == 0
    items = [json.loads(line) for line in samples.read_text().splitlines()]
    assert [(r["task"], r["item"]) for r in items] == [("arc", i) for i in range(5)] + [(NEXT_LINE, i) for i in range(5)]
    for r in items[:5]:  # the records agree with the accuracies and with themselves
        key = records[r["item"]]["answerKey"]
        assert r["choices"] == [" rain", " smoke", " heat"] and r["label"] == "ABC".index(key)
        assert r["pred"] == max(range(3), key=r["loglik"].__getitem__) and r["correct"] == (r["pred"] == r["label"])
        assert r["context"] == "Question: What falls?\nAnswer:" and all(t >= 1 for t in r["tokens"])
    stdout = capsys.readouterr().out
    assert "arc" in stdout and NEXT_LINE in stdout and "acc_norm" in stdout
    result = json.loads(out.read_text())
    by_name = {t["name"]: t for t in result["tasks"]}
    assert by_name["arc"]["items"] == 5 and by_name["arc"]["format"] == "arc"
    assert by_name[NEXT_LINE]["items"] == 5 and by_name[NEXT_LINE]["chance"] == pytest.approx(0.25)
    # all five arc items are the same question: the model picks the same choice for each
    picked = by_name["arc"]["acc"] * 5
    labels = [r["answerKey"] for r in records[:5]]
    assert round(picked) in {labels.count(c) for c in "ABC"}
    assert sum(r["correct"] for r in items[:5]) == round(picked)
    assert sum(r["correct_norm"] for r in items[5:]) == round(by_name[NEXT_LINE]["acc_norm"] * 5)


@pytest.mark.parametrize("argv, expected", [
    (["--limit", "3"], "--limit counts task items; it needs --tasks"),
    (["--tasks", "@nope"], "no built-in task by that name; the built-in ones are @next-line, @continuation"),
    (["--tasks", "missing.jsonl"], "no such file"),
    (["--tasks", NEXT_LINE, "--batches", "2"], "--batches is for the loss evaluation"),
    (["--fewshot", "2"], "--fewshot adds solved examples to task items; it needs --tasks"),
    (["--samples", "s.jsonl"], "--samples writes the scored items of --tasks; it needs --tasks"),
    (["--tasks", NEXT_LINE, "--fewshot", "-1"], "--fewshot -1 is invalid"),
])
def test_eval_tasks_bad_input_is_one_line(run, capsys, argv, expected):
    rc = eval_main([str(run), *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and expected in err[0], err


def test_the_console_line_shows_each_tasks_acc_norm():
    from moekit.train.monitor import format_line

    row = {"step": 5, "loss": 2.0, "aux_loss": 0.01, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 10.0,
           "mem_gb": 0.1, "val_loss": 2.1, "tasks": {"arc": {"acc": 0.5, "acc_norm": 0.625, "correct_nll": 1.0}}}
    assert format_line(row).endswith("val_loss=2.1000 acc_norm[arc]=0.625")
