"""Text out: the KV cache, sampling, moekit-generate and moekit-eval on freshly trained tiny runs.

One module-scoped fixture trains mixtral-tiny, switch-tiny and deepseek-tiny for two steps in-process (the
tiny flags of tests/tiny.py, a checkpoint after each step); every test reads those runs. The references:
a full forward for the cache, decoding without the cache for greedy tokens, a plain NumPy computation of
the top-k / top-p set, the trainer's own val_loss for moekit-eval, and a HuggingFace export of the same
weights for the HF path.
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from moekit.models.config import ModelConfig
from moekit.models.transformer import KVCache, build_model
from moekit.train import UserError
from moekit.train.evaluate import main as eval_main
from moekit.train.decoding import accept_draft, candidates, continuation, generate, generate_speculative, next_token
from moekit.train.generate import Sampling
from moekit.train.generate import main as generate_main
from moekit.train.inference import cache_inexact, inference_routing, load_for_inference
from moekit.train.tokenizer import ByteTokenizer, load_tokenizer
from moekit.train.loop import main as train_main

from tests.tiny import TINY_MODEL

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = ("mixtral-tiny", "switch-tiny", "deepseek-tiny")
STEPS = 2


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("runs")
    out = {}
    for name in FAMILIES:
        run = root / name
        flags = [*TINY_MODEL, "--preset", name, "--steps", str(STEPS), "--checkpoint.every", "1",
                 "--checkpoint.keep", "2", "--run-dir", str(run)]
        if name == "deepseek-tiny":  # with multi-token-prediction depths: speculative decoding drafts with them
            flags += ["--model.mtp_layers", "2"]
        assert train_main(flags) == 0
        out[name] = run
    return out


def quiet(msg: str) -> None:
    pass


def load(run: Path):
    return load_for_inference(run, "cpu", "float32", warn=quiet)


def val_loss(run: Path) -> float:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return rows[-1]["val_loss"]


def one_line(capsys, rc: int, prog: str) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith(f"{prog}: error: "), err
    return err[0]


# ---------------------------------------------------------------------------------------------------
# The KV cache
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_cached_logits_equal_the_full_forward(runs, family):
    model, _, info = load(runs[family])
    assert info.cache_inexact is None and not model.training
    tokens = torch.randint(0, 256, (2, model.config.max_seq_len), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        full = model(tokens)  # [2, S, V]
        cache = KVCache(model.config)
        chunks = [(0, 5), (5, 6), (6, 13), *[(i, i + 1) for i in range(13, tokens.shape[1])]]  # prefill, steps, chunk
        inc = torch.cat([model(tokens[:, a:b], cache=cache) for a, b in chunks], dim=1)
    assert cache.length == tokens.shape[1]
    torch.testing.assert_close(inc, full, rtol=1e-5, atol=1e-5)


def test_kv_cache_refuses_overflow_and_wrong_capacity():
    cfg = ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, ffn_hidden_size=64,
                      moe_ffn_hidden_size=32, max_seq_len=8)
    model = build_model(cfg).eval()
    cache = KVCache(cfg, 4)
    with torch.inference_mode():
        model(torch.zeros(1, 3, dtype=torch.long), cache=cache)
        with pytest.raises(ValueError, match="KV cache holds 4 positions; appending 2 at position 3"):
            model(torch.zeros(1, 2, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match=r"capacity 9 is invalid; it must be in \[1, model.max_seq_len=8\]"):
        KVCache(cfg, 9)


def test_expert_choice_is_not_decoded_with_the_cache():
    cfg = ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, ffn_hidden_size=64,
                      moe_ffn_hidden_size=32, max_seq_len=8, router="expert_choice", capacity_factor=1.0, top_k=1)
    model = build_model(cfg)
    assert inference_routing(model) == [] and not model.training  # its capacity is its selection rule: kept
    assert "expert_choice" in cache_inexact(model)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_are_the_same_with_and_without_the_cache(runs, family):
    model, _, _ = load(runs[family])
    W = model.config.max_seq_len
    rng = np.random.default_rng(7)
    for length, shifts in ((1, 0), (20, 1), (W + 8, 2)):  # the last prompt is longer than the window (W = 32)
        prompt = rng.integers(0, 256, length).tolist()
        cached = generate(model, prompt, 24, use_cache=True)
        full = generate(model, prompt, 24, use_cache=False)
        assert cached.new_ids == full.new_ids and len(cached.new_ids) == 24
        assert cached.shifts == full.shifts == shifts  # the window moved on to its newest W/2 tokens
        assert cached.prompt_dropped == max(0, length - W)


def test_generation_stops_at_eos(runs):
    model, _, _ = load(runs["mixtral-tiny"])
    prompt = list(b"def main(")
    free = generate(model, prompt, 6)
    eos = free.new_ids[3]
    stopped = generate(model, prompt, 6, eos_ids=(eos,))
    assert stopped.stopped == "eos" and stopped.new_ids == free.new_ids[: free.new_ids.index(eos)]
    assert free.stopped == "length"


# ---------------------------------------------------------------------------------------------------
# Sampling
# ---------------------------------------------------------------------------------------------------


def reference_set(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> tuple[list[int], np.ndarray]:
    """The top-k / top-p candidates by plain NumPy and Python sorting: ids most likely first, their probabilities."""
    z = logits.astype(np.float64) / temperature
    ids = sorted(range(z.size), key=lambda i: (-z[i], i))[: top_k or z.size]
    p = np.exp(z[ids] - z[ids].max())
    p /= p.sum()
    if top_p < 1:
        n = next(i + 1 for i in range(len(ids)) if p[: i + 1].sum() >= top_p)
        ids, p = ids[:n], p[:n] / p[:n].sum()
    return ids, p


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 5, 1.0), (0.7, 0, 0.6), (1.3, 12, 0.8), (0.5, 1, 1.0)])
def test_top_k_top_p_candidates_match_a_reference(temperature, top_k, top_p):
    logits = torch.randn(64, generator=torch.Generator().manual_seed(3)) * 3
    sampling = Sampling(temperature, top_k, top_p)
    ids, probs = candidates(logits, sampling)
    want_ids, want_p = reference_set(logits.numpy(), temperature, top_k, top_p)
    assert ids.tolist() == want_ids
    np.testing.assert_allclose(probs.numpy(), want_p, rtol=1e-9)
    draws = [next_token(logits, sampling, torch.Generator().manual_seed(s)) for s in range(200)]
    assert set(draws) <= set(want_ids)
    again = [next_token(logits, sampling, torch.Generator().manual_seed(s)) for s in range(200)]
    assert draws == again  # a seed fixes the draw
    if len(want_ids) > 2:
        assert len(set(draws)) > 1  # and it does sample


def test_greedy_is_argmax_and_sampled_generation_follows_the_seed(runs):
    logits = torch.tensor([0.5, 2.0, 2.0, -1.0])
    assert next_token(logits, Sampling(), torch.Generator()) == 1  # a tie goes to the lower id
    model, _, _ = load(runs["deepseek-tiny"])
    prompt = list(b"import ")
    sampling = Sampling(0.9, 20, 0.95)
    a = generate(model, prompt, 24, sampling, seed=5)
    b = generate(model, prompt, 24, sampling, seed=5)
    c = generate(model, prompt, 24, sampling, seed=6)
    assert a.new_ids == b.new_ids and a.new_ids != c.new_ids


# ---------------------------------------------------------------------------------------------------
# Tokenizers
# ---------------------------------------------------------------------------------------------------


def test_byte_tokenizer_decodes_with_replacement():
    tok = ByteTokenizer(eos_id=256, vocab_size=257)
    assert tok.encode("é€") == [0xC3, 0xA9, 0xE2, 0x82, 0xAC]
    assert tok.decode([0xC3, 0xA9, 256, 0xE2, 0x82, 0xAC]) == "é€"  # 256 (EOS) decodes to nothing
    assert tok.decode([0x61, 0xE2, 0x82]) == "a\ufffd"  # a cut multi-byte character
    assert tok.decode([0xFF, 0x62]) == "\ufffdb"  # not UTF-8 at all
    assert tok.byte_count([0x61, 256, 0x62]) == 2
    assert continuation(tok, tok.encode("caf"), [0xC3, 0xA9]) == "é"


def write_hf_tokenizer(folder: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["def foo(x):\n    return x + 1\n"] * 20, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"


def test_hf_tokenizer_contract(tmp_path):
    path = write_hf_tokenizer(tmp_path / "hf")
    (tmp_path / "hf" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    tok = load_tokenizer(tmp_path / "hf", 320, hf=True)
    assert tok.eos_id == 1 and tok.decode(tok.encode("def foo(x): héllo")) == "def foo(x): héllo"
    (tmp_path / "hf" / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 0]}))
    assert load_tokenizer(tmp_path / "hf", 320, hf=True).eos_ids == (1, 0)
    with pytest.raises(UserError, match="token ids but the model's vocab_size is 256"):
        load_tokenizer(tmp_path / "hf", 256, hf=True)
    for other in ("tiktoken.model", "tokenizer.model"):  # Kimi K2, sentencepiece: never byte tokens instead
        folder = tmp_path / other
        folder.mkdir()
        (folder / other).write_bytes(b"\0" * 16)
        with pytest.raises(UserError, match=rf"the tokenizer is {other} with no tokenizer.json"):
            load_tokenizer(folder, 320, hf=True)
        assert load_tokenizer(folder, 320).kind == "bytes"  # a run directory's contract: bytes without the file
    run = tmp_path / "run"  # a run directory: tokenizer_info.json names the EOS and pins the file's digest
    run.mkdir()
    shutil.copy(path, run / "tokenizer.json")
    info = {"kind": "hf", "source": str(path), "sha256": "0" * 64, "vocab_size": 289, "eos_id": 1}
    (run / "tokenizer_info.json").write_text(json.dumps(info))
    with pytest.raises(UserError, match="not the tokenizer the run was trained with"):
        load_tokenizer(run, 320)
    info["sha256"] = load_tokenizer(tmp_path / "hf", 320).sha256
    (run / "tokenizer_info.json").write_text(json.dumps(info))
    tok = load_tokenizer(run, 320)
    assert tok.eos_id == 1 and tok.kind == "hf" and not tok.add_special_tokens
    (run / "tokenizer_info.json").unlink()  # lost: the EOS is the one moekit-prepare would have chosen
    assert load_tokenizer(run, 320).eos_ids == (1,)  # "</s>"


def test_a_run_on_a_prepared_bpe_set_decodes_with_its_tokenizer(tmp_path, capsys):
    """moekit-prepare's BPE set -> moekit-train -> the run's tokenizer.json / tokenizer_info.json -> text out."""
    from tokenizers import Tokenizer

    from moekit.train.config import DataSection
    from moekit.train.data import load_data
    from moekit.train.prepare import main as prepare_main

    data, run = tmp_path / "bpe.bin", tmp_path / "run"
    assert prepare_main(["@embedded", "--tokenizer", "bpe:300", "-o", str(data), "--workers", "1", "--quiet"]) == 0
    assert train_main([*TINY_MODEL, "--steps", "1", "--data.path", str(data), "--run-dir", str(run)]) == 0
    capsys.readouterr()
    assert generate_main([str(run), "--prompt", "def f(x):", "--max-new-tokens", "5", "--device", "cpu"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("def f(x):") and f"tokenizer {run / 'tokenizer.json'} (vocab 300, EOS 0)" in err
    report = tmp_path / "eval.json"
    assert eval_main([str(run), "--batches", "2", "--out", str(report)]) == 0
    capsys.readouterr()
    r = json.loads(report.read_text())
    assert r["loss"] == pytest.approx(val_loss(run), rel=1e-6)
    split = load_data(DataSection(path=str(data)), 300).split(32, 0.05)
    tok = Tokenizer.from_file(str(run / "tokenizer.json"))
    rows = [split.tokens[s + 1 : s + 33].tolist() for s in split.validation(8)]  # the predicted tokens
    nbytes = sum(len(tok.decode(row).encode("utf-8")) for row in rows)
    assert r["bytes"] == nbytes != r["tokens"]
    assert r["bits_per_byte"] == pytest.approx(r["loss"] * r["tokens"] / math.log(2) / nbytes, rel=1e-9)
    with open(run / "tokenizer.json", "a") as f:
        f.write(" ")  # another file than the run recorded
    line = one_line(capsys, generate_main([str(run), "--prompt", "x"]), "generate.py")
    assert "is not the tokenizer the run was trained with" in line


# ---------------------------------------------------------------------------------------------------
# The programs
# ---------------------------------------------------------------------------------------------------


def test_generate_from_a_checkpoint_and_from_its_hf_export(runs, tmp_path, capsys):
    from moekit.models.hf import save_mixtral

    run = runs["mixtral-tiny"]
    ckpt = run / "checkpoints" / f"step_{STEPS:06d}"
    argv = ["--prompt", "def main(", "--max-new-tokens", "12", "--device", "cpu"]
    assert generate_main([str(ckpt), *argv]) == 0
    out, err = capsys.readouterr()
    text = out.rstrip("\n")
    assert text.startswith("def main(") and "tokens/s" in err.splitlines()[-1] and "12 new tokens" in err
    assert generate_main([str(run), *argv, "--no-cache"]) == 0  # the run dir reads the same (newest) checkpoint
    assert capsys.readouterr().out.rstrip("\n") == text
    assert generate_main([str(run), *argv, "--top-k", "5"]) == 0  # greedy: the same text, and a note says so
    out, err = capsys.readouterr()
    assert out.rstrip("\n") == text and "--temperature 0 decodes greedily (the most likely token), so --top-k has " \
        "no effect" in err
    model, _, _ = load(run)
    hf = save_mixtral(model, tmp_path / "hf")
    assert generate_main([str(hf), *argv]) == 0
    out, err = capsys.readouterr()
    assert out.rstrip("\n") == text and "HuggingFace" in err  # the same weights, the same greedy text


def test_run_dir_skips_a_damaged_newest_checkpoint(runs, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(runs["switch-tiny"], run)
    newest = run / "checkpoints" / f"step_{STEPS:06d}"
    data = next(newest.glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # same size, another digest
    data.write_bytes(bytes(raw))
    warnings = []
    _, _, info = load_for_inference(run, "cpu", "float32", warn=warnings.append)
    assert info.step == STEPS - 1 and "sha256 mismatch" in warnings[0]


@pytest.mark.parametrize("family,capacity", [("mixtral-tiny", "dropless"), ("deepseek-tiny", "dropless"),
                                             ("switch-tiny", "trained")])
def test_eval_reproduces_the_trainers_val_loss(runs, tmp_path, family, capacity, capsys):
    run, out = runs[family], tmp_path / "eval.json"
    # the trainer evaluated eval.sequences=8 validation windows in micro-batches of 4: two batches of 4
    assert eval_main([str(run), "--batches", "2", "--capacity", capacity, "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["windows"] == 8 and r["tokens"] == 8 * 32 and r["batch_size"] == 4 and r["step"] == STEPS
    assert r["loss"] == pytest.approx(val_loss(run), rel=1e-6)
    assert r["bits_per_byte"] == pytest.approx(r["loss"] / math.log(2), rel=1e-12)  # byte tokens
    assert r["perplexity"] == pytest.approx(math.exp(r["loss"]))
    cfg = ModelConfig.from_dict(json.loads((run / "config.json").read_text())["model"])
    load = r["expert_load"]
    depths = [k for k in range(1, cfg.mtp_layers + 1) if cfg.is_moe_layer(cfg.num_layers + k - 1)]
    assert [layer["name"] for layer in load["layers"]][cfg.num_moe_layers:] == [f"mtp.{k - 1}.block.ffn" for k in depths]
    for layer in load["layers"]:  # an MTP depth k routes the S - k positions it predicts from
        k = int(layer["name"].split(".")[1]) + 1 if layer["name"].startswith("mtp.") else 0
        tokens = r["windows"] * (32 - k)
        assert sum(layer["assigned_per_expert"]) == tokens * cfg.top_k
        assert sum(layer["tokens_per_expert"]) + layer["dropped_slots"] == tokens * cfg.top_k
        assert layer["dead_experts"] == layer["tokens_per_expert"].count(0) and layer["imbalance"] >= 1
        assert -1 <= layer["similarity"] < 0.5  # trained from random experts: far from copies
        assert (layer["dropped_slots"] == 0) == (capacity == "dropless")
    assert capsys.readouterr().out.startswith(f"loss {r['loss']:.4f}")
    assert len(r["mtp"]) == cfg.mtp_layers  # deepseek-tiny trained with two depths
    if cfg.mtp_layers:  # the trainer's val_mtp_loss (the depths' mean) on the same windows, computed another way
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        mean = sum(d["loss"] for d in r["mtp"]) / len(r["mtp"])
        assert mean == pytest.approx(rows[-1]["val_mtp_loss"], rel=1e-5)


def test_eval_all_windows_within_a_token_budget(runs, tmp_path):
    out = tmp_path / "eval.json"
    assert eval_main([str(runs["switch-tiny"]), "--split", "all", "--max-tokens", "200", "--seq-len", "16",
                      "--batch-size", "3", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert (r["windows"], r["tokens"], r["seq_len"], r["split"]) == (12, 192, 16, "all")
    assert r["expert_load"]["dropped_fraction"] == 0  # dropless by default


def bad_runs(runs, tmp_path) -> dict[str, Path]:
    empty = tmp_path / "empty"
    empty.mkdir()
    no_ckpt = tmp_path / "no_ckpt"
    no_ckpt.mkdir()
    shutil.copy(runs["mixtral-tiny"] / "config.json", no_ckpt / "config.json")
    corrupt = tmp_path / "corrupt"
    shutil.copytree(runs["mixtral-tiny"], corrupt)
    for meta in corrupt.glob("checkpoints/*/meta.json"):
        meta.write_text("{not json")
    other = tmp_path / "other"
    shutil.copytree(runs["mixtral-tiny"], other)
    config = json.loads((other / "config.json").read_text())
    config["model"]["hidden_size"] = 64
    (other / "config.json").write_text(json.dumps(config))
    return {"empty": empty, "no_ckpt": no_ckpt, "corrupt": corrupt, "other": other}


GENERATE_BAD = [
    (["{missing}"], "no such file or directory; pass a run directory"),
    (["{empty}"], "neither a run directory (checkpoints/), a checkpoint (meta.json) nor a HuggingFace folder"),
    (["{no_ckpt}"], "a run directory without checkpoints"),
    (["{corrupt}"], "no checkpoint verifies: checkpoint"),
    (["{corrupt}/checkpoints/step_000002"], "meta.json: corrupt (JSONDecodeError"),
    (["{other}"], "describe a different model than the checkpoint: hidden_size=64 (run) vs 32 (checkpoint)"),
    (["{run}", "--max-new-tokens", "0"], "--max-new-tokens 0 is invalid; it must be a positive number"),
    (["{run}", "--max-new-tokens", "-3"], "--max-new-tokens -3 is invalid"),
    (["{run}", "--top-p", "0"], "--top-p 0.0 is invalid; use a probability in (0, 1]"),
    (["{run}", "--temperature", "-1"], "--temperature -1.0 is invalid"),
    (["{run}", "--prompt", ""], "--prompt encodes to no tokens"),
    (["{run}", "--dtype", "int8"], "--dtype 'int8' is invalid"),
    (["{run}", "--device", "tpu"], "--device 'tpu'"),
    (["{run}", "--seed", str(2**64)], f"--seed {2**64} is invalid; it must be in [0, 2**64)"),
    (["{run}", "--speculative"], "has none (model.mtp_layers 0): train with --model.mtp_layers 1, or drop"),
    (["{run}", "--speculative", "--no-cache"], "--speculative checks its drafts against the KV cache; drop --no-cache"),
    (["{mtp}", "--draft-depths", "2"], "--draft-depths 2 sets how many MTP depths draft for --speculative; add "
                                       "--speculative, or drop --draft-depths"),
    (["{mtp}", "--speculative", "--draft-depths", "0"], "--draft-depths 0 is invalid; use 1 or more"),
    (["{mtp}", "--speculative", "--draft-depths", "3"], "--draft-depths 3 exceeds the 2 multi-token-prediction "
                                                        "depth(s) of {mtp} (model.mtp_layers 2); use 1 to 2, or drop"),
    (["{mtp}", "--speculative", "--draft-depths", "two"], "argument --draft-depths: invalid int value: 'two'"),
]


@pytest.mark.parametrize("argv,expected", GENERATE_BAD)
def test_generate_bad_input_is_one_line(runs, tmp_path, capsys, argv, expected):
    paths = {**bad_runs(runs, tmp_path), "missing": tmp_path / "missing", "run": runs["mixtral-tiny"],
             "mtp": runs["deepseek-tiny"]}
    argv, expected = [a.format(**paths) for a in argv], expected.format(**paths)
    if "--prompt" not in argv:
        argv += ["--prompt", "x"]
    line = one_line(capsys, generate_main(argv), "generate.py")
    assert expected in line, line


@pytest.mark.parametrize("argv,expected", [
    (["--seq-len", "64"], "--seq-len 64 exceeds the model's max_seq_len 32"),
    (["--max-tokens", "10"], "--max-tokens 10 is less than one window of 32"),
    (["--batches", "0"], "--batches 0 is invalid"),
    (["--data", "{missing}"], "cannot read it"),
    (["--out", "{tmp}"], "a directory; name the JSON file to write"),
])
def test_eval_bad_input_is_one_line(runs, tmp_path, capsys, argv, expected):
    argv = [str(runs["deepseek-tiny"]), *[a.format(missing=tmp_path / "nope.bin", tmp=tmp_path) for a in argv]]
    line = one_line(capsys, eval_main(argv), "evaluate.py")
    assert expected in line, line


def test_eval_data_errors_name_evals_own_flags(runs, tmp_path, capsys):
    """The data layer's messages name moekit-train's settings; moekit-eval words them for its own flags."""
    text, small = tmp_path / "notes.txt", tmp_path / "small.bin"
    text.write_text("hi there")
    np.arange(40, dtype=np.uint16).tofile(small)
    run = str(runs["deepseek-tiny"])
    line = one_line(capsys, eval_main([run, "--data", str(text)]), "evaluate.py")
    assert "the run's data.dtype" in line and "prepared with the model's tokenizer" in line, line
    assert "--model.vocab_size" not in line and "--data.dtype" not in line, line
    line = one_line(capsys, eval_main([run, "--data", str(small)]), "evaluate.py")
    assert "use more data, a smaller --seq-len" in line and "--train.seq_len" not in line, line


def test_generate_benchmark_smoke(runs, tmp_path, capsys):
    from moekit.bench.generate import main as bench_main

    out = tmp_path / "bench.json"
    assert bench_main(["--presets", "switch-tiny", "--max-seq-len", "16", "--prompt-len", "4", "--new-tokens", "20",
                       "--repeats", "1", "--device", "cpu", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["results"]
    assert row["same"] and row["generated"] == 20 and row["speedup"] > 0  # 24 positions > 16: the window moves
    assert "speedup" in capsys.readouterr().out and "spec_tok_s" not in row
    # a trained run with two MTP depths (and a preset given them): speculative decoding joins the round-robin, with
    # chains of one and two drafts (one row each, the same cached decode as their peer); three: more than they have
    assert bench_main(["--presets", "mixtral-tiny", "--mtp-layers", "2", "--runs", str(runs["deepseek-tiny"]),
                       "--draft-depths", "1", "2", "3", "--max-seq-len", "16", "--prompt-len", "4", "--new-tokens",
                       "12", "--repeats", "1", "--device", "cpu", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert [(r["preset"], r["draft_depths"]) for r in rows] == [("mixtral-tiny", 1), ("mixtral-tiny", 2),
                                                                ("deepseek-tiny", 1), ("deepseek-tiny", 2)]
    for r in rows:
        assert r["same"] and r["spec_tok_s"] > 0 and 0 <= r["acceptance"] <= 1
        assert len(r["acceptance_by_depth"]) == r["draft_depths"]
        assert 1 <= r["tokens_per_forward"] <= r["draft_depths"] + 1
        assert r["spec_speedup"] == pytest.approx(r["spec_tok_s"] / r["cache_tok_s"])
    out, err = capsys.readouterr()
    assert "spec tok/s" in out and "accepted by depth" in out and "no chains of [3] drafts" in err


def test_generate_script_exit_status_and_no_traceback(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "generate.py"), str(tmp_path / "nope"), "--prompt",
                           "x"], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr


# ---------------------------------------------------------------------------------------------------
# Speculative decoding with the multi-token-prediction depth
# ---------------------------------------------------------------------------------------------------


def spec_model(seed: int, narrow_head: bool = False, **over):
    """A tiny DeepSeek-style model with one MTP depth, a 12-token vocabulary (random drafts are accepted now and
    then, so both branches run) and a 20-position window (the window moves during a 50-token decode).
    ``narrow_head``: the head reads only the first hidden unit, so every depth predicts one of two tokens and
    drafts are often right at every depth of a chain (random depths beyond the first almost never are)."""
    base = dict(name="spec", vocab_size=12, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=4, max_seq_len=20,
                ffn_hidden_size=48, num_experts=4, moe_ffn_hidden_size=16, shared_ffn_hidden_size=16, top_k=2,
                first_dense_layers=1, mtp_layers=1)
    base.update(over)
    model = build_model(ModelConfig(**base), seed=seed).eval()
    if narrow_head:
        with torch.no_grad():
            model.lm_head.weight[:, 1:] = 0
    return model


MLA = dict(attention="mla", kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, q_lora_rank=16)
# Qwen3.5's layers: a Gated DeltaNet layer, whose cache takes rejected drafts back through its per-position states
QWEN = dict(linear_attention="gated_deltanet", full_attention_every=2, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8, attention_output_gate=True,
            norm_zero_centered=True, qk_norm="head", first_dense_layers=0, shared_expert_gate=True)
SPEC_CONFIGS = {"moe": {}, "dense": dict(num_experts=0, shared_ffn_hidden_size=0), "mla": MLA,
                "tied": dict(tie_embeddings=True), "qwen3.5": QWEN}


@pytest.mark.cover  # each value's path every run, re-paired each run (tests/conftest.py)
@pytest.mark.parametrize("depths", [1, 2, 3])
@pytest.mark.parametrize("config", list(SPEC_CONFIGS))
def test_speculative_greedy_gives_the_plain_greedy_tokens(config, depths):
    """Greedy speculative decoding with chains of 1-3 drafts against generate() with the cache, over several models
    and prompts: the same tokens through accepted, partly accepted and rejected chains and moving windows; a kept
    draft saves a forward."""
    kept, drafted = [0] * depths, [0] * depths
    narrow = (False,) if config == "tied" else (False, True)  # (a narrow tied head would blind the embedding)
    for seed in range(3):
        for narrow_head in narrow:
            model = spec_model(seed, narrow_head, mtp_layers=3, **SPEC_CONFIGS[config])
            prompt = torch.randint(0, 12, (3 + seed,), generator=torch.Generator().manual_seed(seed)).tolist()
            want = generate(model, prompt, 50)
            got = generate_speculative(model, prompt, 50, draft_depths=depths)
            assert got.new_ids == want.new_ids, (seed, narrow_head)
            assert got.shifts > 0 and want.shifts - got.shifts in (0, 1)  # (generate counts a move after its end)
            assert len(got.drafted_by_depth) == depths and 0 < got.drafted
            # each chain checked is one forward; prefills (one per window) and draftless steps are the others
            assert got.forwards < len(got.new_ids) + got.shifts + 1
            assert got.forwards + got.accepted >= len(got.new_ids)  # each kept draft: a token without a forward
            kept = [a + b for a, b in zip(kept, got.accepted_by_depth)]
            drafted = [a + b for a, b in zip(drafted, got.drafted_by_depth)]
    assert drafted[0] >= drafted[-1] and all(a <= b for a, b in zip(kept, drafted))
    if config != "tied":  # every depth's drafts were kept and rejected (the narrow heads), so every branch ran
        assert all(0 < a < b for a, b in zip(kept, drafted)), (kept, drafted)


@pytest.mark.parametrize("config", ["moe", "mla"])
def test_the_drafts_are_the_trained_depths_predictions(config):
    """The DraftChain that generate_speculative drives, with random partial acceptance of its 3-draft chains (so the
    depths are fed 1-4 new positions at a time and roll back by different amounts), against the training objective's
    depth chain (models.mtp.depth_states, as mtp_loss runs it) on the whole settled sequence: after every rollback,
    each depth's draft logits at every position it keeps equal training's. (A RoPE position off by one for some of a
    depth's chunks fails this; shifting all of a depth's positions alike would not: RoPE scores are relative.)"""
    import random

    from moekit.models.mtp import depth_states
    from moekit.models.rope import rope_tables
    from moekit.train.decoding import DraftChain, _pick, draft_logits

    D, W = 3, 40
    # init_std 0.3: attention peaked enough that a position off by one moves the logits by far more than rounding
    model = spec_model(3, mtp_layers=D, max_seq_len=W, init_std=0.3, **SPEC_CONFIGS[config])
    rng, gen = random.Random(0), torch.Generator().manual_seed(0)
    seq = [rng.randrange(12) for _ in range(5)]
    checked = [0] * (D + 1)
    with torch.inference_mode():
        chain = DraftChain(model, D)
        chain.forward(seq[:-1])  # the prefill: seq[-1] is the next token, not yet read
        while len(seq) < W - D:
            m = len(seq) - 1
            chain.rollback(m)
            tokens = torch.tensor([seq])
            _, x = model(tokens, return_hidden=True)  # the whole sequence, no cache
            cos, sin = rope_tables(model.config, len(seq), "cpu")
            for k, h in depth_states(model, x, model.embed(tokens), tokens, cos, sin):
                n = chain.caches[k].length
                if not n:  # (before its first draft)
                    continue
                want = torch.nn.functional.linear(h[:, :n], model.lm_head.weight)  # as head_loss computes it
                torch.testing.assert_close(draft_logits(model, k, chain.states[k][:, :n]), want, rtol=1e-5, atol=1e-5)
                checked[k] = max(checked[k], n)
            drafts = chain.draft(seq, D, lambda logits: _pick(logits, Sampling(), gen))
            chain.forward([seq[-1], *(d for d, _, _ in drafts)])
            a = rng.randint(0, D)  # keep the first a drafts, then a token of our own
            seq += [d for d, _, _ in drafts[:a]] + [rng.randrange(12)]
    assert min(checked[1:]) > W // 2  # every depth was checked far into the sequence


def test_accept_draft_keeps_the_target_distribution():
    """Speculative sampling's rule, drawn 20000 times: the tokens it returns follow p whatever the draft
    distribution q (including tokens q never proposes and p lacks), within 4 standard errors."""
    gen = torch.Generator().manual_seed(0)
    p_ids, p = torch.tensor([0, 1, 2, 3]), torch.tensor([0.5, 0.25, 0.15, 0.10], dtype=torch.float64)
    q_ids, q = torch.tensor([1, 0, 4]), torch.tensor([0.6, 0.1, 0.3], dtype=torch.float64)
    n, counts, kept = 20000, torch.zeros(5), 0
    for _ in range(n):
        draft = int(q_ids[torch.multinomial(q, 1, generator=gen)])
        ok, token = accept_draft(p_ids, p, q_ids, q, draft, gen)
        counts[token] += 1
        kept += ok
    want = torch.tensor([0.5, 0.25, 0.15, 0.10, 0.0])
    err = (want * (1 - want) / n).sqrt()
    assert ((counts / n - want).abs() <= 4 * err + 1e-9).all(), counts / n
    assert abs(kept / n - 0.35) < 0.02  # sum_x min(p, q) = 0.25 + 0.1 + 0 = 0.35


def test_a_chain_of_drafts_keeps_the_target_distribution():
    """check_drafts on 2-draft chains, decoding 3 tokens 4000 times over a 3-token vocabulary with made-up target
    and draft models (each a distribution per context length and last token, far apart): the chains are drafted,
    checked and extended as generate_speculative does, so the tokens come from kept drafts at both depths,
    residual draws after a kept draft and bonus tokens. The 27 frequencies of the first three tokens match the
    target's exact joint probabilities within 4 standard errors of the sample count (and the rule that keeps every
    draft fails this by far)."""
    from moekit.train.decoding import _pick, check_drafts

    V, n = 3, 4000
    table = torch.Generator().manual_seed(4)
    p = torch.rand(6, V + 1, V, generator=table, dtype=torch.float64) ** 3  # [context length, last token (V: none), V]
    q = torch.rand(6, V + 1, V, generator=table, dtype=torch.float64) ** 3
    p, q = p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)

    def dist(table: torch.Tensor, context: list[int]) -> torch.Tensor:
        return table[len(context), context[-1] if context else V]

    sampling, gen = Sampling(temperature=1.0), torch.Generator().manual_seed(0)
    counts, kept_by_depth = torch.zeros(V, V, V), [0, 0]
    for _ in range(n):
        seq = []
        while len(seq) < 3:
            drafts, ahead = [], list(seq)
            for _ in range(2):  # depth k drafts after depth k-1's draft
                drafts.append(_pick(dist(q, ahead).log(), sampling, gen))
                ahead.append(drafts[-1][0])
            logits = torch.stack([dist(p, seq + ahead[len(seq):len(seq) + j]).log() for j in range(3)])  # [3, V]
            tokens, kept = check_drafts(logits, drafts, sampling, gen)
            seq += tokens
            for j in range(kept):
                kept_by_depth[j] += 1
        counts[tuple(seq[:3])] += 1
    want = torch.zeros(V, V, V, dtype=torch.float64)
    for a, b, c in np.ndindex(V, V, V):
        want[a, b, c] = dist(p, [])[a] * dist(p, [a])[b] * dist(p, [a, b])[c]
    err = (want * (1 - want) / n).sqrt()
    assert ((counts / n - want).abs() <= 4 * err + 1e-9).all(), (counts / n - want).abs().max()
    assert kept_by_depth[0] > kept_by_depth[1] > 0  # both depths' drafts were kept, and rejected
    always = torch.zeros(V, V, V, dtype=torch.float64)  # the rule's opposite: tokens drawn as q chains them
    for a, b, c in np.ndindex(V, V, V):
        always[a, b, c] = dist(q, [])[a] * dist(q, [a])[b] * dist(q, [a, b])[c]
    assert ((always - want).abs() > 8 * err).any()


def test_speculative_sampling_follows_the_seed_and_stops_at_eos():
    model = spec_model(0, mtp_layers=2)
    sampling = Sampling(temperature=0.9, top_k=8)
    a = generate_speculative(model, [1, 2, 3], 30, sampling, seed=5)
    b = generate_speculative(model, [1, 2, 3], 30, sampling, seed=5)
    assert a.new_ids == b.new_ids and len(a.new_ids) == 30 and all(0 <= t < 12 for t in a.new_ids)
    assert len(a.drafted_by_depth) == 2 and a.drafted_by_depth[1] > 0
    eos = a.new_ids[7]
    c = generate_speculative(model, [1, 2, 3], 30, sampling, seed=5, eos_ids=(eos,))
    assert c.stopped == "eos" and c.new_ids == a.new_ids[: a.new_ids.index(eos)]
    with pytest.raises(ValueError, match="has none"):
        generate_speculative(spec_model(0, mtp_layers=0), [1], 4)
    for bad in (0, 3):
        with pytest.raises(ValueError, match=f"draft_depths={bad} is invalid; the model has 2 MTP depths"):
            generate_speculative(model, [1], 4, draft_depths=bad)


def test_generate_speculative_from_a_run_with_mtp_depths(runs, capsys):
    """moekit-generate --speculative on a run trained with --model.mtp_layers 2: the greedy text of the plain
    decode with chains of one and two drafts, and each depth's acceptance in the stats line."""
    argv = [str(runs["deepseek-tiny"]), "--prompt", "def main(", "--max-new-tokens", "16", "--device", "cpu"]
    assert generate_main(argv) == 0
    plain = capsys.readouterr().out
    assert generate_main([*argv, "--speculative"]) == 0  # every depth drafts
    out, err = capsys.readouterr()
    assert out == plain and re.search(r"MTP drafts accepted \d+% / \d+% by depth \(\d+/\d+\), [\d.]+ tokens per "
                                      r"forward", err), err
    assert generate_main([*argv, "--speculative", "--draft-depths", "1"]) == 0  # one draft per forward
    out, err = capsys.readouterr()
    assert out == plain and re.search(r"MTP drafts accepted \d+% \(\d+/\d+\), [\d.]+ tokens per forward", err), err


