"""Expert selection for expert-specialised fine-tuning (moekit.train.expert_selection, ``moekit-eval
--select-experts``). The references: ``select`` against the smallest subset over all subsets of the experts
(exact fractions), ExpertRelevance's counts against each router's Routing turned dense (Routing.to_dense) and
its tokens_per_expert, the CLI's token shares against the expert load moekit-eval reports from another record
(moe.load.ExpertLoad), and the file read back by read_selection."""
from __future__ import annotations

import dataclasses
import itertools
import json
import math
import random
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch

from moekit.models.config import ModelConfig
from moekit.models.transformer import build_model
from moekit.moe.load import moe_layers
from moekit.train import UserError, evaluate
from moekit.train.expert_selection import (CRITERIA, DEFAULT_THRESHOLD, FORMAT, TOLERANCE, ExpertRelevance,
                                           read_selection, select, selection_record, write_selection)
from moekit.train.evaluation import mtp_counts
from moekit.train.loop import main as train_main

from tests.helpers import one_stderr_line
from tests.tiny import TINY_MODEL, byte_sets

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


# ---------------------------------------------------------------------------------------------------
# select
# ---------------------------------------------------------------------------------------------------


def smallest_subset(scores: list[int], threshold: float) -> int:
    """The fewest experts any subset needs to hold ``threshold`` of the total (exact arithmetic, every subset)."""
    total = sum(scores)
    need = Fraction(threshold) - Fraction(TOLERANCE)
    for m in range(len(scores) + 1):
        if any(Fraction(sum(c), total) >= need for c in itertools.combinations(scores, m)):
            return m
    raise AssertionError("unreachable: all of them hold the whole")


def test_select_is_the_smallest_set_with_the_highest_scores():
    rng = random.Random()
    for _ in range(300):
        E = rng.randint(1, 9)
        scores = [rng.randint(0, rng.choice([3, 20, 1000])) for _ in range(E)]  # small ranges: many ties and zeros
        if not any(scores):
            scores[rng.randrange(E)] = rng.randint(1, 5)
        total = sum(scores)
        threshold = rng.choice([rng.uniform(1e-6, 1.0), 1.0, Fraction(rng.randint(1, total), total),
                                rng.choice([0.1, 0.2, 0.5])])
        threshold = float(threshold)
        got = select(scores, threshold)
        case = (scores, threshold, got)
        assert got == sorted(set(got)) and all(0 <= e < E for e in got), case
        assert len(got) == smallest_subset(scores, threshold), case
        assert Fraction(sum(scores[e] for e in got), total) >= Fraction(threshold) - Fraction(TOLERANCE), case
        # the highest scores, ties to the lower id; never an expert with score 0
        for s in got:
            assert scores[s] > 0, case
            for u in set(range(E)) - set(got):
                assert scores[u] < scores[s] or (scores[u] == scores[s] and u > s), case
        # shares (floats summing to 1) and raw counts choose alike, lists and arrays alike
        assert select(np.array(scores, dtype=np.float64) / total, threshold) == got, case


def test_select_edges():
    assert select([0.1] * 10, 1.0) == list(range(10))  # the float cumulative sum ends at 0.9999999999999999
    assert select([3, 0, 3, 0], 1.0) == [0, 2]  # zero scores are never needed, even for the whole
    assert select([1, 1, 1, 1], 0.5) == [0, 1]  # exactly half: two reach it; ties to the lower ids
    assert select([1, 1, 1, 1], 0.5 + 1e-9) == [0, 1, 2]
    assert select([0, 0, 5], 1e-9) == [2]
    assert select([2, 7, 7, 1], 0.4) == [1]  # ties at the top (7/17 each): the lower id
    with pytest.raises(UserError, match="layers.3.ffn: no token was routed"):
        select([0, 0, 0], 0.2, layer="layers.3.ffn")
    for bad in (0, 0.0, -0.1, 1.5, math.nan, math.inf, True):
        with pytest.raises(UserError, match=r"threshold .* must be a share in \(0, 1\]"):
            select([1, 2], bad)
    for bad in ([1, -1], [1, math.nan], [[1, 2]]):
        with pytest.raises(ValueError, match="finite numbers >= 0"):
            select(bad, 0.5)


