"""The parameter EMA (--train.ema_decay, moekit.train.ema): the average against one recomputed from the weights it
saw (in the optimizer, and from a run's per-step checkpoints), swapping for evaluation, a bitwise resume, the
readers (moekit-eval / moekit-generate / moekit-convert --ema), and bad input. Layouts, resharding and expert
rebalancing: tests/test_train_distributed.py and tests/test_placement.py compare val_loss_ema across them."""
from __future__ import annotations

import dataclasses
import json
import random
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from moekit.models.config import preset
from moekit.train import UserError
from moekit.train.convert import main as convert_main
from moekit.train.ema import ParameterEMA, half_life
from moekit.train.evaluate import main as eval_main
from moekit.train.inference import load_for_inference
from moekit.train.loop import main as train_main
from moekit.train.modelfiles import load_moekit, save_moekit
from tests.tiny import TINY_MODEL

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_the_average_is_the_recurrence_over_the_weights_it_saw():
    """Random decay, cadence and start: the optimizer-state average equals the recurrence run in float64 over
    snapshots of the weights after each step. A parameter without a gradient for a while has no optimizer state, so
    no average, until its first update; AdamW then still creates its state (an entry made first would stop it)."""
    torch.manual_seed(random.randrange(1 << 30))
    decay, every, start = random.uniform(0.5, 0.95), random.randint(1, 3), random.randint(0, 4)
    model = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 3))
    late = model[1].weight  # no gradient before step 5
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    ema = ParameterEMA(opt, decay, every, start)
    want: dict[int, torch.Tensor] = {}
    names = {id(p): n for n, p in model.named_parameters()}
    for step in range(1, 15):
        for p in model.parameters():
            p.grad = None if (p is late and step < 5) else torch.randn_like(p)
        opt.step()
        ema.update(step)
        if step >= start and step % every == 0:
            for p in model.parameters():
                if p is late and step < 5:
                    continue
                w = p.detach().double().clone()
                want[id(p)] = w if id(p) not in want else want[id(p)] + (1 - decay ** every) * (w - want[id(p)])
    assert ema.started and set(opt.state[late]) == {"step", "exp_avg", "exp_avg_sq", "ema"}
    for p in model.parameters():
        torch.testing.assert_close(opt.state[p]["ema"].double(), want[id(p)], rtol=1e-6, atol=1e-7,
                                   msg=lambda m: f"{names[id(p)]}: {m}")
    assert half_life(0.5) == pytest.approx(1.0) and half_life(0.9, 3) == pytest.approx(half_life(0.9)) == pytest.approx(6.579, rel=1e-3)


def test_swapped_puts_the_average_in_and_always_takes_it_out():
    model = nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    ema = ParameterEMA(opt, 0.9)
    assert not ema.started
    with ema.swapped():  # nothing averaged yet: nothing moves
        pass
    for step in (1, 2, 3):
        model.weight.grad, model.bias.grad = torch.randn(4, 4), torch.randn(4)
        opt.step()
        ema.update(step)
    trained = [p.detach().clone() for p in model.parameters()]
    averaged = [opt.state[p]["ema"].clone() for p in model.parameters()]
    assert not torch.equal(trained[0], averaged[0])
    with pytest.raises(RuntimeError, match="inside"):
        with ema.swapped():
            assert all(torch.equal(p, a) for p, a in zip(model.parameters(), averaged))
            raise RuntimeError("inside")
    assert all(torch.equal(p, t) for p, t in zip(model.parameters(), trained))
    assert all(torch.equal(opt.state[p]["ema"], a) for p, a in zip(model.parameters(), averaged))


DECAY = 0.7
STEPS = 5


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """deepseek-tiny (router expert-bias buffers, a shared expert), every step checkpointed, the average from step 2."""
    run = tmp_path_factory.mktemp("ema") / "run"
    assert train_main([*TINY_MODEL, "--preset", "deepseek-tiny", "--steps", str(STEPS), "--checkpoint.every", "1",
                       "--checkpoint.keep", str(STEPS), "--train.ema_decay", str(DECAY), "--train.ema_start", "2",
                       "--eval.every", "2", "--run-dir", str(run)]) == 0
    return run