def test_eval_reports_each_mtp_depth_as_training_computes_it(tmp_path):
    """moekit.train.evaluation.mtp_counts against the training objective on the same batch: depth k's mean loss
    is the one pop_mtp_loss reports (one depth), its accuracy and agreement are counted from the logits here."""
    from moekit.models.rope import rope_tables
    from moekit.train.evaluation import mtp_counts

    model = spec_model(2, vocab_size=40, max_seq_len=24)
    x = torch.randint(0, 40, (3, 24), generator=torch.Generator().manual_seed(0))
    y = torch.randint(0, 40, (3, 24), generator=torch.Generator().manual_seed(1))
    model.train()
    model(x, targets=y)  # the training forward records depth 1's loss
    want = model.pop_mtp_loss()
    model.eval()
    with torch.no_grad():
        logits, hidden = model(x, return_hidden=True)
        counts = mtp_counts(model, x, y, logits, hidden)[0]
        cos, sin = rope_tables(model.config, 24, "cpu")
        h = model.mtp[0](hidden[:, :23], model.embed(x[:, 1:]), cos[:23], sin[:23], x[:, 1:])
        top = torch.nn.functional.linear(model.mtp[0].norm(h), model.lm_head.weight).argmax(-1)
    assert counts[3] == 3 * 23
    assert counts[0] / counts[3] == pytest.approx(float(want), rel=1e-5)
    assert counts[1] == (top == y[:, 1:]).sum() and counts[2] == (top == logits.argmax(-1)[:, 1:]).sum()


