"""tools/train.py: records, learning, bitwise resume, non-finite stop, config resolution, bad input.

Runs call ``moekit.train.loop.main(argv)`` in-process with a tiny model (seconds each); a few cases run
``python tools/train.py`` in a subprocess to check the real exit code and that no traceback leaks.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
from moekit.train import checkpoint
from moekit.train.data import split_windows, unigram_entropy
from moekit.train.tokens import embedded_corpus, write_token_file
from moekit.train.loop import main
from moekit.train.records import load_rows
from tests.helpers import one_stderr_line

TINY = ("--model.hidden_size 32 --model.num_layers 2 --model.num_heads 2 --model.num_kv_heads 1 "
        "--model.ffn_hidden_size 64 --model.moe_ffn_hidden_size 32 --model.max_seq_len 32 --train.seq_len 32 "
        "--batch-size 4 --eval.sequences 8 --eval.every 0 --log.tensorboard false --log.every 1000").split()


def train(run_dir: Path, *flags: str) -> Path:
    rc = main([*TINY, "--run-dir", str(run_dir), *flags])
    assert rc == 0
    return run_dir


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def load_lines(run_dir: Path) -> list[dict]:
    return load_rows(run_dir)  # expert_load.bin (or an older run's expert_load.jsonl), as JSONL objects


# ---------------------------------------------------------------------------------------------------
# Records
# ---------------------------------------------------------------------------------------------------


def test_records_and_checkpoint_rotation(tmp_path, capsys):
    run = train(tmp_path / "r", "--steps", "4", "--checkpoint.every", "2", "--checkpoint.keep", "1",
                "--log.every", "2", "--eval.every", "2")
    rows = metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert {"step", "loss", "aux_loss", "tokens_per_s", "lr", "grad_norm", "mem_gb", "imbalance"} <= set(r)
        assert np.isfinite(r["loss"]) and r["aux_loss"] > 0 and r["tokens_per_s"] > 0
    assert "val_loss" in rows[1] and "val_loss" in rows[3] and "val_loss" not in rows[0]
    assert rows[0]["lr"] < rows[1]["lr"]  # warmup
    head, *steps = load_lines(run)
    assert head["format"] == "moekit-expert-load" and head["num_experts"] == 8 and len(head["layers"]) == 2
    assert [s["step"] for s in steps] == [1, 2, 3, 4]
    for s in steps:  # dropless top-2: every token's two slots are counted once per layer
        assert [sum(layer) for layer in s["tokens"]] == [4 * 32 * 2] * 2
        assert s["tokens"] == s["assigned"] and s["dropped"] == [0, 0]
    assert [p.name for p in checkpoint.list_checkpoints(run)] == ["step_000004"]
    out = capsys.readouterr().out
    assert "step=2 loss=" in out and "step=4 loss=" in out and "step=3 loss=" not in out
    assert json.loads((run / "config.json").read_text())["train"]["steps"] == 4


def test_capacity_drops_are_recorded(tmp_path):
    run = train(tmp_path / "r", "--preset", "switch-tiny", "--model.num_layers", "2", "--model.num_kv_heads", "2",
                "--capacity-factor", "0.5", "--steps", "2", "--checkpoint.every", "0")
    head, *steps = load_lines(run)
    assert head["router"] == "switch" and len(head["layers"]) == 1  # switch: MoE every other layer
    for s in steps:
        kept, assigned = sum(s["tokens"][0]), sum(s["assigned"][0])
        assert assigned == 4 * 32 and s["dropped"][0] == assigned - kept >= assigned // 2
    assert metrics(run)[-1]["dropped_fraction"] >= 0.5


def test_a_fresh_run_never_silently_deletes_an_earlier_one(tmp_path, capsys):
    """A fresh run into a run directory holding checkpoints or metrics is refused before any work (the earlier
    run stays whole); --overwrite deletes it and starts over; --overwrite with --resume is refused."""
    run = train(tmp_path / "r", "--steps", "2", "--checkpoint.every", "1")
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    capsys.readouterr()
    assert main([*TINY, "--run-dir", str(run), "--steps", "1"]) == 2
    one_stderr_line(capsys, f"--run-dir {run} holds an earlier run (2 checkpoints, the newest at step 2; metrics",
                    "--resume continues it", "--overwrite deletes it")
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before and len(metrics(run)) == 2
    assert main([*TINY, "--run-dir", str(run), "--overwrite", "--resume"]) == 2
    one_stderr_line(capsys, "--overwrite and --resume:", "give one of them")
    (run / "expert_load.png").write_bytes(b"a heatmap of the earlier run")
    train(run, "--steps", "1", "--checkpoint.every", "0", "--overwrite")
    assert len(metrics(run)) == 1 and not (run / "checkpoints").exists()
    assert not (run / "expert_load.png").exists()  # drawn from the deleted records: it would pass for this run's
    assert "deleting the records and checkpoints there" in capsys.readouterr().out
    for mode in (["--dry-run"], ["--print-config"]):  # they write no run: --overwrite would do nothing
        assert main([*TINY, "--run-dir", str(run), "--overwrite", *mode]) == 2
        one_stderr_line(capsys, f"--overwrite with {mode[0]}: {mode[0]} writes no run")
    # metrics alone (no checkpoint) are an earlier run too; an empty folder is not
    assert main([*TINY, "--run-dir", str(run), "--steps", "1"]) == 2
    one_stderr_line(capsys, "holds an earlier run (metrics in metrics.jsonl)")
    train(tmp_path / "empty", "--steps", "1", "--checkpoint.every", "0")


def test_resume_auto_without_a_checkpoint_keeps_the_earlier_records(tmp_path, capsys):
    """--resume auto in a run directory whose earlier attempt wrote metrics but no checkpoint (it crashed before
    its first save): the new attempt starts at step 0, and the earlier records are moved to previous/N (N counting
    up, never overwritten) with one warning line naming the folder, instead of being deleted."""
    run = train(tmp_path / "r", "--steps", "2", "--checkpoint.every", "0")
    (run / "expert_load.png").write_bytes(b"a heatmap of the first attempt")
    first = {n: (run / n).read_bytes() for n in ("metrics.jsonl", "expert_load.bin", "config.json", "expert_load.png")}
    first_load = load_lines(run)
    capsys.readouterr()
    train(run, "--steps", "1", "--checkpoint.every", "0", "--resume", "auto")
    warning = one_stderr_line(capsys, "warning: --resume auto: no checkpoint in", "starts at step 0",
                              "metrics.jsonl", "2 metrics lines", f"moved to {run / 'previous' / '1'}, not deleted")
    kept = run / "previous" / "1"
    assert {n: (kept / n).read_bytes() for n in first} == first, warning  # byte for byte
    assert load_lines(kept) == first_load  # previous/1 is itself a run directory the readers open
    assert [r["step"] for r in metrics(run)] == [1] and not (run / "expert_load.png").exists()
    # a second restart without a checkpoint: previous/2, and previous/1 stays as it was
    train(run, "--steps", "1", "--checkpoint.every", "0", "--resume", "auto")
    one_stderr_line(capsys, f"moved to {run / 'previous' / '2'}", "1 metrics line)")
    assert {n: (kept / n).read_bytes() for n in first} == first
    assert len(metrics(run / "previous" / "2")) == 1 and len(metrics(run)) == 1
    # an empty run directory (nothing to keep): no warning, no previous/
    train(tmp_path / "empty", "--steps", "1", "--checkpoint.every", "0", "--resume", "auto")
    assert capsys.readouterr().err == "" and not (tmp_path / "empty" / "previous").exists()


def test_a_model_folder_is_never_taken_for_a_run_directory(tmp_path, capsys):
    """A HuggingFace folder (config.json with a model_type, safetensors) given as --run-dir is refused, even with
    --overwrite, and keeps every file; so is --run-dir equal to --init-from-hf."""
    hf = tmp_path / "hf"
    hf.mkdir()
    files = {"config.json": b'{"model_type": "mixtral"}', "model.safetensors": b"weights", "tokenizer.json": b"{}"}
    for name, data in files.items():
        (hf / name).write_bytes(data)
    for extra in ([], ["--overwrite"]):
        assert main([*TINY, "--run-dir", str(hf), "--steps", "1", *extra]) == 2
        one_stderr_line(capsys, f"--run-dir {hf} is not a moekit run directory: it holds a config.json that is not a "
                                f"moekit run's (a HuggingFace 'mixtral' model) and model weights (model.safetensors)")
    assert {p.name: p.read_bytes() for p in hf.iterdir()} == files  # not even a .lock left behind
    assert main([*TINY, "--run-dir", str(hf), "--init-from-hf", str(hf)]) == 2
    one_stderr_line(capsys, f"--run-dir {hf} is the --init-from-hf folder")
    # and the other way round: a moekit run directory or checkpoint (its config.json is the run's) given as
    # --init-from-hf is named as what it is, with the flags that use it
    run = tmp_path / "run"
    assert main([*TINY, "--run-dir", str(run), "--steps", "1"]) == 0
    capsys.readouterr()
    for source in (run, next((run / "checkpoints").iterdir())):
        assert main([*TINY, "--run-dir", str(tmp_path / "new"), "--init-from-hf", str(source)]) == 2
        one_stderr_line(capsys, f"--init-from-hf {source}: a moekit-train run directory or checkpoint, not a "
                                f"HuggingFace folder; continue it with --resume", f"moekit-to-hf {source} OUT")


# ---------------------------------------------------------------------------------------------------
# Learning, resume, accumulation, non-finite loss
# ---------------------------------------------------------------------------------------------------


def test_learns_below_unigram_entropy(tmp_path):
    """The validation loss must beat the best context-free model of the same data by a clear margin."""
    flags = ["--model.hidden_size", "64", "--model.moe_ffn_hidden_size", "128", "--train.seq_len", "128",
             "--model.max_seq_len", "128", "--batch-size", "16", "--steps", "60", "--train.lr", "1e-2",
             "--train.warmup_steps", "5", "--eval.sequences", "64", "--checkpoint.every", "0"]
    run = train(tmp_path / "learn", *flags)
    tokens, _ = embedded_corpus()
    split = split_windows(tokens, 128, 0.05)
    val = np.concatenate([tokens[s : s + 129] for s in split.val_starts])
    entropy = unigram_entropy(val, 256)  # nats: the loss of predicting each byte by its frequency alone
    rows = metrics(run)
    assert rows[-1]["val_loss"] < entropy - 0.25, (rows[-1]["val_loss"], entropy)
    assert rows[-1]["loss"] < rows[0]["loss"] - 2.0


@pytest.mark.parametrize("preset,extra", [
    ("deepseek-tiny", ["--model.num_experts", "8", "--train.micro_batch_size", "2"]),  # bias state, accumulation
    ("switch-tiny", ["--model.num_kv_heads", "2"]),  # jitter draws from the global RNG; capacity drops
])
def test_resume_is_bitwise(tmp_path, preset, extra):
    flags = ["--preset", preset, *extra, "--steps", "8", "--checkpoint.every", "4"]
    straight = train(tmp_path / "straight", *flags)
    resumed = tmp_path / "resumed"
    shutil.copytree(straight, resumed)  # an interrupted run: records past step 4, checkpoint 4 the newest
    shutil.rmtree(resumed / "checkpoints" / "step_000008")
    train(resumed, *flags, "--resume")
    a, b = metrics(straight), metrics(resumed)
    assert [r["step"] for r in b] == list(range(1, 9))
    assert [r["loss"] for r in a] == [r["loss"] for r in b]  # bitwise: float equality
    assert [r["grad_norm"] for r in a] == [r["grad_norm"] for r in b]
    assert load_lines(straight) == load_lines(resumed)  # routing (biases, jitter) identical too
    # deepseek-tiny balances per sequence: its records carry the per-sequence imbalance (1 = even, E = one expert)
    seq = [r.get("sequence_imbalance") for r in a]
    if preset == "deepseek-tiny":
        assert all(v is not None and 1.0 <= v <= 8.0 for v in seq), seq
    else:
        assert seq == [None] * len(a)


def test_grad_accumulation_matches_full_batch(tmp_path):
    flags = ["--steps", "3", "--model.aux_loss_coeff", "0", "--checkpoint.every", "0", "--batch-size", "8"]
    full = metrics(train(tmp_path / "full", *flags))
    accum = metrics(train(tmp_path / "accum", *flags, "--train.micro_batch_size", "2"))
    np.testing.assert_allclose([r["loss"] for r in accum], [r["loss"] for r in full], rtol=2e-6)
    np.testing.assert_allclose([r["grad_norm"] for r in accum], [r["grad_norm"] for r in full], rtol=1e-4)


def test_nonfinite_loss_stops_before_the_step(tmp_path, monkeypatch, capsys):
    from moekit.models import transformer

    calls = {"n": 0}

    def poisoned(real):
        def loss_fn(*args, **kwargs):
            calls["n"] += 1
            loss = real(*args, **kwargs)
            return loss * float("nan") if calls["n"] == 5 else loss
        return loss_fn

    # the trainer's loss: the chunked one from hidden states, or cross-entropy of logits where that does not apply
    monkeypatch.setattr(transformer, "chunked_lm_loss", poisoned(transformer.chunked_lm_loss))
    monkeypatch.setattr(torch.nn.functional, "cross_entropy", poisoned(torch.nn.functional.cross_entropy))
    run = tmp_path / "r"
    rc = main([*TINY, "--run-dir", str(run), "--steps", "6", "--checkpoint.every", "2"])
    err = capsys.readouterr().err
    assert rc == 1
    assert "non-finite loss (nan) at step 5" in err and "step_000004" in err and len(err.strip().splitlines()) == 1
    assert [r["step"] for r in metrics(run)] == [1, 2, 3, 4]
    good = checkpoint.list_checkpoints(run)
    assert [p.name for p in good] == ["step_000002", "step_000004"]
    assert checkpoint.read_meta(good[-1])["step"] == 4  # sizes and checksums still match


def test_token_file_trains_like_the_embedded_corpus(tmp_path):
    data = tmp_path / "corpus.bin"
    assert main(["--write-data", str(data)]) == 0
    a = metrics(train(tmp_path / "a", "--steps", "2", "--checkpoint.every", "0"))
    b = metrics(train(tmp_path / "b", "--steps", "2", "--checkpoint.every", "0", "--data.path", str(data)))
    assert [r["loss"] for r in a] == [r["loss"] for r in b]


def test_init_from_hf_starts_from_those_weights(tmp_path):
    pytest.importorskip("safetensors")
    from moekit.models.hf import save_mixtral
    from moekit.models.transformer import build_model
    from moekit.train.cli import parse_args
    from moekit.train.data import Sampler, gather

    flags = [*TINY, "--model.ffn_hidden_size", "32", "--steps", "1", "--checkpoint.every", "0"]
    cfg, _ = parse_args(flags)
    source = build_model(cfg.model, seed=5)  # not the run's seed: the weights must come from the folder
    save_mixtral(source, tmp_path / "hf")
    rows = metrics(train(tmp_path / "run", *flags[len(TINY):], "--init-from-hf", str(tmp_path / "hf")))
    split = split_windows(embedded_corpus()[0], 32, 0.05)
    x, y = gather(split.tokens, Sampler(split.train_starts, 0).next(4), 32)  # the run's first batch
    with torch.no_grad():
        expected = torch.nn.functional.cross_entropy(source(x).flatten(0, 1), y.flatten()).item()
    assert rows[0]["loss"] == pytest.approx(expected, rel=1e-6)


# ---------------------------------------------------------------------------------------------------
# Config resolution
# ---------------------------------------------------------------------------------------------------


def test_print_config_round_trips_and_precedence(tmp_path, capsys):
    assert main(["--preset", "switch-tiny", "--steps", "9", "--capacity-factor", "none", "--print-config"]) == 0
    printed = capsys.readouterr().out
    assert 'preset = "switch-tiny"' in printed and "steps = 9" in printed and 'capacity_factor = "none"' in printed
    cfg = tmp_path / "c.toml"
    cfg.write_text(printed)
    assert main(["--config", str(cfg), "--print-config"]) == 0
    assert capsys.readouterr().out == printed
    cfg.write_text('preset = "deepseek-tiny"\n[train]\nsteps = 7\nlr = 0.002\n')
    assert main(["--config", str(cfg), "--steps", "11", "--print-config"]) == 0  # flags beat the file
    out = capsys.readouterr().out
    assert 'preset = "deepseek-tiny"' in out and "steps = 11" in out and "lr = 0.002" in out


def test_router_flag_starts_from_the_routers_own_options(capsys):
    assert main(["--preset", "switch-tiny", "--router", "topk", "--model.router_options.normalize", "false",
                 "--print-config"]) == 0
    out = capsys.readouterr().out
    assert 'router = "topk"' in out and "router_options = {normalize = false}" in out  # jitter is gone


# ---------------------------------------------------------------------------------------------------
# Bad input: exit 2, one line on stderr, nothing done (in-process; the subprocess tests check wiring)
# ---------------------------------------------------------------------------------------------------

BAD = [
    (["--preset", "gpt-9"], "unknown preset 'gpt-9'; presets: mixtral-tiny, switch-tiny, deepseek-tiny"),
    (["--steps", "0"], "--train.steps=0 is invalid"),
    (["--steps", "-5"], "--train.steps=-5 is invalid"),
    (["--steps", "ten"], "--steps: expected an integer, got 'ten'"),
    (["--batch-size", "0"], "--train.batch_size=0 is invalid"),
    (["--train.lr", "0"], "--train.lr=0.0 is invalid"),
    (["--train.lr", "-1e-3"], "--train.lr=-0.001 is invalid"),
    (["--capacity-factor", "-1"], "--capacity-factor=-1.0 is invalid"),
    (["--router", "nope"], "unknown router 'nope'"),
    (["--router", "no.such.module:Router"], "could not be loaded"),
    (["--ep", "2"], "layout --dp 1 --ep 2"),
    (["--dp", "2"], "needs dp*fsdp*tp*pp = 2 processes but the world size is 1"),
    (["--tp", "0"], "--tp=0 is invalid"),
    (["--model.nope", "1"], "ModelConfig has no field 'nope'"),
    (["--nonsense"], "unrecognized argument '--nonsense'"),
    (["--model.router_options.jitter", "0.5"], "jitter"),  # a switch option on the topk router
    (["--batch-size", "6", "--train.micro_batch_size", "4"], "whole micro-batches of 4"),
    (["--preset", "mixtral-8x7b"], "(46.7B parameters): a rank needs"),
    (["--train.seq_len", "512"], "exceeds model.max_seq_len=256"),
]


def _assert_one_line_error(rc: int, err: str, expected: str) -> None:
    lines = err.strip().splitlines()
    assert rc == 2, err
    assert len(lines) == 1 and lines[0].startswith("train.py: error: "), err
    assert expected in lines[0], lines[0]


@pytest.mark.parametrize("argv,expected", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_flags(tmp_path, capsys, argv, expected):
    run = tmp_path / "run"
    rc = main([*argv, "--run-dir", str(run)])
    _assert_one_line_error(rc, capsys.readouterr().err, expected)
    assert not run.exists()  # failed before any work


def test_bad_data_files(tmp_path, capsys):
    bad_header = tmp_path / "bad.bin"
    bad_header.write_bytes(b"GARBAGE!" + bytes(100))
    big_ids = tmp_path / "ids.bin"
    write_token_file(str(big_ids), np.full(100, 300), 512)
    cases = [(["--data.path", str(bad_header)], f"data file {bad_header}: bad magic"),
             (["--data.path", str(big_ids)], "vocab_size 512 exceeds the model's vocab_size 256"),
             (["--data.path", str(big_ids), "--model.vocab_size", "300"],
              "vocab_size 512 exceeds the model's vocab_size 300")]
    for argv, expected in cases:
        _assert_one_line_error(main([*TINY, *argv, "--run-dir", str(tmp_path / "r")]), capsys.readouterr().err, expected)
    # ids beyond the header's vocab: the file claims vocab 256 but holds 300
    raw = tmp_path / "lying.bin"
    write_token_file(str(raw), np.full(100, 1), 256)
    body = bytearray(raw.read_bytes())
    body[32 + 2 * 50 : 32 + 2 * 51] = (300).to_bytes(2, "little")
    raw.write_bytes(bytes(body))
    rc = main([*TINY, "--data.path", str(raw), "--run-dir", str(tmp_path / "r")])
    _assert_one_line_error(rc, capsys.readouterr().err, "token id 300 at position 50 is >= vocab_size 256")
    # a raw file without metadata: the ids are checked against the model's vocab_size, before any work
    headerless = tmp_path / "headerless.bin"
    np.array([1, 2, 3, 300] * 2000, dtype=np.uint16).tofile(headerless)
    rc = main([*TINY, "--data.path", str(headerless), "--run-dir", str(tmp_path / "r")])
    _assert_one_line_error(rc, capsys.readouterr().err, "token id 300 at position 3 is >= vocab_size 256 (the "
                           "largest id is 300); set --model.vocab_size 301 (or more)")
    assert not (tmp_path / "r").exists()


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    return train(tmp_path_factory.mktemp("saved") / "run", "--steps", "2", "--checkpoint.every", "2")


def test_bad_checkpoints(saved_run, tmp_path, capsys):
    def resume(run: Path, *extra: str) -> tuple[int, str]:
        rc = main([*TINY, "--steps", "4", "--run-dir", str(run), "--resume", *extra])
        return rc, capsys.readouterr().err

    run = tmp_path / "copy"
    shutil.copytree(saved_run, run)
    ckpt = run / "checkpoints" / "step_000002"
    rc = main([*TINY, "--steps", "2", "--run-dir", str(run), "--resume"])  # finished already (a retried job)
    out = capsys.readouterr().out
    assert rc == 0 and "nothing to train: the checkpoint is at step 2 and --steps is 2" in out, out
    rc, err = resume(run)
    assert rc == 0, err  # the intact copy resumes
    shutil.rmtree(run)
    shutil.copytree(saved_run, run)
    _assert_one_line_error(*resume(run, "--model.hidden_size", "64"),
                           "saved for a different model: hidden_size=32 (checkpoint) vs 64 (this run)")
    data = ckpt / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:1000])
    _assert_one_line_error(*resume(run), f"checkpoint {data}: 1000 bytes, saved with")
    (ckpt / "meta.json").write_text("{not json")
    _assert_one_line_error(*resume(run), f"checkpoint {ckpt / 'meta.json'}: corrupt")
    _assert_one_line_error(*resume(tmp_path / "empty"), "no checkpoint in")


def test_world_size_without_torchrun_is_refused(monkeypatch, capsys):
    """WORLD_SIZE alone (no torchrun rendezvous variables) fails with the launch to use, before any work."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    for var in ("MASTER_ADDR", "MASTER_PORT", "RANK"):
        monkeypatch.delenv(var, raising=False)
    _assert_one_line_error(main(["--steps", "1"]), capsys.readouterr().err,
                           "launch several ranks with torchrun --nproc-per-node 4")


