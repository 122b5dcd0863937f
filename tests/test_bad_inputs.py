"""Bad input ends in a correct result or one clear line (issue 14, "reliability round 2").

Each class of input gets several variants: a config file that cannot be read, config.json read back,
fields of the wrong type in TOML / JSON, router options of the wrong type, custom routers that fail to
import or build or that return ids outside [0, E), absurd learning rates, an expert backend that cannot
run here, and second-order gradients through SwiGLU. CLI cases run ``moekit.train.loop.main(argv)``
in-process and check: exit 2, exactly one stderr line ``train.py: error: ...`` naming the value, no
traceback, no run directory; one runs ``python tools/train.py`` to check that no traceback leaks.
Numerical cases draw fresh random inputs; the seed is in every assertion message.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from moekit.train.records import load_rows
import torch
import torch.nn.functional as F

from moekit.moe import MoELayer
from moekit.moe.activations import swiglu
from moekit.moe.router import Router, Routing, build_router
from moekit.train.loop import main
from tests.test_no_host_sync import host_syncs

ROOT = Path(__file__).resolve().parents[1]
TINY = ("--model.hidden_size 16 --model.num_layers 1 --model.num_heads 2 --model.num_kv_heads 1 "
        "--model.ffn_hidden_size 16 --model.moe_ffn_hidden_size 16 --model.max_seq_len 16 --train.seq_len 8 "
        "--batch-size 2 --eval.sequences 2 --log.tensorboard false --log.progress off --checkpoint.every 0").split()


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)


def refused(capsys, run: Path, argv: list[str], *expected: str) -> str:
    """main(argv + --run-dir run) exits 2 with one line containing every ``expected``; no run dir, no traceback."""
    rc = main([*argv, "--run-dir", str(run)])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert rc == 2, err
    assert len(lines) == 1 and lines[0].startswith("train.py: error: "), err
    assert "Traceback" not in err
    for text in expected:
        assert text in lines[0], (text, lines[0])
    assert not run.exists()  # refused before any work
    return lines[0]


def fresh_seed() -> int:
    return random.SystemRandom().randrange(2**31)


# ---------------------------------------------------------------------------------------------------
# 1. --config FILE that cannot be read
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,content,expected", [
    ("latin1.toml", "[train]\n# caf\xe9\nsteps = 3\n".encode("latin-1"), "not UTF-8 text (byte 0xe9 at offset 13)"),
    ("bom16.toml", "[train]\nsteps = 3\n".encode("utf-16"), "not UTF-8 text (byte 0xff at offset 0)"),
    ("binary.json", bytes(range(256)), "not UTF-8 text (byte 0x80"),
    ("bad.toml", b"[train\nsteps = 3\n", "invalid TOML"),
    ("bad.json", b'{"train": {"steps": 3,}}', "invalid JSON"),
    ("array.json", b"[1, 2]", "expected a JSON object"),
])
def test_unreadable_config_files(tmp_path, capsys, name, content, expected):
    path = tmp_path / name
    path.write_bytes(content)
    refused(capsys, tmp_path / "run", ["--config", str(path)], f"--config {path}: {expected}")


def test_config_directory_missing_or_empty_path(tmp_path, capsys):
    run = tmp_path / "run"
    refused(capsys, run, ["--config", str(tmp_path)], f"--config {tmp_path}: is a directory")
    refused(capsys, run, ["--config", str(tmp_path / "nope.toml")], "nope.toml: file not found")
    refused(capsys, run, ["--config", ""], "--config '': file not found")


def test_utf8_with_byte_order_mark_is_read(tmp_path, capsys):
    path = tmp_path / "bom.toml"
    path.write_bytes(b"\xef\xbb\xbf[train]\nsteps = 3\n")
    assert main(["--config", str(path), "--print-config"]) == 0
    assert "\nsteps = 3\n" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------------
# 2. A run directory's config.json reads back to the same config
# ---------------------------------------------------------------------------------------------------


def print_config(capsys, *argv: str) -> str:
    rc = main([*argv, "--print-config"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return out


def test_config_json_of_a_run_reads_back(tmp_path, capsys):
    flags = [*TINY, "--steps", "1", "--capacity-factor", "1.5", "--train.lr", "0.002",
             "--model.router_options.scaling", "0.5", "--run-dir", str(tmp_path / "run")]
    assert main(flags) == 0
    capsys.readouterr()
    original = print_config(capsys, *flags)
    saved = tmp_path / "run" / "config.json"
    assert print_config(capsys, "--config", str(saved)) == original
    renamed = tmp_path / "config.txt"  # JSON by content, whatever the name
    renamed.write_text(saved.read_text())
    assert print_config(capsys, "--config", str(renamed)) == original
    # flags still beat the file
    assert "\nsteps = 5\n" in print_config(capsys, "--config", str(saved), "--steps", "5")


@pytest.mark.parametrize("preset", ["switch-tiny", "deepseek-tiny"])
def test_config_json_round_trips_presets_with_none_and_tables(tmp_path, capsys, preset):
    from moekit.train.cli import parse_args

    flags = ["--preset", preset, "--capacity-factor", "none", "--model.num_layers", "2", "--seed", "7"]
    cfg, _ = parse_args(flags)
    saved = tmp_path / "config.json"
    saved.write_text(json.dumps(cfg.to_dict(), indent=1))  # as the trainer writes it
    assert print_config(capsys, "--config", str(saved)) == print_config(capsys, *flags)


# ---------------------------------------------------------------------------------------------------
# 3. Fields of the wrong type in TOML and JSON
# ---------------------------------------------------------------------------------------------------

WRONG_TOML = [
    ("preset = 3", "preset: expected a string (a preset name), got 3 (an integer)"),
    ("preset = true", "preset: expected a string (a preset name), got true (a boolean)"),
    ('preset = ["mixtral-tiny"]', 'preset: expected a string (a preset name), got ["mixtral-tiny"] (an array)'),
    ("[preset]\nname = 1", 'preset: expected a string (a preset name), got {"name": 1} (a table)'),
    ('[train]\nsteps = "ten"', "train.steps: expected an integer, got 'ten'"),
    ('[train]\nsteps = "5"', "train.steps: expected an integer, got '5' (a string); in a config file write"),
    ('[train]\ncompile = "true"', "train.compile: expected true or false, got 'true' (a string)"),
    ('[model]\ncapacity_factor = "1.25"', "model.capacity_factor: expected a number, got '1.25' (a string)"),
    ("[train]\nsteps = 1.5", "train.steps: expected an integer, got 1.5 (a number)"),
    ("[train]\nsteps = true", "train.steps: expected an integer, got true (a boolean)"),
    ("[train]\nsteps = [1, 2]", "train.steps: expected an integer, got [1, 2] (an array)"),
    ("[train]\nsteps = {n = 1}", 'train.steps: expected an integer, got {"n": 1} (a table)'),
    ("[train]\nlr = true", "train.lr: expected a number, got true (a boolean)"),
    ('[train]\nlr = "fast"', "train.lr: expected a number, got 'fast'"),
    ("[train]\ndtype = 32", "train.dtype: expected a string, got 32 (an integer)"),
    ("[train]\ndeterministic = 1", "train.deterministic: expected true or false, got 1 (an integer)"),
    ("[model]\nrouter = 5", "model.router: expected a string, got 5 (an integer)"),
    ("[model]\nhidden_size = 64.0", "model.hidden_size: expected an integer, got 64.0 (a number)"),
    ("[model]\ncapacity_factor = [1.25]", "model.capacity_factor: expected a number, got [1.25] (an array)"),
    ("[model]\nrouter_options = 3", "model.router_options: expected a table of options, got 3"),
    ("train = 3", "train: expected a [train] table of settings, got 3 (an integer)"),
    ("[trian]\nsteps = 3", "trian: unknown setting 'trian'"),
]


@pytest.mark.parametrize("text,expected", WRONG_TOML, ids=[t for t, _ in WRONG_TOML])
def test_wrong_types_in_toml(tmp_path, capsys, text, expected):
    path = tmp_path / "c.toml"
    path.write_text(text + "\n")
    refused(capsys, tmp_path / "run", ["--config", str(path)], f"{path}: {expected}")


WRONG_JSON = [
    ({"preset": None}, "preset: expected a string (a preset name), got null"),
    ({"preset": 7}, "preset: expected a string (a preset name), got 7 (an integer)"),
    ({"train": {"steps": "x"}}, "train.steps: expected an integer, got 'x'"),
    ({"train": {"seed": 1.0}}, "train.seed: expected an integer, got 1.0 (a number)"),
    ({"model": {"top_k": 2.5}}, "model.top_k: expected an integer, got 2.5 (a number)"),
    ({"model": {"tie_embeddings": "yes please"}}, "model.tie_embeddings: expected true or false, got 'yes please'"),
    ({"layout": {"ep": [2]}}, "layout.ep: expected an integer, got [2] (an array)"),
    ({"log": {"run_dir": False}}, "log.run_dir: expected a string, got false (a boolean)"),
    ({"model": []}, "model: expected a [model] table of settings, got [] (an array)"),
]


@pytest.mark.parametrize("values,expected", WRONG_JSON, ids=[json.dumps(v) for v, _ in WRONG_JSON])
def test_wrong_types_in_json(tmp_path, capsys, values, expected):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(values))
    refused(capsys, tmp_path / "run", ["--config", str(path)], f"{path}: {expected}")


# ---------------------------------------------------------------------------------------------------
# 4. Router options of the wrong type
# ---------------------------------------------------------------------------------------------------

WRONG_OPTIONS = [
    (["--model.router_options.expert_bias", "abc"], "router 'topk': option expert_bias='abc' (a string)",
     "must be a boolean (true / false) or a Tensor"),
    (["--model.router_options.expert_bias", "2"], "option expert_bias=2 (an integer)", "a boolean"),
    (["--model.router_options.scaling", '"1.0"'], "option scaling='1.0' (a string)", "must be a number"),
    (["--model.router_options.top_k", "2.0"], "option top_k=2.0 (a number)", "must be an integer"),
    (["--model.router_options.normalize", "1"], "option normalize=1 (an integer)",
     "must be a boolean (true / false) or none"),
    (["--model.router_options.num_groups", "[2]"], "option num_groups=[2] (a list)", "an integer or none"),
    (["--preset", "switch-tiny", "--model.router_options.jitter", "true"],
     "router 'switch': option jitter=True (a boolean)", "must be a number"),
    (["--router", "sinkhorn", "--model.router_options.num_iters", "2.5"],
     "router 'sinkhorn': option num_iters=2.5 (a number)", "must be an integer"),
    (["--router", "hash", "--model.router_options.seed", "abc"], "router 'hash': option seed='abc'",
     "must be an integer"),
    (["--router", "expert_choice", "--model.router_options.score", "1"], "router 'expert_choice': option score=1",
     "must be a string"),
]


@pytest.mark.parametrize("argv,value,expected_type", WRONG_OPTIONS, ids=[" ".join(a) for a, *_ in WRONG_OPTIONS])
def test_router_options_of_the_wrong_type(tmp_path, capsys, argv, value, expected_type):
    refused(capsys, tmp_path / "run", argv, value, expected_type)


def test_router_option_types_in_toml_and_from_python(tmp_path, capsys):
    path = tmp_path / "c.toml"
    path.write_text('[model]\nrouter_options = {normalize = true, expert_bias = "abc"}\n')
    refused(capsys, tmp_path / "run", ["--config", str(path)], "router 'topk': option expert_bias='abc'")
    with pytest.raises(ValueError, match=r"router 'topk': option top_k=2\.0 \(a number\).*must be an integer"):
        build_router("topk", 8, 4, top_k=2.0)
    with pytest.raises(ValueError, match="option capacity_factor='1.25'"):
        build_router("switch", 8, 4, capacity_factor="1.25")
    # right types still build: ints for floats, None for optionals, a bias tensor
    r = build_router("topk", 8, 4, scaling=2, normalize=None, expert_bias=torch.zeros(4), capacity_factor=None)
    assert r.scaling == 2.0 and r.expert_bias is not None


class Unannotated(Router):
    """A user's router without annotations: its defaults' types are what build_router checks."""

    def __init__(self, hidden_size, num_experts, alpha=0.5, mode="a", on=False, anything=None, **rest):
        super().__init__(hidden_size, num_experts)


@pytest.mark.parametrize("option,value,expected", [
    ("alpha", "x", "must be a number"), ("alpha", True, "must be a number"), ("mode", 3, "must be a string"),
    ("on", 1, "must be a boolean"), ("anything", object(), None), ("alpha", 2, None), ("via_rest", "x", None),
])
def test_unannotated_router_options_are_checked_by_their_defaults(option, value, expected):
    spec = f"{__name__}:Unannotated"
    if expected is None:
        assert isinstance(build_router(spec, 8, 4, **{option: value}), Unannotated)
    else:
        with pytest.raises(ValueError, match=f"router '{spec}': option {option}=.*{expected}"):
            build_router(spec, 8, 4, **{option: value})


# ---------------------------------------------------------------------------------------------------
# 5. module:Class routers that fail to import or to build
# ---------------------------------------------------------------------------------------------------

BROKEN_MODULES = {
    "syntax": ("def f(:\n", "could not be loaded (SyntaxError: "),
    "raises": ("raise RuntimeError('no GPU here, says the module')\n",
               "could not be loaded (RuntimeError: no GPU here, says the module)"),
    "exits": ("import sys\nsys.exit(3)\n", "could not be loaded (SystemExit: 3)"),
    "imports": ("import moekit_no_such_dependency\n",
                "could not be loaded (ModuleNotFoundError: No module named 'moekit_no_such_dependency')"),
    "noclass": ("X = 1\n", "could not be loaded (AttributeError: module '{module}' has no attribute 'Router')"),
    "ctor": ("from moekit.moe.router import Router\n"
             "class Router(Router):\n"
             "    def __init__(self, hidden_size, num_experts, **kw):\n"
             "        raise KeyError('weights.bin')\n", "could not be built (KeyError: 'weights.bin')"),
    "ctor_type": ("from moekit.moe.router import Router\n"
                  "class Router(Router):\n"
                  "    def __init__(self, hidden_size, num_experts, *, top_k=1):\n"
                  "        super().__init__(hidden_size, num_experts, top_k=top_k)\n"
                  "        self.table = {}[top_k]\n", "could not be built (KeyError: 2)"),
}


@pytest.mark.parametrize("kind", sorted(BROKEN_MODULES))
def test_broken_custom_routers(tmp_path, capsys, monkeypatch, kind):
    source, expected = BROKEN_MODULES[kind]
    module = f"moekit_test_broken_{kind}_{fresh_seed()}"  # never cached by an earlier import
    (tmp_path / f"{module}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        refused(capsys, tmp_path / "run", ["--router", f"{module}:Router"],
                f"router '{module}:Router' {expected.format(module=module)}")
    finally:
        sys.modules.pop(module, None)


# ---------------------------------------------------------------------------------------------------
# 6. Custom routers returning ids outside [0, E), or -1 without a capacity
# ---------------------------------------------------------------------------------------------------

H, E, FFN = 12, 6, 10


class WildRouter(Router):
    """Returns fixed ids (any integers), weights that depend on the logits, garbage counts and stats."""

    def __init__(self, hidden_size, num_experts, *, ids=None, capacity=None):
        super().__init__(hidden_size, num_experts)
        self.ids, self.cap = ids, capacity

    def route(self, logits, token_ids=None):
        T, k = self.ids.shape
        weights = logits[:, :k].sigmoid()  # [T, k], differentiable in the router weight
        return Routing(self.ids, weights, torch.full((self.num_experts,), 999), 0.0, {"mine": 1}, self.cap)


def reference(layer: MoELayer, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """sum over slots with an id in [0, E) of weight * expert(x): every other slot is dropped."""
    w_in, w_out = layer.experts.w_in, layer.experts.w_out
    per_expert = torch.stack([swiglu(x @ w_in[e]) @ w_out[e] for e in range(E)])  # [E, T, H]
    valid = (ids >= 0) & (ids < E)
    weights = torch.where(valid, layer.router.logits(x)[:, : ids.shape[1]].sigmoid(), 0.0)
    slots = per_expert[ids.clamp(0, E - 1), torch.arange(x.shape[0])[:, None]]  # [T, k, H]
    return (weights[..., None] * slots).sum(1)


@pytest.mark.parametrize("capacity", [None, 1])  # None claims "nothing dropped"; 1 is a capacity it ignores
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_out_of_range_expert_ids_are_dropped(capacity, dtype):
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    T, k = 24, 3
    ids = torch.randint(-E, 2 * E, (T, k), generator=g)
    ids[0] = torch.tensor([-1, E, -(2**40)])  # the marker, one past the end, far out of range
    ids[1] = torch.tensor([0, E - 1, 2**40])
    ids = ids.to(dtype)
    layer = MoELayer(H, FFN, E, WildRouter(H, E, ids=ids, capacity=capacity), backend="loop").double()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.5, generator=g)
    x = torch.randn(T, H, generator=g, dtype=torch.float64, requires_grad=True)
    out = layer(x)
    params = [x, layer.router.weight, layer.experts.w_in, layer.experts.w_out]
    grads = torch.autograd.grad(out.square().sum(), params)
    x_ref = x.detach().requires_grad_()
    ref = reference(layer, x_ref, ids.long())
    ref_grads = torch.autograd.grad(ref.square().sum(), [x_ref, *params[1:]])
    torch.testing.assert_close(out, ref, msg=lambda m: f"seed {seed}: {m}")
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, msg=lambda m: f"seed {seed}: {m}")
    routing = layer.router(x)
    valid = (ids >= 0) & (ids < E)
    assert routing.indices.dtype == torch.int64 and torch.equal(routing.indices, torch.where(valid, ids.long(), -1))
    assert torch.equal(routing.tokens_per_expert, torch.bincount(ids[valid].long(), minlength=E)), seed
    invalid = (~valid & (ids != -1)).float().mean()
    torch.testing.assert_close(routing.stats["invalid_fraction"], invalid)
    torch.testing.assert_close(routing.stats["dropped_fraction"], invalid)
    assert routing.stats["mine"].item() == 1 and routing.aux_loss.item() == 0.0


def test_checked_routing_adds_no_host_sync():
    T, k = 16, 2
    ids = torch.randint(-3, E + 3, (T, k))
    layer = MoELayer(H, FFN, E, WildRouter(H, E, ids=ids))
    x = torch.randn(T, H, requires_grad=True)
    with host_syncs() as found:
        routing = layer.router(x)
        d = layer.dispatcher.dispatch(x, routing)
        y = layer.dispatcher.combine(d.rows * 2.0, d.meta)
        y.square().sum().backward()
    assert found == [], found


@pytest.mark.parametrize("ids,weights,match", [
    (torch.zeros(5, 2), torch.ones(5, 2), "expert ids must be an integer tensor"),
    (torch.zeros(5, 2, dtype=torch.long), torch.ones(5, 3), r"must both be \[T, k\] with T=5"),
    (torch.zeros(4, 2, dtype=torch.long), torch.ones(4, 2), r"must both be \[T, k\] with T=5"),
    (torch.zeros(5, 2, dtype=torch.long), torch.ones(5, 2, dtype=torch.long), "must be floating point"),
])
def test_malformed_routing_is_a_clear_error(ids, weights, match):
    class Malformed(Router):
        def route(self, logits, token_ids=None):
            return Routing(ids, weights, torch.zeros(E, dtype=torch.long), logits.new_zeros(()))

    with pytest.raises(ValueError, match=match):
        Malformed(H, E)(torch.randn(5, H))


def test_training_with_a_router_returning_bad_ids(tmp_path, capsys, monkeypatch):
    (tmp_path / "moekit_test_wild.py").write_text(textwrap.dedent("""
        import torch
        from moekit.moe.router import Router

        class Wild(Router):  # slot 0: a real expert; slot 1: out of range, alternating sides
            def __init__(self, hidden_size, num_experts, *, top_k: int = 2):
                super().__init__(hidden_size, num_experts, top_k=top_k)

            def route(self, logits, token_ids=None):
                first = logits.argmax(-1, keepdim=True)
                wild = torch.where(first % 2 == 0, -7, self.num_experts + first)
                return self.finish(logits, logits.softmax(-1), torch.cat([first, wild], 1), torch.ones_like(
                    logits[:, :2]) * logits.softmax(-1).gather(1, first))
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    run = tmp_path / "run"
    try:
        rc = main([*TINY, "--router", "moekit_test_wild:Wild", "--steps", "2", "--run-dir", str(run)])
    finally:
        sys.modules.pop("moekit_test_wild", None)
    assert rc == 0, capsys.readouterr().err
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["loss"] == r["loss"] for r in rows)  # finite, not NaN
    head, *steps = load_rows(run)
    assert all(sum(s["tokens"][0]) == 2 * 8 for s in steps)  # only slot 0 was kept: one slot per token


