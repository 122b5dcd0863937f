"""Partial fine-tuning (moekit.train.freezing): --train.trainable / --train.freeze / --train.train_experts.

The reference for what a trained parameter (or expert row) becomes is a run that trains everything: with gradient
clipping off, freezing other parameters changes no gradient, so after one step every trained value equals the
full run's, and every frozen one is still its initial value (models.init: a function of the seed and the name)."""
from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import torch

from moekit.models.init import init_weights
from moekit.models.transformer import Transformer, meta_device
from moekit.moe.load import moe_layers
from moekit.train import UserError, freezing
from moekit.train.config import new_config
from moekit.train.loop import main as train_main
from moekit.train.modelfiles import load_moekit
from tests.helpers import one_stderr_line
from tests.tiny import TINY_MODEL

DEEPSEEK = [*TINY_MODEL, "--preset", "deepseek-tiny", "--model.num_layers", "3", "--train.grad_clip", "0",
            "--train.weight_decay", "0.1", "--train.warmup_steps", "0", "--train.lr", "0.01"]


def selection_file(path: Path, chosen: dict[str, list[int]], E: int) -> Path:
    layers = [{"name": n, "experts_count": E, "selected": ids} for n, ids in chosen.items()]
    path.write_text(json.dumps({"format": "moekit-expert-selection", "version": 1, "criterion": "token",
                                "threshold": 0.2, "layers": layers}))
    return path


def random_selection(names: list[str], E: int, rng: random.Random) -> dict[str, list[int]]:
    """A ragged random pick per layer: the first layer none, the second all, the rest 1..E-1 experts."""
    out = {}
    for i, n in enumerate(names):
        k = 0 if i == 0 else E if i == 1 else rng.randint(1, E - 1)
        out[n] = sorted(rng.sample(range(E), k))
    return out


def meta_model(preset: str = "deepseek-tiny", **model):
    cfg = new_config(preset)
    for k, v in model.items():
        setattr(cfg.model, k, v)
    with meta_device():
        return cfg, Transformer(cfg.model)


def initial(ckpt: Path, seed: int) -> dict[str, torch.Tensor]:
    """The run's initial weights: a fresh model of the checkpoint's config filled from the seed."""
    config = load_moekit(ckpt).config
    with meta_device():
        model = Transformer(config)
    model.to_empty(device="cpu")
    init_weights(model, seed)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def weights(ckpt: Path) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in load_moekit(ckpt).state_dict().items()}


# -- the plan: names, patterns and their errors ------------------------------------------------------------------


def test_patterns_pick_parameters_and_router_biases():
    cfg, model = meta_model()
    cfg.train.trainable = "*.experts.*, *.router.*"
    cfg.train.freeze = "layers.2.*"
    fp = freezing.plan(model, cfg)
    names = {n for n, _ in model.named_parameters()}
    want = {n for n in names if (".experts." in n or ".router." in n) and not n.startswith("layers.2.")}
    assert fp.trainable == want and fp.frozen == names - want and want
    assert fp.frozen_biases == {"layers.2.ffn"}  # layer 2's expert_bias is frozen too, layer 1's trains
    assert fp.counts["trainable"] == sum(p.numel() for n, p in model.named_parameters() if n in want)
    assert "partial training" in fp.describe() and "router expert_bias frozen in 1 layer" in fp.describe()
    cfg.train.trainable = cfg.train.freeze = ""
    assert freezing.plan(model, cfg) is None  # nothing asked: no plan, no overhead


@pytest.mark.parametrize("settings, match", [
    ({"freeze": "*.gate_proj.*"}, r"--train.freeze pattern '\*.gate_proj.\*' names no parameter.*layers.N.attn.wq"),
    ({"trainable": "lm_head.weight,nope"}, r"--train.trainable pattern 'nope' names no parameter"),
    ({"trainable": "*.router.*", "freeze": "*router*"}, r"leave no parameter to train"),
    ({"freeze": "*.attn.wq.*", "qk_clip": 50.0}, r"--train.qk_clip 50.0 rescales.*layers.N.attn.wq.weight are frozen"),
], ids=["unknown-freeze", "unknown-trainable", "nothing-trains", "qk-clip"])
def test_bad_patterns_are_refused(settings, match):
    cfg, model = meta_model()
    for k, v in settings.items():
        setattr(cfg.train, k, v)
    with pytest.raises(UserError, match=match):
        freezing.plan(model, cfg)


