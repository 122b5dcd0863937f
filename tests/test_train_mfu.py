"""The training-MFU benchmark: a CPU smoke run through the real trainer, its arithmetic, and the 1B preset."""
import json
import os
from pathlib import Path

import pytest
import torch
from moekit.bench import train_mfu

from moekit.models.config import preset
from moekit.models.stats import model_stats

RESULT_KEYS = {"config", "compile", "expert_backend", "status", "steps_timed", "tokens_per_step", "tokens_per_s",
               "step_ms_median", "tflops", "mfu", "mfu_palm", "flops_per_token", "peak_tflops", "peak_mem_gib",
               "warmup_s", "warmup_overhead_s", "trainer_mfu_median", "loss_first", "loss_last"}


def test_smoke_run_reports_consistent_mfu(tmp_path):
    out, runs = tmp_path / "r.json", tmp_path / "runs"
    peak_tflops = 0.05  # CPU has no listed peak: give one so MFU is computed and can be checked
    assert train_mfu.main(["--smoke", "--out", str(out), "--run-root", str(runs), "--peak-tflops",
                           str(peak_tflops)]) == 0
    data = json.loads(out.read_text())
    assert data["benchmark"] == "train_mfu" and data["partial"] is False and data["target_mfu"] == 0.45
    assert {"model", "workload", "environment", "peak_tflops"} <= set(data)
    (row,) = data["results"]
    assert RESULT_KEYS <= set(row) and row["status"] == "ok"
    assert row["compile"] is False and row["expert_backend"] == "loop"  # auto on CPU
    # the FLOPs per token are the trainer's: model_stats at the run's sequence length
    w = data["workload"]
    assert row["flops_per_token"] == model_stats(preset("mixtral-tiny"), w["seq_len"]).train_flops_per_token
    assert row["steps_timed"] == w["steps"] - w["warmup"] and row["tokens_per_step"] == w["batch_size"] * w["seq_len"]
    # MFU = tokens/s * FLOPs per token / peak; TFLOP/s the same without the peak
    assert row["mfu"] == pytest.approx(row["tokens_per_s"] * row["flops_per_token"] / (peak_tflops * 1e12), rel=1e-9)
    assert row["tflops"] == pytest.approx(row["mfu"] * peak_tflops, rel=1e-9)
    assert row["mfu_palm"] > row["mfu"]  # PaLM's attention term has no causal halving
    # throughput over the timed window includes the gaps between steps, so no faster than the fastest step
    assert 1e3 * row["tokens_per_step"] / row["tokens_per_s"] >= 0.99 * row["step_ms_min"]
    records = [json.loads(ln) for ln in (Path(row["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == w["steps"] and all(r["mfu"] is None for r in records)  # the trainer: no CPU peak


def _records(step_s: list[float], tokens: int) -> list[dict]:
    elapsed, out = 0.0, []
    for i, dt in enumerate(step_s, 1):
        elapsed += dt + 0.01  # 10 ms of records between steps: part of the timed window, not of a step
        out.append({"step": i, "loss": 5.0 - i, "tokens_per_s": tokens / dt, "elapsed_s": elapsed, "mem_gb": 1.0 + i,
                    "mfu": 0.4})
    return out


def test_summarize_leaves_out_warmup():
    # two warm-up steps of 10 s and 3 s (compile, autotune), then steady 1 s steps
    s = train_mfu.summarize(_records([10.0, 3.0, 1.0, 1.0, 1.0, 1.0], 1000), warmup=2, tokens_per_step=1000)
    assert s["steps_timed"] == 4 and s["step_ms_median"] == pytest.approx(1000.0)
    assert s["tokens_per_s"] == pytest.approx(4000 / 4.04)  # gaps count
    assert s["warmup_s"] == pytest.approx(13.02) and s["warmup_overhead_s"] == pytest.approx(13.02 - 2 * 1.01)
    assert s["peak_mem_gib"] == 7.0 and s["trainer_mfu_median"] == 0.4 and s["loss_last"] == -1.0
    with pytest.raises(ValueError, match="need warmup"):
        train_mfu.summarize(_records([1.0, 1.0], 1000), warmup=1, tokens_per_step=1000)
    bad = _records([1.0, 1.0, 1.0, 1.0], 1000) + [{"step": 5, "skipped": True}]
    with pytest.raises(ValueError, match="non-finite"):
        train_mfu.summarize(bad, warmup=1, tokens_per_step=1000)


def test_tma_configurations_set_the_variable_explicitly(monkeypatch, tmp_path):
    """--tma off on auto: one configuration each, named for it, with MOEKIT_TMA=never / always / auto in the
    trainer's environment whatever the caller's (a stray MOEKIT_TMA must not turn 'off' into on)."""
    seen = []

    def fake_trainer(argv, run_dir, timeout, env):
        seen.append((run_dir.name, env["MOEKIT_TMA"]))
        return 1, 0.0, "stopped by the test"

    monkeypatch.setattr(train_mfu, "run_trainer", fake_trainer)
    monkeypatch.setenv("MOEKIT_TMA", "always")
    args, extra = train_mfu.parse_args(["--smoke", "--tma", "off", "on", "auto", "--compile", "off", "on"])
    rows = [train_mfu.run_config(args, extra, c == "on", "auto", tmp_path, tma=t)
            for c in args.compile for t in args.tma]
    assert seen == [("auto-compile-off-notma", "never"), ("auto-compile-off-tma", "always"),
                    ("auto-compile-off", "auto"), ("auto-compile-on-notma", "never"),
                    ("auto-compile-on-tma", "always"), ("auto-compile-on", "auto")]
    assert [r["tma"] for r in rows] == ["off", "on", "auto"] * 2 and {r["status"] for r in rows} == {"failed"}
    assert train_mfu.parse_args(["--smoke"])[0].tma == ["auto"]


def test_variants_run_with_their_environment(monkeypatch, tmp_path, capsys):
    """--variants: each label a configuration of its own with its variables set in the trainer's environment (and
    only there); one variant keeps the plain names. Bad specs are one line, exit 2."""
    seen = []

    def fake_trainer(argv, run_dir, timeout, env):
        flag = argv[argv.index("--train.residual_dtype") + 1] if "--train.residual_dtype" in argv else None
        seen.append((run_dir.name, env.get("MOEKIT_LM_LOSS"), env.get("MOEKIT_SPLIT_ROUTER"), flag))
        return 1, 0.0, "stopped by the test"

    monkeypatch.setattr(train_mfu, "run_trainer", fake_trainer)
    monkeypatch.delenv("MOEKIT_LM_LOSS", raising=False)
    monkeypatch.delenv("MOEKIT_SPLIT_ROUTER", raising=False)
    args, extra = train_mfu.parse_args(["--smoke", "--variants", "base", "legacy:MOEKIT_LM_LOSS=never,"
                                        "MOEKIT_SPLIT_ROUTER=never,--train.residual_dtype=float32",
                                        "loss:MOEKIT_LM_LOSS=never"])
    rows = [train_mfu.run_config(args, extra, False, "auto", tmp_path, variant=v) for v in args.variants]
    assert seen == [("auto-compile-off-base", None, None, None),
                    ("auto-compile-off-legacy", "never", "never", "float32"),
                    ("auto-compile-off-loss", "never", None, None)]
    assert [r["variant"] for r in rows] == ["base", "legacy", "loss"] and "MOEKIT_LM_LOSS" not in os.environ
    assert rows[1]["variant_env"] == {"MOEKIT_LM_LOSS": "never", "MOEKIT_SPLIT_ROUTER": "never"}
    assert rows[1]["variant_flags"] == ["--train.residual_dtype", "float32"] and rows[2]["variant_flags"] == []
    one, extra = train_mfu.parse_args(["--smoke"])
    assert one.variants == [("base", {}, [])]
    train_mfu.run_config(one, extra, False, "auto", tmp_path)
    assert seen[-1][0] == "auto-compile-off"
    capsys.readouterr()  # the fake runs' failure lines
    for bad, said in ((["a:B=1", "a"], "the label 'a' is used twice"), (["x:NOEQUALS"], "'NOEQUALS' is not VAR=VALUE"),
                      (["x y:A=1"], "the label must be"), (["x:1A=2"], "'1A=2' is not VAR=VALUE")):
        with pytest.raises(SystemExit) as exc:
            train_mfu.parse_args(["--smoke", "--variants", *bad])
        assert exc.value.code == 2 and said in _one_line(capsys)


def test_a_configuration_cut_by_its_timeout_keeps_the_steps_it_finished(monkeypatch, tmp_path, capsys):
    """--timeout kills the trainer (status 124): the steps in metrics.jsonl past the warm-up still give a row,
    marked partial (a torn last line is left out); too few steps, or a missing file, are a failed row with the
    reason; a trainer that died of anything else is failed whatever it recorded."""
    records = _records([10.0, 3.0, 1.0, 1.0, 1.0], 1000)
    torn = "\n".join(json.dumps(r) for r in records) + '\n{"step": 6, "loss'

    def fake(text, rc=124):
        def run(argv, run_dir, timeout, env):
            run_dir.mkdir(parents=True, exist_ok=True)
            if text is not None:
                (run_dir / "metrics.jsonl").write_text(text)
            return rc, timeout, "killed"
        return run

    args, extra = train_mfu.parse_args(["--smoke", "--steps", "8", "--warmup", "2", "--timeout", "30"])
    args.batch_size, args.seq_len = 10, 100  # 1000 tokens a step, as _records
    monkeypatch.setattr(train_mfu, "run_trainer", fake(torn))
    row = train_mfu.run_config(args, extra, False, "auto", tmp_path / "a")
    assert row["status"] == "partial: timeout after 5 of 8 steps" and row["steps_timed"] == 3
    assert row["tokens_per_s"] == pytest.approx(3000 / 3.03) and train_mfu.measured(row)
    assert "kept" in capsys.readouterr().err
    for text, why in (("\n".join(json.dumps(r) for r in records[:3]), "only 3 steps recorded"),
                      (None, "it recorded no step")):
        monkeypatch.setattr(train_mfu, "run_trainer", fake(text))
        row = train_mfu.run_config(args, extra, False, "auto", tmp_path / why.replace(" ", "_"))
        assert row["status"] == "failed" and "status 124 (timeout), and" in row["error"] and why in row["error"]
    monkeypatch.setattr(train_mfu, "run_trainer", fake(torn, rc=1))
    row = train_mfu.run_config(args, extra, False, "auto", tmp_path / "b")
    assert row["status"] == "failed" and row["error"].startswith("train.py exited with status 1")
    assert not train_mfu.measured(row)


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_bad_arguments_stop_before_any_run(capsys):
    """Bad flags (the benchmark's and the trainer's) are one line and exit status 2, before any run."""
    with pytest.raises(SystemExit) as exc:
        train_mfu.parse_args(["--steps", "3", "--warmup", "2"])
    assert exc.value.code == 2 and "--warmup 2 / --steps 3" in _one_line(capsys)
    with pytest.raises(SystemExit):
        train_mfu.parse_args(["--batch-size", "10", "--micro-batch", "4"])
    assert "--batch-size 10 must be a positive multiple of --micro-batch 4" in _one_line(capsys)
    args, extra = train_mfu.parse_args(["--smoke", "--", "--model.nonsense", "1"])
    assert extra == ["--model.nonsense", "1"]
    with pytest.raises(SystemExit) as exc:
        train_mfu.resolve_config(args, extra)
    assert exc.value.code == 2
    assert _one_line(capsys).startswith("train_mfu.py: error: trainer flags rejected: ")


def test_every_backend_is_checked_and_nothing_is_written(tmp_path, monkeypatch, capsys):
    """A bad second --backends entry or an unusable --device stops main before the first configuration runs:
    no train_mfu.json with a failed configuration, no run folder."""
    monkeypatch.setattr(train_mfu, "run_trainer", lambda *a: pytest.fail("a configuration ran"))
    out, runs = tmp_path / "r.json", tmp_path / "runs"
    base = ["--smoke", "--out", str(out), "--run-root", str(runs)]
    with pytest.raises(SystemExit) as exc:
        train_mfu.main(base + ["--backends", "loop", "nope"])
    assert exc.value.code == 2 and "--backends nope: unknown" in _one_line(capsys)
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit) as exc:
            train_mfu.main(base + ["--device", "cuda"])
        assert exc.value.code == 2 and "--device cuda: this machine has no CUDA GPU" in _one_line(capsys)
    assert list(tmp_path.iterdir()) == []


def test_mixtral_1b_preset_size_and_fit():
    cfg = preset("mixtral-1b")
    stats = model_stats(cfg, 2048)  # counted on the meta device: no memory
    assert stats.params == pytest.approx(1e9, rel=0.1)
    assert stats.active_params == pytest.approx(0.342e9, rel=0.01)  # 2 of 8 experts
    # GPU-friendly widths: tensor-core tiles of 128
    for width in (cfg.hidden_size, cfg.attn_head_dim, cfg.moe_ffn_hidden_size, cfg.vocab_size):
        assert width % 128 == 0
    # the benchmark's default workload fits an 80 GB GPU with room for the CUDA context and fragmentation
    args, _ = train_mfu.parse_args([])
    trainer_cfg = train_mfu.resolve_config(args, [])
    assert train_mfu.memory_estimate_gib(trainer_cfg, torch.device("cuda"), "bfloat16") < 0.9 * 80


def test_compile_diagnostics_separate_evaluation_recompiles():
    log = "\n".join([
        "step=1 loss=5.0",
        "V [0/1] [__recompiles] Recompiling function forward in models/transformer.py:104",
        "V [0/1] [__recompiles]     triggered by the following guard failure(s):",
        "V [0/1] [__recompiles]     - 0/0: GLOBAL_STATE changed: grad_mode ",
        "V [0/2] [__recompiles] Recompiling function forward in models/transformer.py:104",
        "V [0/2] [__recompiles]     triggered by the following guard failure(s):",
        "V [0/2] [__recompiles]     - 0/1: tensor 'x' size mismatch at index 0",
    ])
    assert train_mfu.compile_diagnostics(log) == {"recompiles": 2, "recompiles_in_training": 1,
                                                  "recompile_limit_hit": False}