# ---------------------------------------------------------------------------------------------------
# 7. Learning rates (and decay) that can only diverge or overflow
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv,expected", [
    (["--train.lr", "1e30"], "--train.lr=1e+30 is invalid"),
    (["--train.lr", "1e38"], "--train.lr=1e+38 is invalid"),
    (["--train.lr", "1e300"], "--train.lr=1e+300 is invalid"),
    (["--train.lr", "2"], "--train.lr=2.0 is invalid"),
    (["--train.lr", "inf"], "--train.lr=inf is invalid"),
    (["--train.lr", "nan"], "--train.lr=nan is invalid"),
    (["--train.weight_decay", "1e300"], "--train.weight_decay=1e+300 with --train.lr=0.003 is invalid"),
    (["--train.lr", "0.5", "--train.weight_decay", "2"], "lr * weight_decay must be < 1"),
])
def test_absurd_learning_rates_are_refused(tmp_path, capsys, argv, expected):
    line = refused(capsys, tmp_path / "run", [*TINY, *argv], expected)
    assert "(0, 1]" in line or "< 1" in line  # the accepted range: the fix


def test_parameters_gone_non_finite_stop_the_next_step(tmp_path, capsys, monkeypatch):
    """An optimizer step that leaves a non-finite weight: the guard stops the next step before its update."""
    real_step = torch.optim.AdamW.step

    def overflowing_step(self, *args, **kwargs):
        out = real_step(self, *args, **kwargs)
        with torch.no_grad():
            self.param_groups[0]["params"][0].fill_(float("inf"))  # the embedding, as a huge lr would leave it
        return out

    monkeypatch.setattr(torch.optim.AdamW, "step", overflowing_step)
    run = tmp_path / "run"
    rc = main([*TINY, "--steps", "3", "--run-dir", str(run)])
    err = capsys.readouterr().err
    assert rc == 1 and "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "non-finite loss" in lines[0] and "at step 2" in lines[0], err
    assert [json.loads(r)["step"] for r in (run / "metrics.jsonl").read_text().splitlines()] == [1]