# ---------------------------------------------------------------------------------------------------
# ExpertRelevance
# ---------------------------------------------------------------------------------------------------


def tiny_model(**over) -> torch.nn.Module:
    cfg = ModelConfig(**{**dict(hidden_size=32, num_layers=3, num_heads=2, num_kv_heads=1, ffn_hidden_size=64,
                                moe_ffn_hidden_size=16, num_experts=6, top_k=2, max_seq_len=64, vocab_size=64),
                         **over})
    model = build_model(cfg)
    model.init_weights(seed=random.randrange(1 << 30))
    return model.eval()


MODELS = {
    "topk": {},
    # sigmoid scores, normalised over the top-k and scaled (DeepSeek-V3's gate), a dense first layer, an MTP depth
    "sigmoid": dict(num_experts=8, top_k=3, first_dense_layers=1, mtp_layers=1,
                    router_options={"score": "sigmoid", "normalize": True, "scaling": 2.5}),
    # half the slots fit: capacity drops many of them
    "capacity": dict(top_k=2, capacity_factor=0.5),
    "switch": dict(router="switch", top_k=1, capacity_factor=0.75),
}


def poison_dropped_weights(_module, _args, routing):
    """A router hook ahead of ExpertRelevance's: weight 5 in every dropped slot, which must count for nothing."""
    return dataclasses.replace(routing, weights=torch.where(routing.indices < 0, 5.0, routing.weights))