# ---------------------------------------------------------------------------------------------------
# Chat models: --chat renders the folder's chat template, decoding stops at the folder's end tokens
# ---------------------------------------------------------------------------------------------------

# ChatML-like, as Qwen's: BOS, a system turn, a refusal of unknown roles, and the assistant header on request
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
                 "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
                 "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CHAT_SPECIAL = ["<unk>", "<s>", "<|im_start|>", "<|im_end|>", "<|endoftext|>"]
SYSTEM, QUESTION = "You are terse.", "What is two plus two?"


@pytest.fixture(scope="module")
def chat_base(tmp_path_factory) -> Path:
    """A tiny Mixtral as an HF folder (moekit's save_hf) with a BPE tokenizer.json whose vocabulary is the model's,
    no chat template and no end token anywhere: each test copies it and adds what it checks."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    from moekit.models.hf import save_hf

    folder = tmp_path_factory.mktemp("chat") / "hf"
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=CHAT_SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([f"{SYSTEM} {QUESTION}\nsystem user assistant four\n"] * 20, trainer)
    # BOS added to plain text, as Llama's: the template writes its own, so the chat encoding must not add one
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    cfg = ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, ffn_hidden_size=64,
                      moe_ffn_hidden_size=32, max_seq_len=64, vocab_size=tok.get_vocab_size())
    torch.manual_seed(0)
    save_hf(build_model(cfg), folder, family="mixtral")
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    return folder


def chat_folder(chat_base: Path, tmp_path: Path, where: str | None = "tokenizer_config", template=CHAT_TEMPLATE,
                **tokenizer_config) -> Path:
    folder = tmp_path / "hf"
    shutil.copytree(chat_base, folder)
    config = {"bos_token": "<s>", **tokenizer_config}
    if where == "tokenizer_config":
        config["chat_template"] = template
    elif where == "jinja":  # transformers reads the .jinja file first: a decoy in tokenizer_config.json
        (folder / "chat_template.jinja").write_text(template)
        config["chat_template"] = "DECOY {{ messages[0]['content'] }}"
    elif where == "json":
        (folder / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture
def spy_generate(monkeypatch):
    """Every decode moekit-generate runs, as (prompt ids it was given, its Generation)."""
    import moekit.train.decoding as decoding

    calls, real = [], decoding.generate

    def spy(model, prompt_ids, *args, **kwargs):
        out = real(model, prompt_ids, *args, **kwargs)
        calls.append((list(prompt_ids), out))
        return out

    monkeypatch.setattr(decoding, "generate", spy)
    return calls


CHAT_ARGV = ["--chat", "--system", SYSTEM, "--prompt", QUESTION, "--device", "cpu"]


@pytest.mark.parametrize("where", ["tokenizer_config", "jinja", "json"])
def test_chat_prompt_is_transformers_apply_chat_template(chat_base, tmp_path, capsys, spy_generate, where):
    """The ids fed to the model are those transformers' apply_chat_template makes from the same folder (for
    chat_template.json, which AutoTokenizer does not read, from the same template), and stdout is the answer only."""
    from transformers import AutoTokenizer

    folder = chat_folder(chat_base, tmp_path, where)
    assert generate_main([str(folder), *CHAT_ARGV, "--max-new-tokens", "6"]) == 0
    out, err = capsys.readouterr()
    ((fed, gen),) = spy_generate
    ref = AutoTokenizer.from_pretrained(str(folder))
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    extra = {"chat_template": CHAT_TEMPLATE} if where == "json" else {}
    want = ref.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True, **extra)
    assert fed == want["input_ids"]
    bos, start = ref.convert_tokens_to_ids(["<s>", "<|im_start|>"])
    assert fed[:2] == [bos, start] and fed.count(bos) == 1  # the template's BOS, none added by the encoding
    assert fed.count(start) == 3  # system, user, the assistant header
    tok = load_tokenizer(folder, 10**6, hf=True)
    answer = continuation(tok, fed, gen.new_ids)
    assert len(gen.new_ids) == 6 and out == answer + "\n"  # no template text, no question echoed
    source = {"jinja": "chat_template.jinja", "json": "chat_template.json"}.get(where, "tokenizer_config.json")
    assert f"chat template {folder / source} ({len(fed)} tokens)" in err


def test_chat_stops_at_an_end_token_of_generation_configs_list(chat_base, tmp_path, capsys, spy_generate):
    """A sampled chat (--temperature / --top-k / --seed honoured) stops at the first token that is in
    generation_config.json's eos_token_id list, which the end tokens of config.json and tokenizer_config.json join."""
    folder = chat_folder(chat_base, tmp_path)
    argv = [str(folder), *CHAT_ARGV, "--max-new-tokens", "24", "--temperature", "1.5", "--top-k", "50", "--seed", "3"]
    assert generate_main(argv) == 0  # no end token anywhere: all 24
    free = spy_generate[-1][1]
    assert free.stopped == "length" and len(free.new_ids) == 24
    k = next(i for i in range(3, 24) if free.new_ids[i] not in free.new_ids[:i])  # the stop: a token new at step k
    unused = [i for i in range(5, 250) if i not in free.new_ids[: k + 1]]
    end_turn = CHAT_SPECIAL.index("<|im_end|>")  # its id (the trainer numbers special tokens first), named below
    assert end_turn not in free.new_ids[:k], "the steered stop must be the first end token met"
    gen_list = [unused[0], free.new_ids[k]]  # the stop is the second of the list, as gpt-oss's several ids
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": gen_list}))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "eos_token_id": unused[1]}))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "<|im_end|>",
                                                              "chat_template": CHAT_TEMPLATE}))
    capsys.readouterr()
    assert generate_main(argv) == 0
    out, err = capsys.readouterr()
    fed, stopped = spy_generate[-1]
    assert stopped.stopped == "eos" and stopped.new_ids == free.new_ids[:k]
    tok = load_tokenizer(folder, 10**6, hf=True)
    assert out == continuation(tok, fed, free.new_ids[:k]) + "\n"
    assert f"EOS {gen_list[0]},{gen_list[1]},{unused[1]},{end_turn})" in err and err.rstrip().endswith("stopped at EOS")


