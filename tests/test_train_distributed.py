"""Layout invariance under torchrun: expert parallelism (flat and hierarchical) reproduces one process."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moekit.train.records import load_rows
from tests.dist_utils import TRAIN_SCRIPT, run_trainer

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--model.hidden_size", "32", "--model.num_layers", "2", "--train.seq_len", "32", "--batch-size", "8",
        "--eval.every", "0", "--eval.sequences", "8", "--log.every", "1", "--log.progress", "off",
        "--log.tensorboard", "false"]
EMA = ["--train.ema_decay", "0.5"]  # a parameter average in the optimizer state (moekit.train.ema): val_loss_ema


def losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def ema_losses(run_dir: Path) -> list[float]:
    """val_loss_ema of every evaluation (--train.ema_decay)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [m["val_loss_ema"] for m in rows if "val_loss_ema" in m]


def same_parts(got_dir: Path, want_dir: Path) -> None:
    """Each step's grad_norm_by_part (moekit.train.grad_parts) equals the reference run's."""
    got, want = ([json.loads(line)["grad_norm_by_part"] for line in (d / "metrics.jsonl").read_text().splitlines()]
                 for d in (got_dir, want_dir))
    assert len(got) == len(want) and all(a.keys() == b.keys() for a, b in zip(got, want))
    for a, b in zip(got, want):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-6), (a, b)