# ---------------------------------------------------------------------------------------------------
# 8. Second-order gradients through SwiGLU
# ---------------------------------------------------------------------------------------------------


def composite(h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def test_swiglu_double_backward_matches_gradgradcheck():
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    shape = (int(torch.randint(1, 5, (), generator=g)), 2 * int(torch.randint(1, 6, (), generator=g)))
    h = (3 * torch.randn(shape, generator=g, dtype=torch.float64)).requires_grad_()
    assert torch.autograd.gradcheck(swiglu, (h,)), seed
    assert torch.autograd.gradgradcheck(swiglu, (h,)), seed


def test_swiglu_gradient_penalty_equals_the_composite():
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    h0 = torch.randn(7, 3, 16, generator=g)
    target = torch.randn(7, 3, 8, generator=g)
    results = []
    for fn in (swiglu, composite):
        h = h0.clone().requires_grad_()
        y = fn(h)
        (dh,) = torch.autograd.grad(((y - target) ** 2).sum(), h, create_graph=True)
        penalty = dh.square().sum()
        (ddh,) = torch.autograd.grad(penalty, h)
        results.append((y, dh, ddh))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, msg=lambda m: f"seed {seed}: {m}")


def test_moe_layer_gradient_penalty_in_float64():
    """Double backward through the whole layer (router, dispatch, SwiGLU experts, combine)."""
    seed = fresh_seed()
    torch.manual_seed(seed)
    layer = MoELayer(4, 3, 3, build_router("topk", 4, 3, top_k=2), backend="loop").double()
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradgradcheck(lambda t: layer(t), (x,), eps=1e-6, atol=1e-5), seed