def _script(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run([sys.executable, str(ROOT / "tools" / "train.py"), *argv], capture_output=True, text=True,
                          env=env, timeout=120)


@pytest.mark.parametrize("argv,env,expected", [
    (["--preset", "nope"], None, "unknown preset 'nope'; presets: mixtral-tiny"),
    (["--capacity-factor", "-2"], None, "--capacity-factor=-2.0 is invalid"),
    ([], {"WORLD_SIZE": "2"}, "WORLD_SIZE=2 but MASTER_ADDR, MASTER_PORT, RANK unset: launch several ranks with torchrun"),
])
def test_script_exit_code_and_no_traceback(argv, env, expected):
    proc = _script(*argv, env=env)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    _assert_one_line_error(proc.returncode, proc.stderr, expected)


# Every program: (module, a flag its parser refuses, what its one-line error says).
PROGRAMS = [("loop", ["--preset", "nope"], "unknown preset 'nope'"),
            ("heatmap", ["--nope"], "unrecognized arguments: --nope"),
            ("convert", ["moekit-to-hf", "a", "b", "--family", "gpt2"], "argument --family: invalid choice: 'gpt2'"),
            ("generate", ["run", "--prompt", "x", "--top-p", "2"], "--top-p 2.0 is invalid"),
            ("evaluate", ["run", "--split", "test"], "argument --split: invalid choice: 'test'"),
            ("prepare", ["in.txt", "-o", "out", "--tokenizer", "bytes", "--nope"], "unrecognized arguments: --nope"),
            ("sweep", ["--nope"], "unrecognized arguments: --nope"),
            ("placement", ["--nope"], "the following arguments are required: run_dir"),
            ("launch", ["slurm", "--nodes", "0", "--gpus-per-node", "1", "--time", "60", "--", "--ep", "2"],
             "--nodes 0: must be at least 1")]


def test_help_and_flag_errors_answer_before_torch_is_imported():
    """The programs' entries import no torch: --help and a flag refused by their cheap checks print from the flags
    alone, in a fraction of a second; torch loads for a run or a model check. Each error is one line, status 2."""
    probe = ("import sys, contextlib, importlib, io, json\nresults = {}\n"
             f"for name, bad, _ in {[(n, b, '') for n, b, _ in PROGRAMS]!r}:\n"
             "    main = importlib.import_module(f'moekit.train.{name}').main\n"
             "    out, err = io.StringIO(), io.StringIO()\n"
             "    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit): main(['--help'])\n"
             "    with contextlib.redirect_stderr(err): code = main(bad)\n"
             "    results[name] = [code, 'usage:' in out.getvalue(), err.getvalue()]\n"
             "print(json.dumps({'torch': 'torch' in sys.modules, 'results': results}))")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.splitlines()[-1])
    for name, _, message in PROGRAMS:
        code, usage, err = got["results"][name]
        assert (code, usage) == (2, True), (name, code, usage, err)
        assert len(err.strip().splitlines()) == 1 and "error:" in err and message in err, (name, err)
    assert not got["torch"], "a program imported torch for --help or a flag error"