def test_a_selection_needs_its_expert_stacks_to_train(tmp_path):
    cfg, model = meta_model()
    names = [n for n, _ in moe_layers(model)]
    cfg.train.train_experts = str(selection_file(tmp_path / "s.json", {n: [1] for n in names}, 16))
    cfg.train.freeze = "*.experts.w_out"
    with pytest.raises(UserError, match=r"picks experts \[1\] of layers.1.ffn.*layers.1.ffn.experts.w_out"):
        freezing.plan(model, cfg)
    cfg.train.freeze = ""
    fp = freezing.plan(model, cfg)
    L = len(names)
    assert fp.experts == {n: (1,) for n in names} and f"experts: {L} of {16 * L} train" in fp.describe()


def test_optimizer_groups_drop_frozen_parameters_and_split_masked_stacks(tmp_path):
    """Every rank and layout gets the same group count; frozen parameters are in none; Muon's per-matrix chunks
    follow their parameters."""
    from moekit.train.plan import make_optimizer

    cfg, model = meta_model()
    names = [n for n, _ in moe_layers(model)]
    cfg.train.train_experts = str(selection_file(tmp_path / "s.json", {n: [0, 3] for n in names}, 16))
    cfg.train.freeze = "embed.*,*.attn.*"
    model.to_empty(device="cpu")
    fp = freezing.plan(model, cfg)
    freezing.apply(model, fp)
    for optimizer in ("adamw", "muon"):
        cfg.train.optimizer = optimizer
        groups = make_optimizer(model, cfg, fp).param_groups
        # one group of masked stacks (the matrices'), no empty group (the norms' has no expert stack)
        assert sum("row_decay" in g for g in groups) == 1 and all(g["params"] for g in groups)
        held = [p for g in groups for p in g["params"]]
        assert len(held) == len({id(p) for p in held}) == len(fp.trainable)
        assert {id(p) for p in held} == {id(p) for n, p in model.named_parameters() if n in fp.trainable}
        masked = [g for g in groups if "row_decay" in g]
        assert all(g["weight_decay"] == 0 for g in masked)
        assert {id(p) for g in masked for p in g["params"]} == {
            id(getattr(layer.experts, q)) for _, layer in moe_layers(model) for q in layer.experts.param_names()}
        if optimizer == "muon":
            assert all(len(g["chunks"]) == len(g["params"]) for g in groups if g["kind"] == "muon")
            w_in = [c for g in masked if g["kind"] == "muon" for p, c in zip(g["params"], g["chunks"])]
            L = len(names)
            assert sorted(w_in) == [1] * L + [2] * L  # the gated w_in stacks keep their two halves


# -- training: what trains equals a full run, what is frozen stays ------------------------------------------------


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_frozen_parameters_and_experts_stay_and_the_rest_trains_as_a_full_run(tmp_path, optimizer):
    seed, rng = random.randrange(1 << 20), random.Random()
    common = [*DEEPSEEK, "--train.seed", str(seed), "--train.optimizer", optimizer, "--checkpoint.every", "1",
              "--checkpoint.keep", "3"]
    full = tmp_path / "full"
    assert train_main([*common, "--steps", "1", "--run-dir", str(full)]) == 0
    _, model = meta_model(num_layers=3, hidden_size=32)
    layers = [n for n, _ in moe_layers(model)]
    chosen = random_selection(layers, 16, rng)
    sel = selection_file(tmp_path / "sel.json", chosen, 16)
    part = tmp_path / "part"
    flags = ["--train.trainable", "*.experts.*,*.attn.*,norm.weight,*.router.*", "--train.freeze",
             "*.attn.wq.*,layers.2.ffn.router.*", "--train.train_experts", str(sel)]
    assert train_main([*common, *flags, "--steps", "3", "--run-dir", str(part)]) == 0
    init = initial(full / "checkpoints" / "step_000001", seed)
    want = weights(full / "checkpoints" / "step_000001")
    step1, step3 = (weights(part / "checkpoints" / f"step_{s:06d}") for s in (1, 3))
    trains = lambda n: ((".experts." in n or ".attn." in n or ".router." in n or n == "norm.weight")  # noqa: E731
                        and ".attn.wq." not in n and not n.startswith("layers.2.ffn.router."))
    moved = 0
    for name, w in want.items():
        if ".experts." in name:
            layer = name.split(".experts.")[0]
            rows = torch.zeros(w.shape[0], dtype=torch.bool)
            rows[chosen[layer]] = True
            assert torch.equal(step1[name][rows], w[rows]), name  # the chosen experts: as the full run
            assert torch.equal(step3[name][~rows], init[name][~rows]), name  # the others: as initialised
            moved += int(not torch.equal(step3[name][rows], init[name][rows]))
        elif name.endswith("pending_load"):
            continue
        elif trains(name):
            assert torch.equal(step1[name], w), name
            moved += int(not torch.equal(step3[name], init[name]))
        else:
            assert torch.equal(step3[name], init[name]), name
    assert moved >= 6  # the test can tell: trained tensors did move (the selection's first layer trains none)
    # layer 1's router bias trained (aux-loss-free updates), layer 2's is frozen with its router
    bias = "layers.{}.ffn.router.expert_bias"
    assert not torch.equal(step3[bias.format(1)], init[bias.format(1)])
    assert torch.equal(step3[bias.format(2)], init[bias.format(2)]) and not torch.equal(want[bias.format(2)],
                                                                                        init[bias.format(2)])