def task_scores(run_dir: Path, key: str = "tasks") -> list[dict]:
    """The --eval.tasks scores of every evaluation (train.task_loop); ``tasks_ema``: the parameter average's."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [row[key]["mc"] for row in rows if key in row]


def same_task_scores(got: list[dict], want: list[dict]) -> None:
    assert len(got) == len(want) >= 1
    for g, w in zip(got, want):
        assert g["correct_nll"] == pytest.approx(w["correct_nll"], rel=1e-4)
        assert (g["acc"], g["acc_norm"], g["items"]) == (w["acc"], w["acc_norm"], w["items"])


@pytest.fixture(scope="module")
def tasks(tmp_path_factory) -> list[str]:
    """--eval.tasks flags: a multiple-choice file of ragged random items (scored under every layout it is given).
    Every context has a word: the embedded byte data has no end-of-text token to start an empty one from."""
    import random

    rng = random.Random()
    words = "in on the of cat dog runs".split()
    text = lambda lo, hi: " ".join(rng.choices(words, k=rng.randint(lo, hi)))  # noqa: E731
    path = tmp_path_factory.mktemp("tasks") / "mc.jsonl"
    path.write_text("".join(json.dumps({"context": text(1, 6), "choices": [" " + text(1, 3) for _ in range(3)],
                                        "label": rng.randrange(3)}) + "\n" for _ in range(5)))
    return ["--eval.tasks", str(path)]


def run(args, nproc: int = 1, env_extra=None, script=TRAIN_SCRIPT) -> subprocess.CompletedProcess:
    """tools/train.py (or ``script``) on ``nproc`` ranks. The trainer's ranks start from the test session's fork
    server (tests.dist_utils.run_trainer: the environment torchrun gives them, a fork instead of an interpreter
    each); another script starts with the real ``python -m torch.distributed.run``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    env.pop("WORLD_SIZE", None)
    env.update(env_extra or {})
    if script == TRAIN_SCRIPT:
        return run_trainer(args, nproc, env=env, timeout=600)
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    cmd = (launch if nproc > 1 else [sys.executable]) + [str(script), *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def single_run(tmp_path_factory, tasks) -> Path:
    """One process, 4 steps, the task scores and the parameter average's loss after the last (the reference for
    every layout below)."""
    d = tmp_path_factory.mktemp("single")
    r = run(["--steps", "4", "--run-dir", str(d), "--checkpoint.every", "0", *TINY, *EMA, *tasks])
    assert r.returncode == 0, r.stderr
    return d


@pytest.fixture(scope="module")
def single(single_run):
    return losses(single_run)


@pytest.mark.parametrize("extra", [["--ep", "4"], ["--ep", "2"],
                                   ["--ep", "4", "--ranks-per-node", "2", "--checkpoint.every", "2"]],
                         ids=["flat-ep4", "flat-dp4-ep2", "hierarchical-ep4"])
def test_torchrun_ep_matches_one_process(tmp_path, single, extra):
    """ep4: every rank holds 2 of 8 experts; dp4 x ep2: two EP groups, expert grads reduced across them. The ranks
    are forked with torchrun's environment (tests.dist_utils.run_trainer); ranks that the real torchrun starts
    train tools/train.py below (test_ranks_never_finalize_...) and in tests/test_preemption.py and
    tests/test_restart.py, which compare them bit for bit with forked ones."""
    r = run(["--steps", "4", "--run-dir", str(tmp_path), *TINY, *extra], nproc=4)
    assert r.returncode == 0, r.stderr[-3000:]
    got = losses(tmp_path)
    assert got == pytest.approx(single, rel=1e-5, abs=1e-6)
    assert got != pytest.approx([got[0]] * len(got))  # it trains
    if "--ranks-per-node" in extra:
        assert "2 node(s) of 2 ranks" in r.stdout
        # a checkpoint written at ep=4 resumes in one process and continues the same curve
        resumed = tmp_path / "resumed"
        r2 = run(["--resume", str(tmp_path / "checkpoints" / "step_000002"), "--steps", "4", "--run-dir",
                  str(resumed), "--checkpoint.every", "0", *TINY])
        assert r2.returncode == 0, r2.stderr
        assert losses(resumed) == pytest.approx(single[2:], rel=1e-5, abs=1e-6)
        load = load_rows(tmp_path)[1:]
        assert all(sum(sum(layer) for layer in rec["tokens"]) > 0 for rec in load if "tokens" in rec)


# tools/train.py with a probe that fires only if the interpreter finalizes (module globals are cleared then):
# it writes the names of the threads still alive at that moment
FINALIZE_PROBE = """
import os, sys


class Probe:
    def __del__(self, listdir=os.listdir, open=open, out=os.environ["PROBE_OUT"] + os.environ.get("RANK", "single")):
        names = []
        for tid in listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    names.append(f.read().strip())
            except OSError:  # a thread that ended meanwhile
                pass
        with open(out, "w") as f:
            f.write(" ".join(names))


probe = Probe()
from moekit.train.loop import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads thread names from /proc")
def test_ranks_never_finalize_the_interpreter_with_gloo_workers_alive(tmp_path):
    """A gloo worker thread (pt_gloo_runloop) that frees its last collective's tensors while the interpreter
    finalizes dies taking the GIL, inside a noexcept destructor: the rank aborts with "terminate called without
    an active exception" (exit -6), now and then. Nothing joins those threads before exit (destroy_process_group
    leaves them running while DeviceMeshes and DTensor's caches hold the groups), so a rank must not finalize
    with them alive. The one-process run shows the probe fires when the interpreter does finalize."""
    script = tmp_path / "probed_train.py"
    script.write_text(FINALIZE_PROBE)
    env = {"PROBE_OUT": str(tmp_path / "threads-")}
    flags = ["--steps", "2", "--checkpoint.every", "0", *TINY]
    r = run([*flags, "--run-dir", str(tmp_path / "one")], script=script, env_extra=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "threads-single").read_text().startswith("python"), "the probe did not fire"
    r = run([*flags, "--run-dir", str(tmp_path / "ep2"), "--ep", "2"], nproc=2, script=script, env_extra=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "done: step 2" in r.stdout
    for rank in (0, 1):
        probe = tmp_path / f"threads-{rank}"
        alive = probe.read_text().split().count("pt_gloo_runloop") if probe.exists() else 0
        assert alive == 0, f"rank {rank} finalized its interpreter with {alive} gloo worker threads alive"


@pytest.mark.parametrize("args,match", [
    (["--dp", "2", "--ep", "2"], "world size is 4"),
    (["--ep", "3"], "ep=3 must divide"),
    (["--model.num_experts", "6", "--ep", "4"], "num_experts=6 is not divisible"),
    (["--ranks-per-node", "3"], "must divide the world size 4"),
    (["--tp", "4"], "--tp 4 must divide num_kv_heads=2"),
    (["--cp", "2", "--train.seq_len", "30"], "--seq-len 30 is not a multiple of 4"),
    (["--cp", "3"], "not divisible by pp*fsdp*cp*tp = 1*1*3*1"),
])
def test_bad_layouts_fail_before_any_collective(args, match, monkeypatch, capsys):
    from moekit.train.loop import main

    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    assert main(["--steps", "1", *TINY, *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and match in err, err


def test_tp_fsdp_ep_run_matches_and_resumes_at_another_layout(tmp_path, single, single_run, tasks):
    """tp2 x fsdp2 x ep2 (4 ranks, activation checkpointing on) follows the one-process curve, task scores
    included (several choices a forward, through the sharded model's logits), and so does the parameter average
    (sharded like the weights, swapped in for its evaluation); its step-2 checkpoint (DTensor shards over three
    meshes, the average among them) resumes as dp2 x ep2 and continues the same curve and the same average."""
    r = run(["--steps", "4", "--run-dir", str(tmp_path), "--tp", "2", "--fsdp", "2", "--ep", "2",
             "--train.activation_checkpointing", "full", "--checkpoint.every", "2", *TINY, *EMA, *tasks], nproc=4)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "pp" not in r.stdout.split("layout:")[1].split("\n")[0] and "fsdp=2 tp=2 ep=2" in r.stdout
    assert losses(tmp_path) == pytest.approx(single, rel=1e-5, abs=1e-6)
    same_task_scores(task_scores(tmp_path), task_scores(single_run))
    want_ema = ema_losses(single_run)
    assert len(want_ema) == 1 and ema_losses(tmp_path) == pytest.approx(want_ema, rel=1e-5)
    same_parts(tmp_path, single_run)  # each part's norm over TP, FSDP and EP shards
    same_task_scores(task_scores(tmp_path, "tasks_ema"), task_scores(single_run, "tasks_ema"))  # the average's
    resumed = tmp_path / "resumed"
    r2 = run(["--resume", str(tmp_path / "checkpoints" / "step_000002"), "--steps", "4", "--run-dir", str(resumed),
              "--ep", "2", "--checkpoint.every", "0", *TINY, *EMA], nproc=2)
    assert r2.returncode == 0, r2.stderr[-3000:]
    assert losses(resumed) == pytest.approx(single[2:], rel=1e-5, abs=1e-6)
    assert ema_losses(resumed) == pytest.approx(want_ema, rel=1e-5)  # the average came back, resharded


def test_context_parallel_run_matches_and_resumes_in_one_process(tmp_path, single, tasks):
    """dp2 x cp2 x ep2 (4 ranks: each sequence's 32 positions split 8 | 8 + 8 | 8 over two ranks, experts over
    the same two) follows the one-process curve, validation and task scores included; its checkpoint resumes
    without cp."""
    r = run(["--steps", "4", "--run-dir", str(tmp_path), "--cp", "2", "--ep", "2", "--checkpoint.every", "2",
             *TINY, "--eval.every", "2", *tasks], nproc=4)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "dp=2 cp=2 ep=2 (experts 4 per rank)" in r.stdout
    assert losses(tmp_path) == pytest.approx(single, rel=1e-5, abs=1e-6)
    one = tmp_path / "one"  # the validation losses of the same run in one process
    assert run(["--steps", "4", "--run-dir", str(one), "--checkpoint.every", "0", *TINY, "--eval.every", "2", *tasks]
               ).returncode == 0
    same_task_scores(task_scores(tmp_path), task_scores(one))
    val = [json.loads(line).get("val_loss") for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [v for v in val if v] == pytest.approx(
        [v for v in (json.loads(line).get("val_loss") for line in (one / "metrics.jsonl").read_text().splitlines())
         if v], rel=1e-5)
    resumed = tmp_path / "resumed"
    r2 = run(["--resume", str(tmp_path / "checkpoints" / "step_000002"), "--steps", "4", "--run-dir", str(resumed),
              "--checkpoint.every", "0", *TINY], nproc=1)
    assert r2.returncode == 0, r2.stderr[-3000:]
    assert losses(resumed) == pytest.approx(single[2:], rel=1e-5, abs=1e-6)


MICRO = ["--train.micro_batch_size", "2"]  # 4 micro-batches in one process = 2 per data rank at D = 2


@pytest.fixture(scope="module")
def single_micro(tmp_path_factory, tasks):
    """One process, 4 micro-batches of 2, aux loss on / off (the reference for pipelines): the losses, and the
    task scores and the parameter average's loss after the last step."""
    out = {}
    for aux in ("0.01", "0"):
        d = tmp_path_factory.mktemp(f"single-micro-{aux}")
        r = run(["--steps", "4", "--run-dir", str(d), "--checkpoint.every", "0", "--model.aux_loss_coeff", aux,
                 *MICRO, *TINY, *EMA, *tasks])
        assert r.returncode == 0, r.stderr
        out[aux] = losses(d)
        out[aux + "-tasks"] = task_scores(d)
        out[aux + "-ema"] = ema_losses(d)
        out[aux + "-dir"] = d
    return out


@pytest.mark.parametrize("nproc,extra,aux", [
    (2, ["--pp", "2", "--layout.pp_schedule", "gpipe"], "0.01"),
    (8, ["--pp", "2", "--tp", "2", "--ep", "2", "--layout.sequence_parallel", "true"], "0"),
    (4, ["--pp", "2", "--cp", "2"], "0.01"),
], ids=["pp2-gpipe", "pp2-tp2-ep2-sp-8ranks", "pp2-cp2"])
def test_pipeline_runs_match_one_process(tmp_path, single_micro, tasks, nproc, extra, aux):
    """pp2: the same 4 micro-batches through 2 stages, aux loss included. 8 ranks pp2 x dp2 x tp2, ep2 and
    sequence parallel: each data rank's micro-batch m is half of the one-process micro-batch pair (2m, 2m+1),
    so the load-balance statistics differ by construction (global-batch balancing is per micro-batch);
    the aux loss is off there and the curve must match exactly. The task scores after the last step match
    too (each choice through the pipeline's forward), and so does the parameter average's loss (each stage swaps
    its own layers' average in)."""
    r = run(["--steps", "4", "--run-dir", str(tmp_path), "--checkpoint.every", "2", "--model.aux_loss_coeff", aux,
             *MICRO, *TINY, *EMA, *extra, *tasks], nproc=nproc)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "pipeline: " in r.stdout and "2 stages (layers 0-0 | 1-1)" in r.stdout
    assert losses(tmp_path) == pytest.approx(single_micro[aux], rel=1e-5, abs=1e-6)
    same_task_scores(task_scores(tmp_path), single_micro[aux + "-tasks"])
    assert ema_losses(tmp_path) == pytest.approx(single_micro[aux + "-ema"], rel=1e-5)
    same_task_scores(task_scores(tmp_path, "tasks_ema"), task_scores(single_micro[aux + "-dir"], "tasks_ema"))
    same_parts(tmp_path, single_micro[aux + "-dir"])  # the stages' parts added over the pipeline
    load = load_rows(tmp_path)
    assert len(load[0]["layers"]) == 2  # both stages' MoE layers in rank 0's record
    assert all(sum(map(sum, rec["tokens"])) == 8 * 32 * 2 * 2 for rec in load[1:])  # B*S*k per layer, summed
    if nproc == 2:  # the pp2 checkpoint (each stage wrote its layers) resumes in one process: pp changes 2 -> 1
        resumed = tmp_path / "resumed"
        r2 = run(["--resume", str(tmp_path / "checkpoints" / "step_000002"), "--steps", "4", "--run-dir", str(resumed),
                  "--checkpoint.every", "0", "--model.aux_loss_coeff", aux, *MICRO, *TINY])
        assert r2.returncode == 0, r2.stderr[-3000:]
        assert losses(resumed) == pytest.approx(single_micro[aux][2:], rel=1e-5, abs=1e-6)


def test_export_hf_from_expert_parallel_run(tmp_path):
    """--export-hf under ep=2 gathers the expert shards; transformers loads the folder with moekit's logits."""
    transformers = pytest.importorskip("transformers")
    import torch

    from moekit.models.hf import load_mixtral

    out = tmp_path / "hf"
    r = run(["--ep", "2", "--steps", "2", "--run-dir", str(tmp_path / "run"), "--export-hf", str(out),
             "--checkpoint.every", "0", *TINY], nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    ours = load_mixtral(out)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    tokens = torch.randint(0, ours.config.vocab_size, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), theirs(tokens).logits, rtol=1e-4, atol=1e-4)
    assert not torch.equal(ours.layers[0].ffn.experts.w_in[0], ours.layers[0].ffn.experts.w_in[-1])


def test_gpt_oss_trains_alike_under_every_parallelism(tmp_path):
    """gpt-oss-tiny (sinks sharded with the heads, an 8-position window on layer 0, q/k/v/o, gate and expert biases,
    swiglu_oai) at tp2 x fsdp2 x ep2 with sequence parallelism (4 ranks), at pp2 (2 ranks) and at cp2 x ep2 (each
    sequence's 4 chunks of 8 over 2 ranks, the window reaching into the other rank's chunk) follows the one-process
    curve. The aux loss is off: under TP each rank balances its own token slice (by design)."""
    oss = ["--preset", "gpt-oss-tiny", "--model.sliding_window", "8", "--model.aux_loss_coeff", "0",
           "--checkpoint.every", "0", *MICRO, *TINY]
    r = run(["--steps", "4", "--run-dir", str(tmp_path / "single"), *oss])
    assert r.returncode == 0, r.stderr[-3000:]
    ref = losses(tmp_path / "single")
    for name, nproc, extra in [("tp-fsdp-ep-sp", 4, ["--tp", "2", "--fsdp", "2", "--ep", "2",
                                                     "--layout.sequence_parallel", "true"]),
                               ("pp2", 2, ["--pp", "2", "--layout.pp_schedule", "gpipe"]),
                               ("cp2-ep2", 2, ["--cp", "2", "--ep", "2"])]:
        r = run(["--steps", "4", "--run-dir", str(tmp_path / name), *oss, *extra], nproc=nproc)
        assert r.returncode == 0, r.stderr[-3000:]
        assert losses(tmp_path / name) == pytest.approx(ref, rel=1e-5, abs=1e-6), name
    assert ref != pytest.approx([ref[0]] * len(ref))  # it trains