def test_chat_template_renders_as_transformers_does(chat_base, tmp_path):
    """What real templates use beyond the ChatML basics, against transformers' own renderer: tojson without HTML
    escapes, {% generation %}, loop controls, namespace, strftime_now, and named templates (the "default" one)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    from moekit.train.inference import ChatTemplate, chat_messages

    text = ("{% set ns = namespace(n=0) %}{% for m in messages %}{% if loop.index > 5 %}{% break %}{% endif %}"
            "{% set ns.n = ns.n + 1 %}{{ m | tojson }}{% generation %}[{{ m['role'] }}]{% endgeneration %}"
            "{% endfor %}{{ ns.n }} {{ strftime_now('%Y') }} {{ eos_token }}{% if add_generation_prompt %}>{% endif %}")
    folder = chat_folder(chat_base, tmp_path, template=[{"name": "tool_use", "template": "TOOLS"},
                                                        {"name": "default", "template": text}], eos_token="</x>")
    messages = chat_messages('a <b> & "c"', "é")
    ours = ChatTemplate.load(folder).render(messages)
    (want,), _ = render_jinja_template([messages], chat_template=text, add_generation_prompt=True, bos_token="<s>",
                                      eos_token="</x>")
    assert ours == want and '"a <b> & \\"c\\""' in ours and "[user]" in ours and ours.endswith("</x>>")


def test_chat_errors_are_one_line(chat_base, tmp_path, capsys, monkeypatch):
    plain = chat_folder(chat_base, tmp_path / "plain", where=None)
    line = one_line(capsys, generate_main([str(plain), *CHAT_ARGV]), "generate.py")
    assert f"{plain}: no chat template" in line and "drop --chat and give the text to continue with --prompt" in line
    line = one_line(capsys, generate_main([str(plain), "--system", SYSTEM, "--prompt", QUESTION]), "generate.py")
    assert "--system sets the system message of a chat; add --chat" in line and "or drop --system" in line
    folder = chat_folder(chat_base, tmp_path / "ok")
    # the template's own refusal (raise_exception), a template that does not parse, named ones without a default
    refusing = chat_folder(chat_base, tmp_path / "refusing", template="{{ raise_exception('no system role') }}")
    line = one_line(capsys, generate_main([str(refusing), *CHAT_ARGV]), "generate.py")
    assert "the chat template refused the conversation (no system role)" in line, line
    broken = chat_folder(chat_base, tmp_path / "broken", where="jinja", template="{% for m in messages %}")
    line = one_line(capsys, generate_main([str(broken), *CHAT_ARGV]), "generate.py")
    assert f"{broken / 'chat_template.jinja'}: the chat template does not parse (line 1" in line, line
    named = chat_folder(chat_base, tmp_path / "named", template={"tool_use": "T", "rag": "R"})
    line = one_line(capsys, generate_main([str(named), *CHAT_ARGV]), "generate.py")
    assert "the chat templates are named ['rag', 'tool_use'] with no \"default\"" in line, line
    import jinja2

    monkeypatch.setattr(jinja2, "__version__", "3.1.5")
    line = one_line(capsys, generate_main([str(folder), *CHAT_ARGV]), "generate.py")
    assert "needs jinja2 >= 3.1.6" in line and "3.1.5 is installed" in line, line
    monkeypatch.setitem(sys.modules, "jinja2", None)  # not installed: the import fails
    line = one_line(capsys, generate_main([str(folder), *CHAT_ARGV]), "generate.py")
    assert "jinja2, which is not installed; pip install 'jinja2>=3.1.6' (or moekit's extra: pip install " \
           "'moekit[chat]')" in line, line
    # plain --prompt never needs jinja2, even on a folder with a template
    assert generate_main([str(folder), "--prompt", QUESTION, "--max-new-tokens", "2", "--device", "cpu"]) == 0


def test_chat_with_speculative_decoding_on_a_run_directory(runs, tmp_path, capsys, spy_generate):
    """A run directory's template is read too (its tokenizer is bytes here), and --speculative decodes the rendered
    prompt: greedy, the same answer as plain decoding."""
    run = tmp_path / "run"
    shutil.copytree(runs["deepseek-tiny"], run)  # two MTP depths
    (run / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    argv = [str(run), *CHAT_ARGV, "--max-new-tokens", "12"]
    assert generate_main(argv) == 0
    plain = capsys.readouterr().out
    ((fed, _),) = spy_generate
    text = f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n"
    assert fed == list(text.encode())  # no bos_token in a run's folder: the template's undefined renders as ""
    assert generate_main([*argv, "--speculative"]) == 0
    out, err = capsys.readouterr()
    assert out == plain and "MTP drafts accepted" in err and QUESTION not in out


# ---------------------------------------------------------------------------------------------------
# Harmony (gpt-oss): --chat prints the final channel; --show-reasoning the others on stderr
# ---------------------------------------------------------------------------------------------------

HARMONY_SPECIAL = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>"]
HARMONY_OUT = ("<|channel|>analysis<|message|>Two and two make four.<|end|>"
               "<|start|>assistant<|channel|>final<|message|>Four.<|return|>")


@pytest.fixture(scope="module")
def harmony_base(tmp_path_factory) -> Path:
    """chat_base's model with a tokenizer that knows harmony's markers (special tokens, as o200k_harmony's)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from moekit.models.hf import save_hf

    folder = tmp_path_factory.mktemp("harmony") / "hf"
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", *HARMONY_SPECIAL],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["user assistant analysis final Two and two make four. Four.\n"] * 20, trainer)
    cfg = ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, ffn_hidden_size=64,
                      moe_ffn_hidden_size=32, max_seq_len=96, vocab_size=tok.get_vocab_size())
    torch.manual_seed(0)
    save_hf(build_model(cfg), folder, family="mixtral")
    tok.save(str(folder / "tokenizer.json"))
    template = ("{% for m in messages %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>{% endfor %}"
                "{% if add_generation_prompt %}<|start|>assistant{% endif %}")
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    return folder