# ---------------------------------------------------------------------------------------------------
# 9. An expert backend that cannot run here
# ---------------------------------------------------------------------------------------------------


def test_unusable_expert_backend_is_refused_before_the_run(tmp_path, capsys, monkeypatch):
    pytest.importorskip("triton")
    import moekit.moe.kernels  # noqa: F401  (triton imported in the mode the other tests expect, first)

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    run = tmp_path / "run"
    for extra in ([], ["--train.dtype", "bfloat16"], ["--preset", "switch-tiny", "--model.num_kv_heads", "1",
                                                                  "--model.num_layers", "2"]):  # D M
        refused(capsys, run, [*TINY, "--train.device", "cpu", "--model.expert_backend", "triton", *extra],
                "--model.expert_backend='triton'", "TRITON_INTERPRET=1")
    refused(capsys, run, [*TINY, "--model.expert_backend", "cutlass"], "expert backend 'cutlass' is unknown")


@pytest.mark.parametrize("var,value,expected", [
    ("MOEKIT_TMA", "yes", "MOEKIT_TMA='yes' is invalid; use one of ['auto', 'never', 'always']"),
    ("MOEKIT_AUTOTUNE", "fastest", "MOEKIT_AUTOTUNE='fastest' is invalid"),
    ("MOEKIT_KERNEL_CONFIGS", "/nonexistent/tuned.json", "cannot read it"),
])
def test_bad_kernel_environment_is_refused_before_the_run(tmp_path, capsys, monkeypatch, var, value, expected):
    """The kernels' environment variables are checked with the config, not at the first expert GEMM (where a
    CPU run without the Triton interpreter would never look at them)."""
    pytest.importorskip("triton")
    monkeypatch.setenv(var, value)
    refused(capsys, tmp_path / "run", [*TINY, "--steps", "1"], expected)