def test_a_partial_run_resumes_bitwise_and_refuses_another_choice(tmp_path, capsys):
    seed = random.randrange(1 << 20)
    _, model = meta_model(num_layers=3, hidden_size=32)
    sel = selection_file(tmp_path / "sel.json", random_selection([n for n, _ in moe_layers(model)], 16,
                                                                 random.Random()), 16)
    flags = [*DEEPSEEK, "--train.seed", str(seed), "--train.trainable", "*.experts.*,*.router.*",
             "--train.train_experts", str(sel), "--train.lr_scale", "*.router.*=0.5", "--checkpoint.every", "2",
             "--steps", "3"]
    whole = tmp_path / "whole"
    assert train_main([*flags, "--run-dir", str(whole)]) == 0
    resumed = tmp_path / "resumed"
    ckpt = str(whole / "checkpoints" / "step_000002")
    assert train_main([*flags, "--resume", ckpt, "--run-dir", str(resumed)]) == 0
    a, b = weights(whole / "checkpoints" / "step_000003"), weights(resumed / "checkpoints" / "step_000003")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    capsys.readouterr()
    assert train_main([*flags, "--train.freeze", "*.router.*", "--resume", ckpt,
                       "--run-dir", str(tmp_path / "other")]) == 2
    one_stderr_line(capsys, "train.freeze", "optimizer state holds the parameters that trained")


@pytest.mark.parametrize("flags, words", [
    (["--train.freeze", "*.gate.*"], ["--train.freeze pattern '*.gate.*' names no parameter"]),
    (["--train.train_experts", "missing.json"], ["--train.train_experts missing.json: no such file",
                                                 "--select-experts"]),
    (["--train.trainable", "*.router.*", "--train.freeze", "*.router.*"], ["leave no parameter to train"]),
], ids=["pattern", "no-file", "nothing"])
def test_bad_flags_are_one_line_before_the_run(tmp_path, capsys, flags, words):
    assert train_main([*TINY_MODEL, "--steps", "1", "--run-dir", str(tmp_path / "r"), *flags]) == 2
    one_stderr_line(capsys, *words)
    assert not (tmp_path / "r" / "checkpoints").exists()


def test_a_selection_for_another_model_is_one_line(tmp_path, capsys):
    sel = selection_file(tmp_path / "sel.json", {"layers.0.ffn": [1], "layers.1.ffn": [2]}, 4)  # mixtral: 8 experts
    assert train_main([*TINY_MODEL, "--steps", "1", "--run-dir", str(tmp_path / "r"),
                       "--train.train_experts", str(sel)]) == 2
    one_stderr_line(capsys, str(sel), "experts_count 4")


# -- under expert, fully-sharded and pipeline parallelism ---------------------------------------------------------

LAYOUT = ["--preset", "deepseek-tiny", "--model.hidden_size", "32", "--train.seq_len", "32", "--batch-size", "8",
          "--eval.every", "0", "--eval.sequences", "8", "--log.every", "1", "--log.progress", "off",
          "--log.tensorboard", "false", "--steps", "3", "--train.grad_clip", "0.5", "--checkpoint.every", "3",
          # Adam divides each gradient by its root mean square: near eps (1e-8) a rounding difference between layouts
          # becomes an update difference of lr (a 2e-6 flake in CI); eps 1e-4 keeps the comparison at rounding level
          "--train.eps", "1e-4",
          "--train.trainable", "*.experts.*,*.attn.*,*.router.*,norm.weight",
          "--train.freeze", "*.attn.wq.*,layers.2.ffn.router.*"]