def test_script_corrupt_checkpoint(saved_run, tmp_path):
    run = tmp_path / "c"
    shutil.copytree(saved_run, run)
    (run / "checkpoints" / "step_000002" / ".metadata").write_bytes(b"garbage")
    proc = _script(*TINY, "--run-dir", str(run), "--resume")
    assert "Traceback" not in proc.stderr
    _assert_one_line_error(proc.returncode, proc.stderr, ".metadata: 7 bytes, saved with")


def test_peak_flops_table_picks_the_longest_matching_name():
    from moekit.train.monitor import peak_for_name

    assert peak_for_name("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_for_name("NVIDIA H100 NVL") == 835e12
    assert peak_for_name("NVIDIA H100 PCIe") == 756e12
    assert peak_for_name("NVIDIA L40") == 181e12 and peak_for_name("NVIDIA L40S") == 362e12
    assert peak_for_name("NVIDIA GH200 480GB") == 989e12 and peak_for_name("Some CPU") is None


def test_an_export_without_a_tokenizer_is_refused_before_training(tmp_path, capsys):
    """Raw token ids (no metadata) name no tokenizer: --export-hf would end the run without one, so it is refused
    before the first step, naming the ways out."""
    ids = tmp_path / "ids.npy"
    np.save(ids, np.random.default_rng(0).integers(0, 256, 20_000).astype(np.uint16))
    run = tmp_path / "r"
    rc = main([*TINY, "--run-dir", str(run), "--data.path", str(ids), "--steps", "1", "--export-hf",
               str(tmp_path / "hf")])
    assert rc == 2
    one_stderr_line(capsys, f"--export-hf {tmp_path / 'hf'}: the data", "carry no tokenizer metadata",
                    "moekit-convert moekit-to-hf RUN_DIR OUT --tokenizer DIR")
    assert not (run / "metrics.jsonl").exists() and not (tmp_path / "hf").exists()
