"""Expert pruning (moekit.train.pruning, moekit-convert prune): the kept experts and their router rows, a token whose
experts survive computed as before, the program end to end, and its refusals."""
from __future__ import annotations

import dataclasses
import itertools
import json
import random
from pathlib import Path

import pytest
import torch

from moekit.models.config import preset
from moekit.models.init import init_weights
from moekit.models.transformer import Transformer
from moekit.moe.load import moe_layers
from moekit.train import UserError
from moekit.train.convert import main as convert_main
from moekit.train.evaluate import main as eval_main
from moekit.train.loop import main as train_main
from moekit.train.modelfiles import load_moekit
from moekit.train.pruning import check_prunable, kept_experts, prune
from tests.helpers import gen, one_stderr_line
from tests.tiny import TINY_MODEL


def brute_kept(shares: list[float], keep: int, groups: int) -> list[int]:
    """Another way: per group, the subset of keep / groups experts with the largest total share, the
    lexicographically smallest ids among equal totals (the same tie rule as one expert at a time)."""
    size = len(shares) // groups
    out = []
    for g in range(groups):
        ids = range(g * size, (g + 1) * size)
        best = max(itertools.combinations(ids, keep // groups),
                   key=lambda c: (sum(sorted((shares[e] for e in c), reverse=True)), [-e for e in c]))
        out += best
    return sorted(out)


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_kept_experts_are_the_best_of_each_group(groups):
    rng = random.Random()
    for _ in range(50):
        E = 8
        # few distinct values: ties happen
        shares = [rng.choice([0.0, 0.05, 0.1, 0.2, 0.3]) for _ in range(E)]
        keep = groups * rng.randint(1, E // groups - 1) if E // groups > 1 else groups
        got = kept_experts(shares, keep, groups)
        assert len(got) == keep and got == sorted(set(got))
        want = brute_kept(shares, keep, groups)
        assert sorted(shares[e] for e in got) == sorted(shares[e] for e in want), (shares, keep, got, want)


def allowed_groups(model, x) -> dict[str, torch.Tensor]:
    """Each layer's [T, G] groups a token may use (group-limited routing), from the router's own pieces."""
    import torch.nn.functional as F

    out = {}
    for name, layer in moe_layers(model):
        r = layer.router
        choice = r.scores(F.linear(x[0], r.weight)) + r.expert_bias
        out[name] = torch.isfinite(r.limit_groups(choice).view(x.shape[1], r.num_groups, -1)).any(-1)
    return out


def layer_io(model, x):
    """Each MoE layer's output for the same input x [1, T, H], and its routing's expert ids [T, k]."""
    out = {}
    for name, layer in moe_layers(model):
        seen = {}
        handle = layer.router.register_forward_hook(lambda _m, _a, r: seen.setdefault("r", r))
        with torch.no_grad():
            y = layer(x)
        handle.remove()
        out[name] = (y[0], seen["r"].indices)
    return out


@pytest.mark.parametrize("name", ["mixtral-tiny", "deepseek-tiny", "gpt-oss-tiny", "llama4-tiny"])
def test_a_token_whose_experts_survive_is_computed_as_before(name):
    """Renormalised softmax top-k (mixtral, gpt-oss with its gate bias), sigmoid with groups and the aux-loss-free
    bias (deepseek), sigmoid top-1 (llama 4): every layer keeps the 3/4 of its experts the input uses most; a token whose chosen
    experts all remain gets the same output (up to rounding); the others are routed among the kept experts."""
    cfg = preset(name)
    model = Transformer(cfg)
    init_weights(model, random.randrange(1 << 20))
    for _, layer in moe_layers(model):  # a trained-looking aux-loss-free bias, not zeros
        bias = getattr(layer.router, "expert_bias", None)
        if bias is not None:
            bias.copy_(torch.randn(bias.shape, generator=gen(name, "bias")) * 0.1)
    model.eval()
    E = cfg.num_experts
    keep = 3 * E // 4  # deepseek-tiny: 3 of each group of 4
    groups = check_prunable(model, keep)
    x = torch.randn(1, 512, cfg.hidden_size, generator=gen(name))
    before = layer_io(model, x)
    # keep the most used (as calibration would), ties broken by a random score: few tokens survive otherwise
    rng = random.Random()
    kept = {n: kept_experts([float((idx == e).sum()) + rng.random() for e in range(E)], keep, groups)
            for n, (_, idx) in before.items()}
    small = prune(model, kept)
    assert small.config.num_experts == keep and small.config.top_k == cfg.top_k
    after = layer_io(small, x)
    grouped = groups > 1 and (allowed_groups(model, x), allowed_groups(small, x))
    same = 0
    for layer_name, (y0, idx0) in before.items():
        y1, idx1 = after[layer_name]
        keep = torch.tensor(kept[layer_name])
        back = keep[idx1]  # the pruned model's choices in the source's expert ids
        assert torch.isin(back, keep).all()
        survive = torch.isin(idx0, keep).all(dim=1)
        if grouped:  # a group scores by its best experts: one it lost may hand its place to another group
            kept_groups = (grouped[0][layer_name] == grouped[1][layer_name]).all(dim=1)
            survive &= kept_groups  # with its groups kept, a survivor keeps its experts (below)
        assert survive.sum() < len(survive), layer_name  # some tokens lost an expert (and below: some did not)
        assert torch.equal(back[survive].sort(dim=1).values, idx0[survive].sort(dim=1).values)
        # the same experts and weights; the GEMMs see other shapes (fewer gate rows, other groups), so rounding
        torch.testing.assert_close(y1[survive], y0[survive], rtol=1e-5, atol=1e-6, msg=layer_name)
        assert not torch.allclose(y1[~survive], y0[~survive], rtol=1e-3, atol=1e-5)
        same += int(survive.sum())
    assert same > 0.2 * 512 * len(before)  # most layers keep most tokens' experts


def test_switch_keeps_the_choice_and_grows_the_weights():
    """Softmax over all experts without renormalisation: a surviving token's expert is the same and its weight is
    its probability among the kept experts, p / (1 - the dropped experts' share)."""
    cfg = dataclasses.replace(preset("switch-tiny"), capacity_factor=None)  # inference routes dropless
    model = Transformer(cfg)
    init_weights(model, random.randrange(1 << 20))
    model.eval()
    name, layer = next(iter(moe_layers(model)))
    kept = {n: [0, 2, 3, 5, 6, 7] for n, _ in moe_layers(model)}
    small = prune(model, kept)
    x = torch.randn(200, cfg.hidden_size, generator=gen("switch"))
    with torch.no_grad():
        r0 = layer.router(x)
        r1 = dict(moe_layers(small))[name].router(x)
        probs = torch.softmax(x @ layer.router.weight.T, dim=-1)
    keep = torch.tensor(kept[name])
    survive = torch.isin(r0.indices[:, 0], keep)
    assert torch.equal(keep[r1.indices[survive, 0]], r0.indices[survive, 0])
    want = probs[survive].gather(1, r0.indices[survive]) / probs[survive][:, keep].sum(1, keepdim=True)
    torch.testing.assert_close(r1.weights[survive].float(), want, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def scored_run(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny trained run and moekit-eval's scores of its experts on all of its data."""
    d = tmp_path_factory.mktemp("prune")
    run = d / "run"
    assert train_main([*TINY_MODEL, "--steps", "3", "--checkpoint.every", "3", "--run-dir", str(run)]) == 0
    scores = d / "scores.json"
    assert eval_main([str(run), "--split", "all", "--max-tokens", "2048", "--select-experts", str(scores)]) == 0
    return run, scores


@pytest.mark.parametrize("out_name", ["pruned.safetensors", "hf"])
def test_the_program_keeps_the_best_rows_and_writes_a_model(scored_run, tmp_path, capsys, out_name):
    run, scores = scored_run
    out = tmp_path / out_name
    capsys.readouterr()
    assert convert_main(["prune", str(run), "--scores", str(scores), "--keep", "5", "--by", "gate", "-o", str(out),
                         "--verify"]) == 0
    printed = capsys.readouterr().out
    assert "8 -> 5 experts per MoE layer" in printed and "keeps the logits" in printed
    source = load_moekit(run / "checkpoints" / "step_000003")
    record = json.loads(scores.read_text())
    if out_name == "hf":
        from moekit.models.hf import load_hf

        small = load_hf(out, dtype=torch.float32)
        assert (out / "tokenizer.json").is_file()  # the run's tokenizer went along
    else:
        small = load_moekit(out)
    assert small.config.num_experts == 5
    src_layers, small_layers = dict(moe_layers(source)), dict(moe_layers(small))
    for entry in record["layers"]:
        shares = entry["gate_share"]
        keep = sorted(sorted(range(8), key=lambda e: (-shares[e], e))[:5])
        assert f"experts {' '.join(map(str, keep))}" in printed
        a, b = src_layers[entry["name"]], small_layers[entry["name"]]
        assert torch.equal(b.router.weight, a.router.weight[keep])
        for p in a.experts.param_names():
            assert torch.equal(getattr(b.experts, p), getattr(a.experts, p)[keep])
    assert torch.equal(small.layers[0].attn.wq.weight, source.layers[0].attn.wq.weight)


@pytest.mark.parametrize("args, words", [
    (["--keep", "8"], ["--keep 8 is invalid", "between 1 and 7"]),
    (["--keep", "1"], ["--keep 1 is fewer than the 2 experts each token is routed to"]),
    (["--keep", "4", "--scores", "missing.json"], ["--scores missing.json: no such file", "--select-experts"]),
    (["--keep", "4", "--by", "load"], ["--by", "invalid choice"]),
], ids=["all", "below-top-k", "no-scores", "bad-criterion"])
def test_bad_requests_are_one_line(scored_run, tmp_path, capsys, args, words):
    run, scores = scored_run
    base = ["prune", str(run), "--scores", str(scores), "-o", str(tmp_path / "p.safetensors")]
    capsys.readouterr()
    assert convert_main([*base, *args]) == 2
    one_stderr_line(capsys, *words)
    assert not (tmp_path / "p.safetensors").exists()


def test_scores_of_another_model_and_unprunable_models_are_refused(scored_run, tmp_path):
    from moekit.train.pruning import read_scores

    _, scores = scored_run
    with pytest.raises(UserError, match="experts_count 8, the model's has 16"):
        read_scores(scores, {"layers.0.ffn": 16, "layers.1.ffn": 16}, "token")
    model = Transformer(preset("deepseek-tiny"))  # 4 groups of 4 experts, a token in 2 groups, top_k 4
    with pytest.raises(UserError, match="use a multiple of 4"):
        check_prunable(model, 6)
    assert check_prunable(model, 8) == 4
    hashed = Transformer(_hash_config())
    with pytest.raises(UserError, match="hash routing"):
        check_prunable(hashed, 4)


def _hash_config():
    cfg = preset("mixtral-tiny")
    cfg.set_router("hash")
    cfg.top_k = 1
    return cfg


def test_the_programs_read_a_model_file_with_a_tokenizer_folder(scored_run, tmp_path, capsys):
    """A moekit model file (what prune, average and hf-to-moekit write) in moekit-eval and moekit-generate: the same
    loss and the same greedy tokens as the same model written as an HF folder; --tokenizer names its tokenizer."""
    from moekit.train.generate import main as generate_main

    run, scores = scored_run
    file, folder = tmp_path / "p.safetensors", tmp_path / "p_hf"
    for out in (file, folder):
        assert convert_main(["prune", str(run), "--scores", str(scores), "--keep", "6", "-o", str(out)]) == 0
    results = {}
    for src, extra in ((file, ["--tokenizer", str(run)]), (folder, [])):
        out = tmp_path / f"{src.name}.json"
        assert eval_main([str(src), *extra, "--max-tokens", "1024", "--seq-len", "32", "--out", str(out),
                          "--quiet"]) == 0
        results[src] = json.loads(out.read_text())
        capsys.readouterr()
        assert generate_main([str(src), *extra, "--prompt", "def main(", "--max-new-tokens", "12",
                              "--temperature", "0"]) == 0
        results[src]["text"] = capsys.readouterr().out
    a, b = results[file], results[folder]
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-6) and a["tokens"] == b["tokens"] > 0
    assert a["text"] == b["text"] and a["text"].startswith("def main(")
    assert a["bits_per_byte"] == pytest.approx(b["bits_per_byte"], rel=1e-6)  # the run's tokenizer: bytes
    # without --tokenizer: the loss alone in moekit-eval, one line in moekit-generate; --tokenizer elsewhere refused
    assert eval_main([str(file), "--max-tokens", "256", "--seq-len", "32", "--quiet"]) == 0
    capsys.readouterr()
    assert generate_main([str(file), "--prompt", "x"]) == 2
    one_stderr_line(capsys, "a moekit model file, which records no tokenizer", "--tokenizer DIR")
    assert generate_main([str(folder), "--tokenizer", str(run), "--prompt", "x"]) == 2
    one_stderr_line(capsys, "carries its own tokenizer")