@pytest.fixture(scope="module")
def layout_reference(tmp_path_factory):
    """One process: the curve, the final weights, the initial ones and the selection every layout reuses."""
    from tests.dist_utils import run_trainer

    d = tmp_path_factory.mktemp("freeze_layouts")
    seed = random.randrange(1 << 20)
    _, model = meta_model(hidden_size=32)
    chosen = random_selection([n for n, _ in moe_layers(model)], 16, random.Random())
    flags = [*LAYOUT, "--train.seed", str(seed), "--train.train_experts",
             str(selection_file(d / "sel.json", chosen, 16))]
    r = run_trainer([*flags, "--run-dir", str(d / "one")], 1, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    ckpt = d / "one" / "checkpoints" / "step_000003"
    return {"flags": flags, "chosen": chosen, "losses": losses(d / "one"), "weights": weights(ckpt),
            "init": initial(ckpt, seed)}


def losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("nproc, extra", [
    (4, ["--fsdp", "2", "--ep", "2"]),
    (2, ["--ep", "2", "--layout.rebalance_every", "1", "--layout.expert_replicas", "2"]),
    (2, ["--pp", "2", "--train.micro_batch_size", "2"]),
], ids=["fsdp2-ep2", "ep2-rebalanced-replicas", "pp2"])
def test_partial_training_is_layout_invariant(tmp_path, layout_reference, nproc, extra):
    """FSDP2 with frozen parameters in its units, experts moved between ranks every step (the masks follow the
    slots; replicas share one expert's rows), and pipeline stages: the one-process curve and weights, frozen rows
    still at their initial values."""
    from tests.dist_utils import run_trainer

    ref = layout_reference
    r = run_trainer([*ref["flags"], *extra, "--run-dir", str(tmp_path)], nproc,
                    env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert losses(tmp_path) == pytest.approx(ref["losses"], rel=1e-5, abs=1e-6)
    got = weights(tmp_path / "checkpoints" / "step_000003")
    for name, w in ref["weights"].items():
        if name.endswith("pending_load"):
            continue
        torch.testing.assert_close(got[name], w, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
        if ".experts." in name:
            frozen = torch.ones(w.shape[0], dtype=torch.bool)
            frozen[ref["chosen"][name.split(".experts.")[0]]] = False
            assert torch.equal(got[name][frozen], ref["init"][name][frozen]), name


def test_a_frozen_tied_embedding_under_pipeline_parallelism(tmp_path):
    """The embedding tied to the head sits on the first and the last stage; frozen, neither computes nor exchanges
    a gradient for it, and the run follows one process (with the head trained through the same tensor, the tied
    weight stays)."""
    from tests.dist_utils import run_trainer

    flags = [*LAYOUT[:LAYOUT.index("--train.trainable")], "--model.tie_embeddings", "true", "--train.freeze", "embed.*",
             "--train.seed", str(random.randrange(1 << 20))]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    runs = {}
    for name, nproc, extra in (("one", 1, []), ("pp2", 2, ["--pp", "2", "--train.micro_batch_size", "2"])):
        r = run_trainer([*flags, *extra, "--run-dir", str(tmp_path / name)], nproc, env=env)
        assert r.returncode == 0, r.stderr[-3000:]
        runs[name] = weights(tmp_path / name / "checkpoints" / "step_000003")
    assert losses(tmp_path / "pp2") == pytest.approx(losses(tmp_path / "one"), rel=1e-5, abs=1e-6)
    assert torch.equal(runs["pp2"]["embed.weight"], runs["one"]["embed.weight"])
    init = initial(tmp_path / "one" / "checkpoints" / "step_000003", int(flags[-1]))
    assert torch.equal(runs["one"]["embed.weight"], init["embed.weight"])
    assert not torch.equal(runs["pp2"]["layers.0.attn.wq.weight"], init["layers.0.attn.wq.weight"])


# -- the dry run plans what a partial run holds ------------------------------------------------------------------


@pytest.mark.parametrize("optimizer, ema", [("adamw", False), ("muon", True)])
@pytest.mark.parametrize("layout", [["--world-size", "16", "--fsdp", "2", "--ep", "8"],
                                    ["--world-size", "16", "--pp", "2", "--ep", "8", "--train.micro_batch_size", "1"]],
                         ids=["fsdp-ep", "pp-ep"])
@pytest.mark.parametrize("flags", [["--train.freeze", "*.experts.*"],
                                   ["--train.trainable", "*.attn.*,embed.*,*.router.*"]], ids=["experts", "attention"])
def test_the_dry_run_counts_gradients_and_state_of_what_trains(flags, layout, optimizer, ema):
    """The estimate (config alone, by part) against the recipe's real shards with requires_grad as the run sets it
    (another way to the same bytes): gradients, AdamW / Muon state and the parameter average, exactly."""
    from dataclasses import replace

    from moekit.train.cli import parse_args
    from moekit.train.planning import dryrun, memory

    cfg, opts = parse_args(["--dry-run", "--preset", "mixtral-8x7b", "--batch-size", "16", *layout, *flags,
                            "--train.optimizer", optimizer, *(["--train.ema_decay", "0.9"] if ema else [])])
    plan = dryrun.plan_dry_run(cfg, opts.world_size)
    with dryrun.fake_world(plan.world):
        built = dryrun.build(cfg, plan)
    assert not built.refused and built.freeze.startswith("partial training")
    wl = replace(plan.workload, expert_replicas=built.replicas)
    est = memory.estimate_memory(cfg.model, built.topology.layout, wl, built.stages[0], plan.ranks_per_node,
                                 plan.hierarchical)
    assert est.grads == built.trained * 4 < est.params / 2  # most of the shards are frozen in both cases
    assert est.optimizer == built.optimizer[1]
    full = memory.estimate_memory(cfg.model, built.topology.layout, replace(wl, trainable=()), built.stages[0],
                                  plan.ranks_per_node, plan.hierarchical)
    assert full.grads == est.params and full.optimizer > 4 * est.optimizer


# -- learning-rate multipliers ------------------------------------------------------------------------------------


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_lr_scale_trains_those_parameters_as_a_run_at_the_scaled_lr(tmp_path, capsys, optimizer):
    """One step with clipping off: a parameter at lr x s ends where a whole run at lr x s puts it, the others where
    the run at lr does; the logged lr is the run's own."""
    seed = str(random.randrange(1 << 20))
    common = [*DEEPSEEK, "--train.seed", seed, "--train.optimizer", optimizer, "--steps", "1", "--checkpoint.every",
              "1", "--train.warmup_steps", "1"]
    runs = {}
    for name, flags in (("base", []), ("scaled", ["--train.lr", str(0.01 * 0.25)]),
                        ("mixed", ["--train.lr_scale", "*.router.*=0.25,layers.2.*=0.25"])):
        assert train_main([*common, *flags, "--run-dir", str(tmp_path / name)]) == 0
        runs[name] = weights(tmp_path / name / "checkpoints" / "step_000001")
    out = capsys.readouterr().out
    assert "learning-rate multipliers (--train.lr_scale): x0.25 on" in out
    scaled = lambda n: ".router." in n or n.startswith("layers.2.")  # noqa: E731
    checked = 0
    for n, w in runs["mixed"].items():
        if n.endswith(("pending_load", "expert_bias")):
            continue
        want = runs["scaled" if scaled(n) else "base"][n]
        assert torch.equal(w, want), n
        checked += scaled(n)
    assert checked >= 8 and not torch.equal(runs["scaled"]["layers.2.attn.wq.weight"],
                                            runs["base"]["layers.2.attn.wq.weight"])
    lrs = [json.loads(line)["lr"] for line in (tmp_path / "mixed" / "metrics.jsonl").read_text().splitlines()]
    base = [json.loads(line)["lr"] for line in (tmp_path / "base" / "metrics.jsonl").read_text().splitlines()]
    assert lrs == base


def test_lr_scale_groups_and_errors(tmp_path):
    from moekit.train.plan import make_optimizer

    cfg, model = meta_model()
    model.to_empty(device="cpu")
    cfg.train.lr_scale = "*.router.*=0.1, layers.1.* = 3"
    cfg.train.train_experts = str(selection_file(tmp_path / "s.json", {n: [2] for n, _ in moe_layers(model)}, 16))
    fp = freezing.plan(model, cfg)
    freezing.apply(model, fp)
    groups = make_optimizer(model, cfg, fp).param_groups
    assert "lr_scale" not in groups[0]  # the run's lr first: the trainer logs it from there
    names = {id(p): n for n, p in model.named_parameters()}
    for g in groups:
        for p in g["params"]:
            n = names[id(p)]
            want = 0.1 if ".router." in n else 3.0 if n.startswith("layers.1.") else 1.0
            assert g.get("lr_scale", 1.0) == want and g["lr"] == pytest.approx(cfg.train.lr * want), n
            assert ("row_decay" in g) == (".experts." in n), n
    assert sum(len(g["params"]) for g in groups) == len(names)
    for bad, match in (("*.router.*", "PATTERN=FACTOR"), ("*.router.*=0", "PATTERN=FACTOR"),
                       ("*.router.*=nan", "PATTERN=FACTOR"), ("*.nothing.*=2", "names no parameter"),
                       ("*.router.*=1000", "scaled learning rate must be at most")):
        cfg.train.lr_scale = bad
        with pytest.raises(UserError, match=match):
            freezing.check_lr_scales(model, cfg)
