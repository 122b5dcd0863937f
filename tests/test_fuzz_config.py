"""Property-based fuzzing of tools/train.py's flags: any combination is a valid run (exit 0) or one clear
error line (exit 2), never a traceback or a hang. In-process ``moekit.train.loop.main(argv)``."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[1]
from moekit.train.loop import main

# values a user might type: valid, boundary, wrong type, non-finite
NUMBERS = st.sampled_from(["0", "1", "2", "-1", "3", "8", "0.5", "1e-3", "1e309", "-1e309", "nan", "inf", "none",
                           "true", "abc", "", "1.5", "99999999999999999999999"])
TEXT = st.sampled_from(["auto", "cpu", "cuda", "stop", "skip", "on", "off", "x", "", "topk", "float32", "bfloat16"])
FLAGS = {
    "--steps": NUMBERS, "--seed": NUMBERS, "--batch-size": NUMBERS, "--capacity-factor": NUMBERS,
    "--ep": NUMBERS, "--dp": NUMBERS, "--ranks-per-node": NUMBERS,
    "--router": st.sampled_from(["topk", "switch", "expert_choice", "sinkhorn", "hash", "nope", "a:b"]),
    "--preset": st.sampled_from(["mixtral-tiny", "switch-tiny", "deepseek-tiny", "gpt"]),
    "--train.lr": NUMBERS, "--train.micro_batch_size": NUMBERS, "--train.seq_len": NUMBERS,
    "--train.warmup_steps": NUMBERS, "--train.grad_clip": NUMBERS, "--train.beta1": NUMBERS,
    "--train.min_lr_ratio": NUMBERS, "--train.on_nonfinite": TEXT, "--train.dtype": TEXT, "--train.device": TEXT,
    "--train.deterministic": TEXT, "--train.decay_fraction": NUMBERS, "--train.export_hf_fp8": TEXT,
    "--train.lr_schedule": st.sampled_from(["cosine", "linear", "constant", "wsd", "step", ""]),
    "--train.wsd_decay": st.sampled_from(["linear", "sqrt", "cosine", "exp"]), "--model.partial_rotary_factor": NUMBERS,
    "--model.hidden_size": NUMBERS, "--model.num_experts": NUMBERS, "--model.top_k": NUMBERS,
    "--model.num_layers": NUMBERS, "--model.num_heads": NUMBERS, "--model.vocab_size": NUMBERS,
    "--model.aux_loss_coeff": NUMBERS, "--model.router_options.force_expert": NUMBERS,
    "--model.router_options.jitter": NUMBERS,
    "--data.val_fraction": NUMBERS, "--eval.every": NUMBERS, "--eval.sequences": NUMBERS, "--log.every": NUMBERS,
    "--checkpoint.every": NUMBERS, "--checkpoint.keep": NUMBERS, "--layout.timeout_s": NUMBERS,
    "--layout.hierarchical": TEXT, "--log.progress": TEXT,
}
ARGV = st.dictionaries(st.sampled_from(sorted(FLAGS)), st.just(None), max_size=4).flatmap(
    lambda keys: st.tuples(*[FLAGS[k].map(lambda v, k=k: [k, v]) for k in keys]))


def _check(rc: int, err: str) -> None:
    assert "Traceback" not in err, err
    assert rc in (0, 2), (rc, err)
    if rc == 2:
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("train.py: error: "), err


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ARGV)
@example([["--seed", "99999999999999999999999"]])  # found by this test: torch.manual_seed overflowed
@example([["--model.vocab_size", "99999999999999999999999"]])  # found by this test: int64 sizes overflowed
def test_print_config_is_a_config_or_one_error_line(capsys, monkeypatch, pairs):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    argv = [x for pair in pairs for x in pair]
    rc = main([*argv, "--print-config"])
    _check(rc, capsys.readouterr().err)


TINY = ("--model.hidden_size 16 --model.num_layers 1 --model.num_heads 2 --model.num_kv_heads 1 "
        "--model.ffn_hidden_size 16 --model.moe_ffn_hidden_size 16 --model.max_seq_len 16 --train.seq_len 8 "
        "--batch-size 2 --eval.sequences 2 --log.tensorboard false --log.progress off --checkpoint.every 0").split()
RUN_FLAGS = ["--capacity-factor", "--train.on_nonfinite", "--train.deterministic", "--router",
             "--model.router_options.force_expert", "--train.micro_batch_size", "--model.top_k", "--eval.every"]


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.dictionaries(st.sampled_from(RUN_FLAGS), st.just(None), max_size=3).flatmap(
    lambda keys: st.tuples(*[FLAGS[k].map(lambda v, k=k: [k, v]) for k in keys])))
def test_tiny_runs_train_or_fail_with_one_line(tmp_path_factory, capsys, monkeypatch, pairs):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    argv = [x for pair in pairs for x in pair]
    rc = main([*TINY, *argv, "--steps", "1", "--run-dir", str(tmp_path_factory.mktemp("fuzz"))])
    _check(rc, capsys.readouterr().err)


@pytest.mark.parametrize("value", ["nan", "inf", "0", "-1"])
def test_collective_timeout_must_be_a_positive_finite_time(capsys, monkeypatch, value):
    """Found by fuzzing: nan / inf passed the check and crashed in timedelta() under torchrun."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(["--layout.timeout_s", value, "--print-config"]) == 2
    _check(2, capsys.readouterr().err)