def test_harmony_messages_split_by_channel(harmony_base):
    from moekit.train import harmony

    tok = load_tokenizer(harmony_base, 10**6, hf=True)
    markers = harmony.marker_ids(tok)
    ids = tok.tok.encode(HARMONY_OUT, add_special_tokens=False).ids
    found = harmony.messages(tok, ids, markers)
    assert [(m.channel, m.text.strip(), m.complete) for m in found] == [
        ("analysis", "Two and two make four.", True), ("final", "Four.", True)]
    assert harmony.answer(found) == "Four."
    cut = harmony.messages(tok, ids[: ids.index(markers["<|end|>"]) - 1], markers)  # stopped inside the reasoning
    assert [(m.channel, m.complete) for m in cut] == [("analysis", False)] and harmony.answer(cut) is None
    assert harmony.marker_ids(load_tokenizer(harmony_base.parent, 10**6, hf=False)) is None  # bytes: no markers


@pytest.mark.parametrize("show", [False, True])
def test_chat_on_a_harmony_model_prints_the_final_channel(harmony_base, capsys, monkeypatch, show):
    """The model's raw output runs reasoning and answer together (the markers are special tokens, dropped when
    decoded); stdout is the final channel alone; --show-reasoning puts the analysis on stderr."""
    import dataclasses as dc

    import moekit.train.decoding as decoding

    tok = load_tokenizer(harmony_base, 10**6, hf=True)
    steered = tok.tok.encode(HARMONY_OUT, add_special_tokens=False).ids
    real = decoding.generate
    monkeypatch.setattr(decoding, "generate", lambda *a, **k: dc.replace(real(*a, **k), new_ids=steered))
    argv = [str(harmony_base), "--chat", "--prompt", "two plus two", "--device", "cpu", "--max-new-tokens", "2"]
    assert generate_main(argv + (["--show-reasoning"] if show else [])) == 0
    out, err = capsys.readouterr()
    assert out == "Four.\n"
    assert ("[analysis] Two and two make four." in err) == show
    cut = steered[: steered.index(tok.tok.token_to_id("<|end|>"))]  # no final answer yet
    monkeypatch.setattr(decoding, "generate", lambda *a, **k: dc.replace(real(*a, **k), new_ids=cut))
    assert generate_main(argv) == 0
    out, err = capsys.readouterr()
    assert out == "\n" and "wrote no final answer within --max-new-tokens 2 (only analysis)" in err
    assert generate_main([str(harmony_base), "--prompt", "x", "--show-reasoning"]) == 2
    assert "--show-reasoning prints a chat model's reasoning channels; add --chat" in capsys.readouterr().err