def test_a_checkpoints_average_is_the_recurrence_over_the_checkpointed_weights(run):
    """The average a checkpoint holds, read back by every reader, against the recurrence over the trained weights
    of the run's checkpoints 2..5 (another way to the same numbers); buffers are the trained model's."""
    ckpt = [run / "checkpoints" / f"step_{s:06d}" for s in range(1, STEPS + 1)]
    trained = [load_moekit(c).state_dict() for c in ckpt]
    meta = [json.loads((c / "meta.json").read_text())["run"] for c in ckpt]
    assert "ema" not in meta[0] and meta[1]["ema"] == {"decay": DECAY, "every": 1, "start": 2}
    got = load_moekit(ckpt[-1], averaged=True).state_dict()
    params = {n for n, _ in load_moekit(ckpt[-1]).named_parameters()}
    for name, t in got.items():
        if name not in params:  # expert_bias and other buffers: the trained model's
            assert torch.equal(t, trained[-1][name]), name
            continue
        want = trained[1][name].double()
        for w in trained[2:]:
            want = want + (1 - DECAY) * (w[name].double() - want)
        torch.testing.assert_close(t.double(), want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    assert any("expert_bias" in n for n in got) and not torch.equal(got["layers.1.ffn.router.weight"],
                                                                     trained[-1]["layers.1.ffn.router.weight"])
    model, _, info = load_for_inference(ckpt[-1], averaged=True)
    assert info.averaged and "its parameter EMA" in info.describe()
    assert all(torch.equal(v, got[k]) for k, v in model.state_dict().items())
    # the metrics: val_loss_ema from the first evaluation after the average started, not equal to val_loss
    rows = [m for m in metrics(run) if "val_loss" in m]
    assert [m["step"] for m in rows] == [2, 4, 5] and all("val_loss_ema" in m for m in rows)
    assert rows[0]["val_loss_ema"] == rows[0]["val_loss"]  # at step 2 the average is the weights
    assert rows[-1]["val_loss_ema"] != rows[-1]["val_loss"]


def test_a_resumed_average_continues_bitwise(run, tmp_path, capsys):
    """Resumed from step 3, the average at step 5 is the uninterrupted run's, bit for bit; resuming with the EMA off
    says the checkpoint's is dropped, with it on from a checkpoint without one says it starts at the resumed weights."""
    resumed = tmp_path / "resumed"
    assert train_main([*TINY_MODEL, "--preset", "deepseek-tiny", "--steps", str(STEPS), "--train.ema_decay", str(DECAY),
                       "--train.ema_start", "2", "--eval.every", "2", "--run-dir", str(resumed),
                       "--resume", str(run / "checkpoints" / "step_000003")]) == 0
    a = load_moekit(run / "checkpoints" / "step_000005", averaged=True).state_dict()
    b = load_moekit(resumed / "checkpoints" / "step_000005", averaged=True).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert metrics(resumed)[-1]["val_loss_ema"] == metrics(run)[-1]["val_loss_ema"]
    out = capsys.readouterr().out
    assert "parameter EMA: decay 0.7 (half-life 2 steps), from step 2" in out and "val_loss_ema=" in out
    assert "(EMA " in out.splitlines()[-1]  # the "done:" line
    assert train_main([*TINY_MODEL, "--preset", "deepseek-tiny", "--steps", "4", "--run-dir", str(tmp_path / "off"),
                       "--resume", str(run / "checkpoints" / "step_000003")]) == 0
    assert "the checkpoint's parameter EMA is dropped" in capsys.readouterr().out
    assert train_main([*TINY_MODEL, "--preset", "deepseek-tiny", "--steps", "3", "--run-dir", str(tmp_path / "on"),
                       "--train.ema_decay", "0.9", "--resume", str(run / "checkpoints" / "step_000001")]) == 0
    assert "holds no parameter EMA; it starts at the resumed weights" in capsys.readouterr().out
    last = metrics(tmp_path / "on")[-1]
    assert last["step"] == 3 and last["val_loss_ema"] != last["val_loss"]


def test_the_programs_read_the_average(run, tmp_path, capsys):
    """moekit-eval --ema scores the averaged weights (another loss than the trained ones'), moekit-convert
    moekit-to-hf --ema exports them (the HF folder's logits are the average's), average --ema averages averages."""
    ckpt = run / "checkpoints" / f"step_{STEPS:06d}"
    results = {}
    for flag in ([], ["--ema"]):
        out = tmp_path / f"eval{len(flag)}.json"
        assert eval_main([str(ckpt), "--batches", "2", "--out", str(out), "--quiet", *flag]) == 0
        results[bool(flag)] = json.loads(out.read_text())
    assert results[True]["ema"] and not results[False]["ema"]
    assert results[True]["loss"] != results[False]["loss"]
    assert convert_main(["moekit-to-hf", str(ckpt), str(tmp_path / "hf"), "--ema", "--verify"]) == 0
    from moekit.models.hf import load_hf

    hf = load_hf(tmp_path / "hf").state_dict()
    want = load_moekit(ckpt, averaged=True).state_dict()
    assert torch.equal(hf["layers.1.ffn.router.weight"], want["layers.1.ffn.router.weight"])
    out = tmp_path / "avg.safetensors"
    assert convert_main(["average", str(run), "--last", "2", "--ema", "-o", str(out)]) == 0
    assert "their parameter EMAs" in capsys.readouterr().out
    prev = load_moekit(run / "checkpoints" / f"step_{STEPS - 1:06d}", averaged=True).state_dict()
    mean = load_moekit(out).state_dict()
    torch.testing.assert_close(mean["layers.0.attn.wq.weight"],
                               (prev["layers.0.attn.wq.weight"] + want["layers.0.attn.wq.weight"]) / 2)


def one_line(capsys, rc: int) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    return err[0]


def test_asking_for_an_average_that_is_not_there_is_one_line(run, tmp_path, capsys):
    first = run / "checkpoints" / "step_000001"  # before the average started
    assert "holds no parameter EMA" in one_line(capsys, eval_main([str(first), "--ema", "--batches", "1"]))
    assert "holds no parameter EMA" in one_line(capsys, convert_main(["moekit-to-hf", str(first), str(tmp_path / "x"),
                                                                      "--ema"]))
    model_file = save_moekit(load_moekit(first), tmp_path / "m.safetensors")
    assert "a model file holds one set of weights" in one_line(
        capsys, convert_main(["moekit-to-hf", str(model_file), str(tmp_path / "y"), "--ema"]))
    from moekit.models.hf import save_hf

    folder = save_hf(load_moekit(first), tmp_path / "hf")
    with pytest.raises(UserError, match="a HuggingFace folder holds one set of weights"):
        load_for_inference(folder, averaged=True)


@pytest.mark.parametrize("flags, match", [
    (["--train.ema_decay", "1"], "--train.ema_decay=1.0 is invalid; it must be in [0, 1)"),
    (["--train.ema_decay", "-0.5"], "--train.ema_decay=-0.5 is invalid"),
    (["--train.ema_decay", "nan"], "--train.ema_decay=nan is invalid"),
    (["--train.ema_decay", "0.9", "--train.ema_every", "0"], "--train.ema_every=0 is invalid"),
    (["--train.ema_decay", "0.9", "--train.ema_start", "-1"], "--train.ema_start=-1 is invalid"),
])
def test_bad_ema_settings_are_one_line(tmp_path, capsys, flags, match):
    rc = train_main([*TINY_MODEL, "--steps", "1", "--run-dir", str(tmp_path / "r"), *flags])
    assert match in one_line(capsys, rc)
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_the_planner_counts_the_average(optimizer):
    """The dry run's optimizer row and the memory estimate both count one more fp32 copy of every parameter: the
    bytes the optimizer state measures after a step with the average."""
    from moekit.comm.topology import Layout
    from moekit.models.transformer import build_model
    from moekit.train.muon import Muon, muon_param_groups
    from moekit.train.planning.dryrun import optimizer_state_bytes
    from moekit.train.planning.memory import Workload, estimate_memory

    cfg = dataclasses.replace(preset("deepseek-tiny"), num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=2,
                              head_dim=8, ffn_hidden_size=48, moe_ffn_hidden_size=16)
    model = build_model(cfg, seed=0)
    tokens = torch.randint(0, cfg.vocab_size, (2, 8))
    model(tokens, targets=tokens).backward()
    opt = (Muon(muon_param_groups(model, 0.1), lr=1e-3) if optimizer == "muon"
           else torch.optim.AdamW(model.parameters(), lr=1e-3))
    opt.step()
    ParameterEMA(opt, 0.99).update(1)
    measured = sum(t.numel() * t.element_size() for st in opt.state.values() for t in st.values())
    name, counted = optimizer_state_bytes(model, optimizer, ema=True)
    assert counted == measured and name.endswith(" + parameter EMA")
    wl = dict(micro_batch=2, seq_len=8, dtype="float32", device="cpu", optimizer=optimizer)
    with_ema = estimate_memory(cfg, Layout(), Workload(**wl, ema=True)).optimizer
    assert with_ema == measured
    assert with_ema - estimate_memory(cfg, Layout(), Workload(**wl)).optimizer == 4 * sum(p.numel() for p in model.parameters())


def test_the_report_shows_the_averages_loss(run, tmp_path, capsys):
    """moekit-heatmap's report: a "val_loss EMA" column and final_val_loss_ema in its data when a run kept the
    average; a report of runs without one has no such column."""
    from moekit.train import heatmap

    def report(*runs) -> tuple[str, dict]:
        out = tmp_path / "r.html"
        argv = ["--compare", *map(str, runs)] if len(runs) > 1 else [str(runs[0])]
        assert heatmap.main([*argv, "--html", str(out)]) == 0
        page = out.read_text()
        return page, json.loads(re.search(r'id="moekit-report-data">(.*?)</script>', page, re.S)[1])

    plain = tmp_path / "plain"
    assert train_main([*TINY_MODEL, "--preset", "deepseek-tiny", "--steps", "2", "--run-dir", str(plain)]) == 0
    capsys.readouterr()
    page, data = report(run, plain)
    table = capsys.readouterr().out
    table = table[table.index("run  "):].splitlines()
    column = table[0].split().index("val_loss_ema")  # the console's comparison table too
    assert table[1].split()[column] == f"{metrics(run)[-1]['val_loss_ema']:.4f}" and table[2].split()[column] == "-"
    assert page.count(">val_loss EMA</th>") == 1
    assert data["runs"][0]["final_val_loss_ema"] == metrics(run)[-1]["val_loss_ema"]
    assert data["runs"][1]["final_val_loss_ema"] is None  # NaN: no average (JSON null)
    page, _ = report(plain)
    assert "val_loss EMA" not in page


def test_export_hf_ema_writes_the_average(tmp_path, capsys):
    """--export-hf with --train.export_hf_ema: the folder holds the parameter average, the tensors moekit-convert
    moekit-to-hf --ema writes from the final checkpoint (another route: the checkpoint's optimizer state); the
    trained weights are back in the model after it (the run's final checkpoint keeps them)."""
    from safetensors.torch import load_file

    run, out = tmp_path / "run", tmp_path / "hf-ema"
    assert train_main([*TINY_MODEL, "--preset", "deepseek-tiny", "--steps", "3", "--train.ema_decay", "0.6",
                       "--run-dir", str(run), "--export-hf", str(out), "--train.export_hf_ema", "true"]) == 0
    assert re.search(rf"exported {re.escape(str(out))} \(HuggingFace \w+\): the parameter EMA", capsys.readouterr().out)
    ckpt = run / "checkpoints" / "step_000003"
    assert convert_main(["moekit-to-hf", str(ckpt), str(tmp_path / "via-convert"), "--ema"]) == 0
    exported, converted = ({k: v for f in sorted(d.glob("*.safetensors")) for k, v in load_file(f).items()}
                           for d in (out, tmp_path / "via-convert"))
    assert sorted(exported) == sorted(converted) and all(torch.equal(exported[k], converted[k]) for k in converted)
    assert convert_main(["moekit-to-hf", str(ckpt), str(tmp_path / "trained")]) == 0
    trained = {k: v for f in (tmp_path / "trained").glob("*.safetensors") for k, v in load_file(f).items()}
    assert any(not torch.equal(trained[k], exported[k]) for k in trained)
    rc = train_main([*TINY_MODEL, "--steps", "1", "--run-dir", str(tmp_path / "x"), "--export-hf", str(tmp_path / "y"),
                     "--train.export_hf_ema", "true"])
    assert "--train.export_hf_ema true exports the parameter average; keep one with --train.ema_decay" in \
        one_line(capsys, rc)