# The Triton-path switches read from the environment at import (moe.kernel_choice): module, attribute, variable
SWITCHES = [("moekit.models.loss", "TRITON_LM_LOSS", "MOEKIT_LM_LOSS"),
            ("moekit.moe.precision", "SPLIT_ROUTER", "MOEKIT_SPLIT_ROUTER"),
            ("moekit.models.delta_rule", "TRITON_SCAN", "MOEKIT_DELTA_SCAN"),
            ("moekit.moe.experts", "FUSED_PERMUTE", "MOEKIT_FUSED_PERMUTE")]


@pytest.mark.parametrize("module,attr,var", SWITCHES, ids=[v for _, _, v in SWITCHES])
def test_bad_switch_environment_is_refused_at_start_up(monkeypatch, module, attr, var):
    """A bad value stops the trainer before the run, naming the variable and the accepted values; a good one
    passes the same check."""
    import importlib

    from moekit.train.validation import UserError, check_kernel_environment

    mod = importlib.import_module(module)
    monkeypatch.setenv(var, "fast")
    monkeypatch.setattr(mod, attr, "fast")  # as the import in a fresh process would have set it
    with pytest.raises(UserError, match=rf"{var}='fast'\) is invalid; use one of auto, always, never"):
        check_kernel_environment()
    monkeypatch.setattr(mod, attr, "never")
    check_kernel_environment()