def test_chat_prompts_file_renders_each_record_as_one_chat(chat_base, tmp_path, capsys):
    """moekit-generate --chat --prompts: a {"prompt", "system"} record and the same turns as {"messages"} give the
    answer --chat --prompt gives; a three-turn conversation is answered from its rendered template (decoded here
    directly); "messages" without --chat, or beside "prompt", is one line."""
    from moekit.train.decoding import generate
    from moekit.train.inference import ChatTemplate, encode_rendered, load_for_inference

    folder = chat_folder(chat_base, tmp_path)
    assert generate_main([str(folder), *CHAT_ARGV, "--max-new-tokens", "6"]) == 0
    alone = capsys.readouterr().out[:-1]
    turns = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION},
             {"role": "assistant", "content": "four"}, {"role": "user", "content": "two plus four?"}]
    records = [{"prompt": QUESTION, "system": SYSTEM}, {"messages": turns[:2]}, {"messages": turns}]
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "out.jsonl"
    assert generate_main([str(folder), "--chat", "--prompts", str(tmp_path / "chats.jsonl"), "--output", str(out),
                          "--max-new-tokens", "6", "--device", "cpu"]) == 0
    assert "3 prompts" in capsys.readouterr().err
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows[0]["completion"] == rows[1]["completion"] == alone
    assert rows[0]["prompt"] == QUESTION and rows[2]["messages"] == turns
    model, tokenizer, _ = load_for_inference(folder, "cpu")
    ids = encode_rendered(tokenizer, ChatTemplate.load(folder).render(turns))
    want = generate(model, ids, 6, eos_ids=tuple(tokenizer.eos_ids))
    assert rows[2]["prompt_tokens"] == len(ids) and rows[2]["new_tokens"] == len(want.new_ids)
    for bad, words in (([str(folder), "--prompts"], '"messages" is a conversation for a chat model; add --chat'),
                       ([str(folder), "--chat", "--prompts"], 'give "messages"')):
        record = {"messages": turns[:2]} if "--chat" not in bad else {"messages": turns[:2], "prompt": "x"}
        (tmp_path / "bad.jsonl").write_text(json.dumps(record) + "\n")
        assert generate_main([*bad, str(tmp_path / "bad.jsonl"), "--device", "cpu"]) == 2
        err = capsys.readouterr().err.strip()
        assert words in err and len(err.splitlines()) == 1, err
