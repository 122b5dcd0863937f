"""Many prompts decoded together (moekit.train.decoding.generate_batch / generate_many, models.kvcache.KVCache's
``padding``): left-padded batches over one KV cache, rows leaving the batch as they end, against each prompt decoded
alone with ``generate``. The attention families each meet the padding differently, so each is checked: GQA, MLA,
sliding windows with sinks (past the ring cache's wrap), Gated DeltaNet linear attention, Llama 4's chunks and NoPE
temperature. In float64 the tokens must be identical; the float32 logits agree to rounding. Then moekit-generate
--prompts and moekit-eval's batched generative tasks."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from moekit.models.config import PRESETS
from moekit.models.kvcache import KVCache
from moekit.models.transformer import build_model
from moekit.train.decoding import generate, generate_batch, generate_many
from moekit.train.generate import Sampling, main as generate_main
from tests.helpers import gen

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py

# every way attention meets the cache, at sizes where prompts cross windows and chunks (and the ring wraps)
FAMILIES = {
    "gqa": dict(preset="mixtral-tiny"),
    "mla": dict(preset="deepseek-tiny", attention="mla", kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16,
                v_head_dim=16),
    "window-sinks": dict(preset="gpt-oss-tiny", sliding_window=8),  # ring: window - 1 + 64 slots < capacity
    "linear": dict(preset="qwen3.5-tiny"),
    "chunks-temperature": dict(preset="llama4-tiny", attention_chunk=8, attn_temperature_floor=4),
}


def seed(*key) -> int:
    """A fresh seed per run and key (tests.helpers.gen: MOEKIT_TEST_SEED replays it)."""
    return int(torch.randint(0, 2**31 - 1, (1,), generator=gen(*key)))


def tiny(family: str, dtype=torch.float64, max_seq_len: int = 128):
    fields = dict(FAMILIES[family])
    cfg = dataclasses.replace(PRESETS[fields.pop("preset")], max_seq_len=max_seq_len, hidden_size=64, **fields)
    return build_model(cfg, seed=seed("batch-gen", family)).to(dtype).eval()


def ragged_prompts(rng: np.random.Generator, lengths) -> list[list[int]]:
    return [rng.integers(1, 256, n).tolist() for n in lengths]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_batched_tokens_equal_each_prompt_decoded_alone(family):
    model = tiny(family)
    rng = np.random.default_rng(seed("batch-gen-prompts", family))
    prompts = ragged_prompts(rng, (1, 9, 33, 4, 17, 33))  # equal, ragged, and a one-token prompt
    N = 40 if family == "window-sinks" else 24  # 33 + 40 > 71 slots: a sliding-window layer's ring wraps
    alone = [generate(model, p, N).new_ids for p in prompts]
    assert [g.new_ids for g in generate_batch(model, prompts, N)] == alone
    # rows leave the batch at different steps (an end token met by some; a stop condition for others): the
    # remaining rows continue over the cache's selected rows
    eos = alone[1][5]
    stop = lambda i, ids: i == 3 and len(ids) == 7  # noqa: E731
    got = generate_batch(model, prompts, N, eos_ids=(eos,), stop=stop)
    for i, (g, a) in enumerate(zip(got, alone)):  # each row: its lone tokens up to the end token, or the stop
        end = a.index(eos) if eos in a else len(a)
        if i == 3 and end >= 7:
            assert g.new_ids == a[:7] and g.stopped == "stop"
        else:
            assert g.new_ids == a[:end] and g.stopped == ("eos" if end < len(a) else "length")
    assert got[1].stopped == "eos" and len(got[1].new_ids) <= 5


@pytest.mark.parametrize("family", ["gqa", "linear"])
def test_sampled_rows_follow_their_own_seeded_generator(family):
    model = tiny(family)
    prompts = ragged_prompts(np.random.default_rng(seed("batch-gen-sample")), (3, 12, 7))
    sampling = Sampling(temperature=0.9, top_k=50, top_p=0.95)
    draws = seed("batch-gen-sample-seed")
    alone = [generate(model, p, 16, sampling, seed=draws).new_ids for p in prompts]
    assert [g.new_ids for g in generate_batch(model, prompts, 16, sampling, seed=draws)] == alone
    assert len({tuple(a) for a in alone}) == len(alone)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_padded_prefill_logits_match_each_rows_own_forward(family):
    """In float32 the padding changes only rounding: each row's logits at its real positions are its own forward's,
    and no filler position leaks a NaN (a filler query sees itself)."""
    model = tiny(family, torch.float32)
    rng = np.random.default_rng(seed("batch-gen-logits", family))
    prompts = ragged_prompts(rng, (5, 23, 1, 14))
    P = max(map(len, prompts))
    padding = [P - len(p) for p in prompts]
    tokens = torch.tensor([[0] * pad + p for pad, p in zip(padding, prompts)])
    with torch.inference_mode():
        batch = model(tokens, cache=KVCache(model.config, P + 4, padding=torch.tensor(padding)))
        step = torch.tensor([[7], [8], [9], [10]])  # and one decoding step over the padded cache
        cache = KVCache(model.config, P + 4, padding=torch.tensor(padding))
        model(tokens, cache=cache)
        after = model(step, cache=cache)[:, 0]
        assert torch.isfinite(batch).all()
        for b, p in enumerate(prompts):
            own = model(torch.tensor([p + [int(step[b])]]))[0]  # [len + 1, V]
            torch.testing.assert_close(batch[b, padding[b]:], own[:-1], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(after[b], own[-1], rtol=1e-4, atol=1e-4)


def test_generate_many_keeps_order_and_sends_long_prompts_alone():
    model = tiny("gqa", max_seq_len=48)
    rng = np.random.default_rng(seed("batch-gen-many"))
    prompts = ragged_prompts(rng, (6, 40, 2, 11, 6, 3, 30))  # 40 and 30 + 20 new > 48: decoded alone
    alone = [generate(model, p, 20) for p in prompts]
    assert [a.shifts for a in alone][1] == 1  # the long one's window moved on
    seen = []
    for batch_size in (1, 2, 16):
        got = generate_many(model, prompts, 20, batch_size=batch_size, progress=seen.append)
        assert [g.new_ids for g in got] == [a.new_ids for a in alone]
        assert [g.shifts for g in got] == [a.shifts for a in alone]
        assert seen[-1] == len(prompts) and seen == sorted(seen)
        seen.clear()
    with pytest.raises(ValueError, match="prompt 1 has 40 tokens, and 20 new ones would outgrow the window of 48"):
        generate_batch(model, prompts, 20)
    with pytest.raises(ValueError, match="batch_size=0 is invalid"):
        generate_many(model, prompts, 20, batch_size=0)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        generate_batch(model, [[1], []], 4)


def test_kv_cache_padding_and_row_selection():
    model = tiny("linear")
    with pytest.raises(ValueError, match=r"padding must be one count per row in \[0, capacity=8\), got \[0, 8\]"):
        KVCache(model.config, 8, padding=torch.tensor([0, 8]))
    prompts = ragged_prompts(np.random.default_rng(seed("batch-gen-select")), (4, 7, 2))
    P = 7
    with torch.inference_mode():
        cache = KVCache(model.config, 16, padding=torch.tensor([P - len(p) for p in prompts]))
        model(torch.tensor([[0] * (P - len(p)) + p for p in prompts]), cache=cache)
        cache.select([2, 0])  # rows 2 and 0, in that order
        assert cache.padding.tolist() == [5, 3] and cache.length == P
        assert all(layer.padding is cache.padding for layer in cache.layers)
        last = model(torch.tensor([[5], [6]]), cache=cache)[:, 0]
        for j, row in enumerate((2, 0)):
            own = model(torch.tensor([prompts[row] + [5 + j]]))[0, -1]
            torch.testing.assert_close(last[j], own)


# ---------------------------------------------------------------------------------------------------
# moekit-generate --prompts
# ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    from moekit.train.loop import main as train_main
    from tests.tiny import TINY_MODEL

    run = tmp_path_factory.mktemp("batchgen") / "run"
    assert train_main([*TINY_MODEL, "--steps", "2", "--run-dir", str(run), "--checkpoint.every", "2"]) == 0
    return run


def test_generate_prompts_file_equals_one_prompt_at_a_time(run, tmp_path, capsys):
    texts = ["def main(", "import", "class Tree:\n", "x = [i for i in range(", "#"]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    (tmp_path / "p.txt").write_text("\n".join(t.replace("\n", " ") for t in texts) + "\n\n")
    common = ["--max-new-tokens", "10", "--device", "cpu", "--temperature", "0.8", "--seed", "3"]
    alone = []
    for t in texts:
        assert generate_main([str(run), "--prompt", t, *common]) == 0
        alone.append(capsys.readouterr().out[len(t):-1])  # stdout: the prompt, its continuation, a newline
    out = tmp_path / "out.jsonl"
    assert generate_main([str(run), "--prompts", str(tmp_path / "p.jsonl"), "--output", str(out), "--batch-size",
                          "2", *common]) == 0
    err = capsys.readouterr().err
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["index"] for r in rows] == list(range(len(texts))) and [r["prompt"] for r in rows] == texts
    assert [r["completion"] for r in rows] == alone
    assert all(r["new_tokens"] == 10 and r["stopped"] == "length" for r in rows)
    assert "5 prompts" in err and "KV cache, batches of 2" in err and f"wrote {out}" in err
    # a text file, one prompt per line (the blank one skipped), records on stdout
    assert generate_main([str(run), "--prompts", str(tmp_path / "p.txt"), *common]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(rows) == len(texts) and rows[0]["completion"] == alone[0]


@pytest.mark.parametrize("content, argv, words", [
    ('{"prompt": "a"}\nnot json\n', [], "p.jsonl:2: not JSON"),
    ('{"text": "a"}\n', [], 'p.jsonl:1: needs a non-empty string "prompt" field'),
    ('\n\n', [], "holds no prompt"),
    ('{"prompt": "a", "system": "be brief"}\n', [], '"system" sets a chat\'s system message; add --chat'),
    ('{"prompt": "a"}\n', ["--speculative"], "--speculative decodes one sequence"),
    ('{"prompt": "a"}\n', ["--batch-size", "0"], "--batch-size 0 is invalid"),
])
def test_bad_prompts_files_are_one_line(run, tmp_path, capsys, content, argv, words):
    (tmp_path / "p.jsonl").write_text(content)
    assert generate_main([str(run), "--prompts", str(tmp_path / "p.jsonl"), "--device", "cpu", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and len(err.splitlines()) == 1


def test_batch_flags_need_prompts(run, capsys):
    assert generate_main([str(run), "--prompt", "a", "--output", "x.jsonl"]) == 2
    assert "--output is for many prompts; give them with --prompts FILE" in capsys.readouterr().err
    assert generate_main([str(run), "--prompt", "a", "--prompts", "p.txt"]) == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_eval_generative_task_batches_equal_one_at_a_time(run, tmp_path):
    from moekit.train.evaluate import main as eval_main

    records = [{"prompt": p, "answer": "x"} for p in ("def ", "import os\n", "for i in ", "print(", "class A:\n  ")]
    (tmp_path / "qa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    got = {}
    for b in ("1", "2", "16"):
        samples = tmp_path / f"s{b}.jsonl"
        assert eval_main([str(run), "--tasks", str(tmp_path / "qa.jsonl"), "--max-new-tokens", "8", "--samples",
                          str(samples), "--gen-batch-size", b, "--quiet"]) == 0
        got[b] = [json.loads(line)["generation"] for line in samples.read_text().splitlines()]
    assert got["1"] == got["2"] == got["16"] and len(got["1"]) == len(records)
    assert eval_main([str(run), "--tasks", str(tmp_path / "qa.jsonl"), "--gen-batch-size", "0"]) == 2


def test_batch_generate_benchmark_smoke(tmp_path, capsys):
    """tools/bench/batch_generate.py: one at a time, two batch sizes and transformers' batched generate of the same
    weights, one round-robin; the batched tokens are one-at-a-time's."""
    pytest.importorskip("transformers")
    from moekit.bench.batch_generate import main as bench_main

    out = tmp_path / "bench.json"
    assert bench_main(["--presets", "mixtral-tiny", "--prompts", "5", "--prompt-len", "2", "12", "--new-tokens", "6",
                       "--batch-sizes", "2", "8", "--max-seq-len", "32", "--repeats", "1", "--device", "cpu",
                       "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert [(r["impl"], r["batch"]) for r in rows] == [("moekit", 1), ("moekit", 2), ("moekit", 8), ("hf", 2),
                                                       ("hf", 8)]
    assert all(r["tok_s"] > 0 and r["prompts"] == 5 and r["new_tokens"] == 6 for r in rows)
    assert rows[0]["vs_alone"] == 1.0 and all(r["same"] for r in rows[:3])
    assert all(r["agree"] >= 0.5 for r in rows[3:])  # the same weights in transformers: the same tokens but for ties
    assert "x alone" in capsys.readouterr().out
    from moekit.bench.suite_summary import batch_generate_lines  # the GPU suite's summary of its step

    (line,) = batch_generate_lines(json.loads(out.read_text()))
    assert line.startswith("mixtral-tiny: alone ") and ", moekit 2 " in line and ", hf 8 " in line
    with pytest.raises(SystemExit):
        bench_main(["--prompt-len", "10", "5", "--out", str(out)])


def test_stop_texts_end_each_continuation_before_them(run, tmp_path, capsys):
    """--stop: the continuation ends where a stop text first appears (the text not printed, decoding stopped
    there: fewer new tokens), in --prompt and in --prompts; '\\n' in the flag is a newline; '' is refused."""
    common = ["--max-new-tokens", "16", "--device", "cpu", "--temperature", "0.9", "--seed", "5"]
    texts = ["def main(", "import"]
    full = []
    for t in texts:
        assert generate_main([str(run), "--prompt", t, *common]) == 0
        full.append(capsys.readouterr().out[len(t):-1])
    stop = full[0][4:6]  # two characters from the middle of the first continuation
    assert generate_main([str(run), "--prompt", texts[0], *common, "--stop", stop, "--stop", "\\nzz"]) == 0
    out, err = capsys.readouterr()
    assert out == texts[0] + full[0][: full[0].find(stop)] + "\n" and "stopped at --stop" in err
    (tmp_path / "p.txt").write_text("\n".join(texts) + "\n")
    assert generate_main([str(run), "--prompts", str(tmp_path / "p.txt"), *common, "--stop", stop]) == 0
    out, err = capsys.readouterr()
    rows = [json.loads(line) for line in out.splitlines()]
    for row, whole in zip(rows, full):
        cut = whole.find(stop)
        assert row["completion"] == (whole if cut < 0 else whole[:cut])
        assert row["stopped"] == ("length" if cut < 0 else "stop")
    stopped = sum(row["stopped"] == "stop" for row in rows)
    assert rows[0]["stopped"] == "stop" and rows[0]["new_tokens"] < 16 and f"at --stop {stopped}" in err
    assert generate_main([str(run), "--prompt", "a", "--stop", ""]) == 2
    assert "--stop '' is invalid" in capsys.readouterr().err


def test_num_samples_draws_each_completion_with_its_own_seed(run, tmp_path, capsys):
    """--num-samples N: N records per prompt, sample j being what --prompt gives with --seed S + j; greedy
    decoding with N > 1, or the flag without --prompts, is one line."""
    texts = ["def main(", "x = ["]
    (tmp_path / "p.txt").write_text("\n".join(texts) + "\n")
    common = ["--max-new-tokens", "6", "--device", "cpu", "--temperature", "1.0"]
    assert generate_main([str(run), "--prompts", str(tmp_path / "p.txt"), *common, "--seed", "7", "--num-samples",
                          "3", "--batch-size", "4"]) == 0
    out, err = capsys.readouterr()
    rows = [json.loads(line) for line in out.splitlines()]
    assert [(r["index"], r["sample"]) for r in rows] == [(i, j) for i in range(2) for j in range(3)]
    assert "2 prompts x 3 samples" in err
    for r in rows:
        assert generate_main([str(run), "--prompt", texts[r["index"]], *common, "--seed", str(7 + r["sample"])]) == 0
        assert capsys.readouterr().out == texts[r["index"]] + r["completion"] + "\n"
    assert len({r["completion"] for r in rows}) > 2  # the seeds differ, so do (most) samples
    assert generate_main([str(run), "--prompts", str(tmp_path / "p.txt"), "--num-samples", "2"]) == 2
    assert "copies of the one greedy completion" in capsys.readouterr().err
    assert generate_main([str(run), "--prompt", "a", "--num-samples", "2"]) == 2
    assert "--num-samples is for many prompts" in capsys.readouterr().err