@pytest.mark.parametrize("kind", list(MODELS))
def test_relevance_counts_are_the_routings(kind):
    model = tiny_model(**MODELS[kind])
    layers = dict(moe_layers(model))
    handles = [layer.router.register_forward_hook(poison_dropped_weights) for layer in layers.values()]
    relevance = ExpertRelevance().attach(model)
    seen: dict[str, list] = {name: [] for name in layers}  # every Routing each router returned, as the layer saw it
    handles += [layer.router.register_forward_hook(lambda _m, _a, r, name=name: seen[name].append(r))
                for name, layer in layers.items()]
    rng = torch.Generator().manual_seed(random.randrange(1 << 30))
    tokens = 0
    with torch.no_grad():
        for b, S in ((3, 17), (1, 40), (4, 9)):
            x = torch.randint(0, model.config.vocab_size, (b, S), generator=rng)
            relevance.begin_batch(x)
            logits, hidden = model(x, return_hidden=True)
            if model.mtp:  # the MTP depth routes too, as moekit-eval runs it
                mtp_counts(model, x, torch.randint(0, model.config.vocab_size, (b, S), generator=rng), logits, hidden)
            tokens += x.numel()
    relevance.detach()
    for h in handles:
        h.remove()
    result = relevance.result()
    assert result["tokens"] == tokens
    assert [layer["name"] for layer in result["layers"]] == list(layers)
    if kind == "sigmoid":
        assert list(layers) == ["layers.1.ffn", "layers.2.ffn", "mtp.0.block.ffn"]
    dropped_total = 0
    for layer in result["layers"]:
        name, E = layer["name"], layers[layer["name"]].num_experts
        assert seen[name], name
        slots, gate, dropped = np.zeros(E, np.int64), np.zeros(E), 0
        for r in seen[name]:
            probs, mask = r.to_dense(E)
            slots += mask.sum(0).numpy()
            gate += probs.double().sum(0).numpy()
            dropped += int((r.indices < 0).sum())
            assert (r.tokens_per_expert.numpy() == mask.sum(0).numpy()).all()
            assert (r.weights[r.indices < 0] == 5.0).all()
        assert layer["experts_count"] == E and layer["slots"] == slots.tolist(), name
        assert layer["dropped"] == dropped and layer["tokens"] == sum(r.indices.shape[0] for r in seen[name])
        np.testing.assert_allclose(layer["gate"], gate, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(layer["token_share"], slots / slots.sum(), rtol=1e-12)
        np.testing.assert_allclose(layer["gate_share"], gate / gate.sum(), rtol=1e-5, atol=1e-7)
        assert math.isclose(sum(layer["token_share"]), 1) and math.isclose(sum(layer["gate_share"]), 1)
        dropped_total += dropped
    assert (dropped_total > 0) == (kind in ("capacity", "switch"))
    # the record selects by the chosen share (reap needs the saliency pass: its own test)
    for criterion in ("token", "gate"):
        threshold = random.uniform(0.05, 1.0)
        record = selection_record(result, criterion, threshold, model.config.name, {"path": "x"})
        for layer, rec in zip(result["layers"], record["layers"]):
            assert rec["selected"] == select(layer[f"{criterion}_share"], threshold)
            assert rec["covered"] == pytest.approx(sum(layer[f"{criterion}_share"][e] for e in rec["selected"]),
                                                   rel=1e-5)


def test_a_layer_without_tokens_is_named():
    """The MTP depth runs only when asked: a selection from the main forward alone cannot choose its experts."""
    model = tiny_model(**MODELS["sigmoid"])
    relevance = ExpertRelevance().attach(model)
    with torch.no_grad():
        model(torch.randint(0, 64, (2, 8)))
    relevance.detach()
    result = relevance.result()
    assert result["tokens"] == 16  # no begin_batch: the most tokens a layer routed
    assert result["layers"][-1]["slots"] == [0] * 8 and result["layers"][-1]["token_share"] == [0.0] * 8
    with pytest.raises(UserError, match="MoE layer mtp.0.block.ffn: no token was routed"):
        selection_record(result, "token", 0.2, "m", {})


def test_a_dense_model_has_nothing_to_select():
    model = tiny_model(num_experts=0)
    assert not list(moe_layers(model))
    with pytest.raises(UserError, match="no MoE layers"):
        ExpertRelevance().attach(model)


# ---------------------------------------------------------------------------------------------------
# The file
# ---------------------------------------------------------------------------------------------------


def a_record(E: dict[str, int] | None = None) -> dict:
    """A selection record of random shares for layers of ``E`` experts each."""
    E = E or {"layers.0.ffn": 8, "layers.1.ffn": 8, "mtp.0.block.ffn": 4}
    layers = []
    for name, n in E.items():
        slots = np.random.default_rng().integers(1, 50, n)
        gate = slots * np.random.default_rng().uniform(0.5, 1, n)
        layers.append({"name": name, "experts_count": n, "slots": slots.tolist(), "gate": gate.tolist(),
                       "token_share": (slots / slots.sum()).tolist(), "gate_share": (gate / gate.sum()).tolist()})
    return selection_record({"tokens": 123, "layers": layers}, "gate", 0.3, "tiny", {"path": "run", "step": 4})


def test_the_file_round_trips_and_is_one_line_per_layer(tmp_path):
    record = a_record()
    path = tmp_path / "esft.json"
    write_selection(path, record)
    assert json.loads(path.read_text()) == record
    lines = path.read_text().splitlines()
    for layer in record["layers"]:  # each layer on a line of its own, "selected" near its start: easy to edit
        line = next(ln for ln in lines if f'"name": "{layer["name"]}"' in ln)
        assert line.index('"selected"') < line.index('"token_share"')
    shape = {layer["name"]: layer["experts_count"] for layer in record["layers"]}
    assert read_selection(path, shape) == {layer["name"]: tuple(layer["selected"]) for layer in record["layers"]}
    assert not list(tmp_path.glob("*.partial"))
    # hand edits: an empty list (no expert of the layer trains), ids in any order
    record["layers"][0]["selected"] = []
    record["layers"][1]["selected"] = [5, 0, 3]
    path.write_text(json.dumps(record))
    got = read_selection(str(path), shape)
    assert got["layers.0.ffn"] == () and got["layers.1.ffn"] == (0, 3, 5)


def edit(record: dict, layer: int | None = None, **changes) -> dict:
    record = json.loads(json.dumps(record))
    (record if layer is None else record["layers"][layer]).update(changes)
    return record


BAD_FILES = [
    (None, "cannot read it: No such file or directory"),
    ("{not json", "not JSON"),
    (b"\xff\xfe{}", "not UTF-8 text"),
    ([1, 2], "not an expert selection file (format 'list'"),
    (lambda r: edit(r, format="moekit-specialisation"), "format 'moekit-specialisation', expected "
                                                        "'moekit-expert-selection'"),
    (lambda r: edit(r, version=2), "version 2 is not supported"),
    (lambda r: edit(r, layers={"layers.0.ffn": [1]}), '"layers" must be a list'),
    (lambda r: edit(r, layers=r["layers"][:1] + r["layers"][2:]), "no entry for the model's MoE layer layers.1.ffn"),
    (lambda r: edit(r, layers=r["layers"] + [dict(r["layers"][0], name="layers.7.ffn")]),
     "layer layers.7.ffn is not a MoE layer of the model"),
    (lambda r: edit(r, layers=r["layers"] + r["layers"][:1]), "layer layers.0.ffn is listed twice"),
    (lambda r: edit(r, 2, experts_count=8), "layer mtp.0.block.ffn has experts_count 8, the model's has 4 experts"),
    (lambda r: edit(r, 0, experts_count=None), "layer layers.0.ffn has experts_count None"),
    (lambda r: edit(r, 0, selected="1,2"), "layer layers.0.ffn: \"selected\" must be a list of expert ids"),
    (lambda r: edit(r, 1, selected=None), "layer layers.1.ffn: \"selected\" must be a list"),
    (lambda r: edit(r, 2, selected=[0, 4]), "layer mtp.0.block.ffn: expert id 4 is invalid; ids are integers 0..3"),
    (lambda r: edit(r, 0, selected=[-1]), "expert id -1 is invalid"),
    (lambda r: edit(r, 0, selected=[1.0]), "expert id 1.0 is invalid"),
    (lambda r: edit(r, 0, selected=["3"]), "expert id '3' is invalid"),
    (lambda r: edit(r, 0, selected=[True]), "expert id True is invalid"),
    (lambda r: edit(r, 1, selected=[2, 6, 2]), "layer layers.1.ffn: expert 2 is selected twice"),
]


@pytest.mark.parametrize("content, message", BAD_FILES, ids=range(len(BAD_FILES)))
def test_bad_selection_files_name_the_file_and_the_fix(tmp_path, content, message):
    record = a_record()
    path = tmp_path / "sel.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif isinstance(content, str):
        path.write_text(content)
    elif content is not None:
        path.write_text(json.dumps(content(record) if callable(content) else content))
    shape = {layer["name"]: layer["experts_count"] for layer in record["layers"]}
    with pytest.raises(UserError) as info:
        read_selection(path, shape)
    text = str(info.value)
    assert message in text and str(path) in text, text
    fixes = ("--select-experts", "keep one entry", "list each expert once", "ids are integers", "list of expert ids")
    assert any(f in text for f in fixes), text  # and how to mend it


# ---------------------------------------------------------------------------------------------------
# moekit-eval --select-experts
# ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A tiny run (one step: the weights matter little, routing them does) and a task's token file."""
    root = tmp_path_factory.mktemp("esft")
    byte_sets(root, [("train", 6000, "abcdefgh ij\n", []), ("task", 2400, "abc defg\n", [])])
    assert train_main([*TINY_MODEL, "--steps", "1", "--run-dir", str(root / "run"), "--log.progress", "off",
                       "--data.path", str(root / "train.bin")]) == 0
    return root / "run"


def test_eval_writes_a_selection_the_trainer_can_read(run, tmp_path, capsys):
    task = run.parent / "task.bin"
    path, out = tmp_path / "sel" / "esft.json", tmp_path / "eval.json"
    threshold = round(random.uniform(0.1, 0.9), 3)
    assert evaluate.main([str(run), "--data", str(task), "--split", "all", "--select-experts", str(path),
                          "--select-threshold", str(threshold), "--out", str(out), "--batch-size", "16"]) == 0
    stdout = capsys.readouterr().out
    result = json.loads(out.read_text())
    record = json.loads(path.read_text())
    assert record["format"] == FORMAT and record["version"] == 1 and record["criterion"] == "token"
    assert record["threshold"] == threshold and record["model"] == result["model"]
    assert record["tokens"] == result["windows"] * result["seq_len"] > 0
    assert record["source"]["split"] == "all" and record["source"]["data"] == result["data"]
    assert record["source"]["step"] == 1 and record["source"]["checkpoint"] == result["checkpoint"]
    # every MoE layer, with the token shares of the expert load moekit-eval reports from its own record
    load = {layer["name"]: layer["tokens_per_expert"] for layer in result["expert_load"]["layers"]}
    assert [layer["name"] for layer in record["layers"]] == list(load) == ["layers.0.ffn", "layers.1.ffn"]
    for layer in record["layers"]:
        counts = np.array(load[layer["name"]], dtype=np.float64)
        E = layer["experts_count"]
        assert E == counts.size
        np.testing.assert_allclose(layer["token_share"], counts / counts.sum(), rtol=1e-5)
        for key in ("token_share", "gate_share"):
            assert sum(layer[key]) == pytest.approx(1, abs=1e-5)
        share = np.array(layer["token_share"])
        chosen = layer["selected"]
        assert chosen == sorted(chosen) and share[chosen].sum() >= threshold - 1e-5  # reaches it
        assert share[chosen].sum() - share[chosen].min() < threshold + 1e-5  # one fewer would not
        assert all(share[u] <= share[chosen].min() + 1e-6 for u in set(range(E)) - set(chosen))
        assert layer["covered"] == pytest.approx(share[chosen].sum(), abs=1e-5)
        assert f"{len(chosen)}/{E}" in stdout and " ".join(map(str, chosen)) in stdout
    shape = {layer["name"]: layer["experts_count"] for layer in record["layers"]}
    assert read_selection(path, shape) == {layer["name"]: tuple(layer["selected"]) for layer in record["layers"]}
    summary = result["expert_selection"]
    assert summary["path"] == str(path) and (summary["criterion"], summary["threshold"]) == ("token", threshold)
    assert [(s["name"], s["selected"]) for s in summary["layers"]] == [(r["name"], len(r["selected"]))
                                                                      for r in record["layers"]]
    assert f"--train.trainable '*.experts.*' --train.train_experts {path}" in stdout


def test_eval_gate_selection_beside_specialisation(run, tmp_path, capsys):
    """Two observers on the same forwards: the specialisation's expert shares are the selection's token shares;
    at threshold 1 every expert with any gate weight is selected."""
    path, out = tmp_path / "esft.json", tmp_path / "eval.json"
    assert evaluate.main([str(run), "--max-tokens", "640", "--select-experts", str(path), "--select-by", "gate",
                          "--select-threshold", "1", "--specialisation", "--out", str(out), "--quiet"]) == 0
    assert capsys.readouterr().out == ""
    record, result = json.loads(path.read_text()), json.loads(out.read_text())
    assert record["criterion"] == "gate" and record["threshold"] == 1.0 and record["source"]["split"] == "val"
    spec = {layer["name"]: layer for layer in result["specialisation"]["layers"]}
    assert record["tokens"] == result["specialisation"]["tokens"] == result["windows"] * result["seq_len"] > 0
    for layer in record["layers"]:
        np.testing.assert_allclose(layer["token_share"], spec[layer["name"]]["expert_share"], rtol=1e-5)
        assert layer["selected"] == [e for e, g in enumerate(layer["gate_share"]) if g > 0]
        assert layer["covered"] == pytest.approx(1)


def test_the_flags_defaults_are_the_modules():
    assert evaluate.CRITERIA == CRITERIA and evaluate.DEFAULT_THRESHOLD == DEFAULT_THRESHOLD
    args = evaluate.build_parser().parse_args(["x", "--select-experts", "f.json"])
    assert (args.select_by, args.select_threshold) == (None, None)  # None: not given (refused without the file)


@pytest.mark.parametrize("argv, words", [
    (["--select-experts", "{tmp}/s.json", "--select-threshold", "0"], "--select-threshold 0 is invalid"),
    (["--select-experts", "{tmp}/s.json", "--select-threshold", "1.5"], "--select-threshold 1.5 is invalid"),
    (["--select-experts", "{tmp}/s.json", "--select-threshold", "nan"], "--select-threshold nan is invalid"),
    (["--select-experts", "{tmp}/s.json", "--select-by", "slots"], "argument --select-by: invalid choice"),
    (["--select-by", "gate"], "--select-by sets how --select-experts chooses experts; it needs --select-experts"),
    (["--select-threshold", "0.3"], "--select-threshold sets how --select-experts chooses"),
    (["--select-experts", "{tmp}/s.json", "--tasks", "@next-line"], "--select-experts is for the loss evaluation"),
    (["--select-experts", "{tmp}"], "--select-experts {tmp}: a directory; name the JSON file to write"),
    (["--select-experts", "{tmp}/file/s.json"], "--select-experts {tmp}/file: exists and is not a directory"),
])
def test_eval_selection_bad_flags_are_one_line(run, tmp_path, capsys, argv, words):
    (tmp_path / "file").write_text("")
    before = sorted(tmp_path.rglob("*"))
    rc = evaluate.main([str(run), *(a.replace("{tmp}", str(tmp_path)) for a in argv)])
    one_stderr_line(capsys, words.replace("{tmp}", str(tmp_path)))
    assert rc == 2 and sorted(tmp_path.rglob("*")) == before  # refused before any work: nothing written


@pytest.mark.parametrize("kind", ["topk", "capacity"])
def test_reap_saliency_is_the_mean_gate_times_output_norm(kind):
    """REAP's score against each slot's expert computed from its weights in float64 (x @ w_in, the activation,
    @ w_out) times the slot's gate weight, averaged over the expert's kept slots; dropped slots count nowhere."""
    from moekit.moe.activations import get_activation

    model = tiny_model(**MODELS[kind])
    layers = dict(moe_layers(model))
    relevance = ExpertRelevance(saliency=True).attach(model)
    seen: dict[str, list] = {name: [] for name in layers}
    handles = [layer.router.register_forward_hook(lambda _m, a, r, name=name: seen[name].append((a[0], r)))
               for name, layer in layers.items()]
    rng = torch.Generator().manual_seed(random.randrange(1 << 30))
    with torch.no_grad():
        for b, S in ((2, 19), (3, 8)):
            model(torch.randint(0, model.config.vocab_size, (b, S), generator=rng))
    relevance.detach()
    for h in handles:
        h.remove()
    for layer in relevance.result()["layers"]:
        ex = layers[layer["name"]].experts
        act = get_activation(ex.activation)
        E = ex.w_in.shape[0]
        total, slots = np.zeros(E), np.zeros(E)
        for x, r in seen[layer["name"]]:
            for t, k in itertools.product(range(x.shape[0]), range(r.indices.shape[1])):
                e = int(r.indices[t, k])
                if e < 0:
                    continue
                with torch.no_grad():
                    f = act(x[t].double() @ ex.w_in[e].double()) @ ex.w_out[e].double()
                total[e] += float(r.weights[t, k]) * float(f.norm())
                slots[e] += 1
        want = np.divide(total, slots, out=np.zeros(E), where=slots > 0)
        np.testing.assert_allclose(layer["reap"], want, rtol=1e-4, atol=1e-9)
        np.testing.assert_allclose(layer["reap_share"], want / want.sum(), rtol=1e-4)


def test_select_by_reap_writes_its_shares_and_prune_reads_them(tmp_path, capsys):
    from moekit.train.convert import main as convert_main

    run = tmp_path / "run"
    assert train_main([*TINY_MODEL, "--steps", "2", "--checkpoint.every", "2", "--run-dir", str(run)]) == 0
    plain, reap = tmp_path / "plain.json", tmp_path / "reap.json"
    assert evaluate.main([str(run), "--max-tokens", "256", "--select-experts", str(plain), "--quiet"]) == 0
    assert evaluate.main([str(run), "--max-tokens", "256", "--select-experts", str(reap), "--select-by", "reap",
                          "--quiet"]) == 0
    record = json.loads(reap.read_text())
    assert record["criterion"] == "reap" and all(len(layer["reap_share"]) == 8 for layer in record["layers"])
    assert all("reap_share" not in layer for layer in json.loads(plain.read_text())["layers"])
    capsys.readouterr()
    assert convert_main(["prune", str(run), "--scores", str(reap), "--by", "reap", "--keep", "6", "-o",
                         str(tmp_path / "p.safetensors")]) == 0
    assert convert_main(["prune", str(run), "--scores", str(plain), "--by", "reap", "--keep", "6", "-o",
                         str(tmp_path / "q.safetensors")]) == 2
    one_stderr_line(capsys, "has no reap_share", "--select-by reap")