def test_switches_start_from_the_environment():
    """Case and spaces ignored; unset: the loss kernel and the router GEMM on ("auto"), the delta-rule scan and the
    fused gather off ("never": opt-in until their kernels have been timed on a GPU)."""
    code = ("from moekit.models import delta_rule, loss; from moekit.moe import experts, precision; "
            "print(loss.TRITON_LM_LOSS, precision.SPLIT_ROUTER, delta_rule.TRITON_SCAN, experts.FUSED_PERMUTE)")
    env = {"MOEKIT_SPLIT_ROUTER": " Never ", "MOEKIT_FUSED_PERMUTE": "ALWAYS", "PATH": "/usr/bin:/bin",
           "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.stdout.split() == ["auto", "never", "never", "always"], out.stderr
    del env["MOEKIT_FUSED_PERMUTE"]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.stdout.split()[-1] == "never", out.stderr


# ---------------------------------------------------------------------------------------------------
# The real program: exit code and no traceback
# ---------------------------------------------------------------------------------------------------


def test_script_reports_one_line(tmp_path):
    """python tools/train.py with a router module that raises at import: exit 2, one line, no traceback."""
    (tmp_path / "moekit_test_script_router.py").write_text("raise ZeroDivisionError('at import')\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "train.py"), "--router", "moekit_test_script_router:R",
                           "--run-dir", str(tmp_path / "run")], capture_output=True, text=True, env=env, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert len(lines) == 1 and lines[0] == (
        "train.py: error: model config (mixtral-tiny): router 'moekit_test_script_router:R' could not be loaded "
        "(ZeroDivisionError: at import); expected 'package.module:ClassName' naming an importable module and a "
        "class in it"), proc.stderr
    assert not (tmp_path / "run").exists()


def test_local_dispatch_reads_no_row_out_of_bounds_for_any_id():
    """A hand-built Routing (no Router.forward) with -1 and ids >= E although ``capacity`` is None: the
    dispatcher still reads nothing out of bounds and those slots contribute nothing."""
    from moekit.moe.dispatch import LocalDispatcher
    from moekit.moe.router import count_experts

    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    T, k = 10, 2
    ids = torch.randint(-3, E + 3, (T, k), generator=g)
    w = torch.rand(T, k, generator=g)
    x = torch.randn(T, H, generator=g, requires_grad=True)
    d = LocalDispatcher(E).dispatch(x, Routing(ids, w, count_experts(ids, E), torch.zeros(())))
    owned = int(d.counts.sum())
    rows = torch.cat([d.rows[:owned] * 2.0, d.rows.new_zeros(d.rows.shape[0] - owned, H)])  # backends: 0 past counts
    y = LocalDispatcher(E).combine(rows, d.meta)
    valid = (ids >= 0) & (ids < E)
    torch.testing.assert_close(y, 2.0 * x * torch.where(valid, w, 0.0).sum(1, keepdim=True),
                               msg=lambda m: f"seed {seed}: {m}")


# ---------------------------------------------------------------------------------------------------
# 9. Operators' slips found by an audit of every program (session 15)
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv,expected", [
    (["--print-config", "--dry-run"], "--print-config and --dry-run each do one thing and exit"),
    (["--write-data", "x.bin", "--help-config"], "--help-config and --write-data each do one thing"),
    (["--write-data", " "], "--write-data needs a file name"),
    (["--dry-run-gpu-gb", "10"], "--dry-run-gpu-gb 10.0: only with --dry-run"),
    (["--world-size", "2"], "--world-size 2: only with --dry-run"),
    (["--checkpoint.keep", "0"], "--checkpoint.keep=0 is invalid; it must keep at least 1"),
    (["--eval.sequences", "0"], "--eval.sequences=0 is invalid"),
    (["--eval.every", "-1"], "--eval.every=-1 is invalid"),
    (["--ep", "2"], "launch at least 2 processes (torchrun --nproc-per-node 2"),
    (["--model.vocab_size", "100", "--dry-run"], "--model.vocab_size=100: the data is byte-level text"),
    (["--layout.sequence_parallel", "true"], "and --tp is 1"),
    (["--model.first_dense_layers", "5"], "but no layer is an MoE layer"),
    (["--data.val_fraction", "1e-9"], "use more data, a smaller --train.seq_len, or a larger --data.val_fraction"),
    (["--model.rope_scaling", "yarn"], """expected a JSON object such as '{"rope_type": "linear", "factor": 2.0}'"""),
    (["--batch-size", "4000000", "--train.seq_len", "16"],
     "activations of a micro-batch of 4000000 x 16 tokens), but this cpu has"),
])
def test_modes_and_settings_an_operator_gets_wrong(tmp_path, capsys, argv, expected):
    refused(capsys, tmp_path / "run", [*TINY, *argv], expected)


def test_an_hf_export_into_a_run_directory_is_refused(tmp_path, capsys):
    """--export-hf writes config.json and tokenizer files: into this run's directory, or another run's, it would
    replace that run's config and change its tokenizer; both are refused before any work."""
    run = tmp_path / "run"
    refused(capsys, run, [*TINY, "--export-hf", str(run)], f"--export-hf {run} is this run's --run-dir")
    other = tmp_path / "other"
    other.mkdir()
    (other / "metrics.jsonl").write_text("")
    refused(capsys, run, [*TINY, "--export-hf", str(other)],
            f"--export-hf {other} is a moekit-train run directory (it holds metrics.jsonl)")


def test_run_dir_under_a_file_and_resume_paths_name_the_form_meant(tmp_path, capsys):
    (tmp_path / "f").write_text("x")
    refused(capsys, tmp_path / "f" / "run", TINY, "--run-dir", "is a file, not a directory")
    step = tmp_path / "old" / "checkpoints" / "step_000002"
    step.mkdir(parents=True)
    (step / "meta.json").write_text("{}")
    for resume, expected in ((" ", "--resume needs a checkpoint folder"),
                             (str(step / "meta.json"), f"a file; pass its checkpoint folder ({step})"),
                             (str(tmp_path / "old"), "a run directory, not a checkpoint; pass --run-dir")):
        rc = main([*TINY, "--run-dir", str(tmp_path / "run"), "--resume", resume])
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and len(err) == 1 and expected in err[0], err
