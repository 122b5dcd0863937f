"""The residual stream's dtype (train.residual_dtype, models.transformer.embed_tokens) and the RMSNorm that casts its
weight to its input's dtype (models.norms.RMSNorm): a bf16 stream under bf16 autocast over fp32 weights, as FSDP's
bf16 parameters compute, on CPU here; the trainer's flag, its checks, a pipeline's stage buffers, the planner."""
import dataclasses
import json
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from moekit.comm.topology import Layout
from moekit.models.config import preset
from moekit.models.norms import RMSNorm, ZeroCenteredRMSNorm, make_norm
from moekit.models.parallelize import apply_activation_checkpointing
from moekit.models.transformer import build_model
from moekit.train.planning.memory import Workload, estimate_memory
from moekit.train.planning.shapes import FP32, shapes
from tests.dist_utils import run_trainer
from tests.test_dryrun import measure

BF16_ULP = 2.0**-7  # one unit in the last place of bf16, relative to the value (at the bottom of a binade)


# ---------------------------------------------------------------------------------------------------
# models.norms.RMSNorm
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("rows,width", [(1, 8), (37, 96), (5, 1)])
def test_norm_of_a_bf16_input_casts_its_fp32_weight_and_stays_on_torchs_kernel(rows, width):
    """bf16 input, fp32 weight: a bf16 output within one bf16 rounding of the float64 norm times the bf16-rounded
    weight, and none of torch's mixed-dtype fallback warnings; an fp32 input gives nn.RMSNorm's exact output, and an
    fp32 input under bf16 weights (FSDP's compute copies, an fp32 residual stream) an fp32 output."""
    g = torch.Generator().manual_seed(rows * 1000 + width)
    norm = RMSNorm(width, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(width, generator=g) * 0.5 + 1)
    x = torch.randn(rows, width, generator=g) * 3
    xb = x.to(torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns "Mismatch dtype between input and weight" on its fallback
        out = norm(xb)
    assert out.dtype == torch.bfloat16
    xd = xb.double()
    want = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight.to(torch.bfloat16).double()
    torch.testing.assert_close(out.double(), want, rtol=BF16_ULP, atol=1e-6)
    plain = nn.RMSNorm(width, eps=1e-5)
    plain.load_state_dict(norm.state_dict())
    assert torch.equal(norm(x), plain(x))
    half = RMSNorm(width, eps=1e-5).to(torch.bfloat16)
    assert half(x).dtype == torch.float32


def test_norm_runs_outside_autocast(monkeypatch):
    """Under autocast the norm's kernel runs with autocast off (torch 2.12's CUDA fp32 policy for rms_norm would
    otherwise upcast a bf16 input into a full fp32 copy and return fp32); without autocast it is left alone."""
    from moekit.models import norms

    seen, real = [], F.rms_norm
    monkeypatch.setattr(norms.F, "rms_norm", lambda *a, **k: seen.append(torch.is_autocast_enabled("cpu")) or real(*a, **k))
    norm, x = RMSNorm(8), torch.randn(3, 8).to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert norm(x).dtype == torch.bfloat16 and torch.is_autocast_enabled("cpu")  # restored after
    norm(x)
    assert seen == [False, False]


def test_every_norm_of_the_models_casts_its_weight():
    """make_norm builds the casting norm (the residual stream's, q / k's, MTP's); the zero-centered one computes in
    fp32 and returns the input's dtype already."""
    cfg = preset("mixtral-tiny")
    assert type(make_norm(cfg, 8)) is RMSNorm
    cfg.norm_zero_centered = True
    zc = make_norm(cfg, 8)
    assert type(zc) is ZeroCenteredRMSNorm and zc(torch.randn(2, 8).to(torch.bfloat16)).dtype == torch.bfloat16
    model = build_model(preset("deepseek-tiny"), seed=0)  # MLA's latent norms too
    norms = [m for m in model.modules() if isinstance(m, nn.RMSNorm)]
    assert norms and all(isinstance(m, (RMSNorm, ZeroCenteredRMSNorm)) for m in norms)


# ---------------------------------------------------------------------------------------------------
# the model's residual stream
# ---------------------------------------------------------------------------------------------------

def _forward_backward(cfg, residual, tokens, targets):
    """(loss, {block name: output dtype}, {param name: grad}) of one bf16-autocast training step on the CPU."""
    model = build_model(cfg, seed=0)
    model.residual_dtype = residual
    model.train()
    seen = {}
    blocks = [(f"layers.{i}", b) for i, b in enumerate(model.layers)] + [(f"mtp.{i}", m) for i, m in enumerate(model.mtp)]
    for name, block in blocks:
        block.register_forward_hook(lambda mod, args, out, name=name: seen.__setitem__(name, out.dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(tokens, targets=targets)
    loss.backward()
    return loss.item(), seen, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name,over", [
    ("mixtral-tiny", {}), ("deepseek-tiny", {"mtp_layers": 1}), ("gpt-oss-tiny", {}),
    ("qwen3.5-tiny", {"full_attention_every": 2}), ("llama4-tiny", {"attention_chunk": 16}),
    ("deepseek-tiny", {"attention": "mla", "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4,
                       "v_head_dim": 6, "q_lora_rank": 12}),
], ids=["mixtral", "deepseek-mtp", "gpt-oss", "qwen3.5", "llama4", "mla"])
def test_a_bf16_residual_stream_stays_bf16_and_trains_as_the_fp32_one(name, over):
    """With residual_dtype bf16 every block (the MTP depths' too) returns bf16 under autocast; with the default
    (None: the fp32 embedding's dtype) the main blocks return fp32, as the residual adds promote back. The loss
    and every parameter's gradient follow the fp32 stream's to bf16 precision, the routers' less closely (a token
    near a tie between experts may pick another: a discrete change in their gradients); gradients stay fp32."""
    cfg = dataclasses.replace(preset(name), num_layers=2, **over)
    g = torch.Generator().manual_seed(len(name))
    tokens, targets = (torch.randint(0, cfg.vocab_size, (2, 32), generator=g) for _ in range(2))
    loss16, dtypes16, grads16 = _forward_backward(cfg, torch.bfloat16, tokens, targets)
    loss32, dtypes32, grads32 = _forward_backward(cfg, None, tokens, targets)
    assert set(dtypes16.values()) == {torch.bfloat16}, dtypes16
    assert {dtypes32[f"layers.{i}"] for i in range(cfg.num_layers)} == {torch.float32}, dtypes32
    assert math.isfinite(loss16) and loss16 == pytest.approx(loss32, rel=5e-3)
    assert grads16.keys() == grads32.keys()
    for n, g16 in grads16.items():
        assert g16.dtype == torch.float32, n
        g32 = grads32[n]
        if g32.norm() > 1e-6:  # a zero gradient (e.g. an expert no token reached) has no direction
            cos = F.cosine_similarity(g16.flatten().double(), g32.flatten().double(), dim=0)
            assert cos > (0.8 if ".router." in n else 0.97), (n, float(cos))


def test_the_embedding_cast_is_the_only_change():
    """A residual_dtype equal to the embedding's is no cast at all: the same loss to the bit as None."""
    cfg = dataclasses.replace(preset("mixtral-tiny"), num_layers=1)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))
    a, _, _ = _forward_backward(cfg, None, tokens, tokens)
    b, _, _ = _forward_backward(cfg, torch.float32, tokens, tokens)
    assert a == b


# ---------------------------------------------------------------------------------------------------
# the trainer's flag
# ---------------------------------------------------------------------------------------------------

def test_the_flag_resolves_per_device_and_refuses_what_cannot_run():
    from moekit.train import UserError
    from moekit.train.cli import parse_args
    from moekit.train.config import TrainSection
    from moekit.train.validation import residual_dtype

    t = TrainSection()
    assert residual_dtype(t, "cuda", torch.bfloat16) == torch.bfloat16  # auto: bf16 on a GPU, as FSDP's
    assert residual_dtype(t, "cuda", None) is None  # fp32 training: nothing to cast
    assert residual_dtype(t, "cpu", torch.bfloat16) is None  # CPUs keep fp32 unless asked
    for value, want in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        t.residual_dtype = value
        assert residual_dtype(t, "cpu", torch.bfloat16) == want
    for argv, said in ((["--train.residual_dtype", "bf16"], "--train.residual_dtype='bf16' is invalid"),
                       (["--train.device", "cpu", "--train.residual_dtype", "bfloat16"], "needs bf16 autocast")):
        with pytest.raises(UserError, match=said.replace("(", r"\(").replace("[", r"\[")):
            parse_args(argv)
    cfg, _ = parse_args(["--train.device", "cpu", "--train.dtype", "bfloat16", "--train.residual_dtype", "bfloat16"])
    assert cfg.train.residual_dtype == "bfloat16"


MICRO_RUN = ["--model.hidden_size", "32", "--model.num_layers", "2", "--train.seq_len", "32", "--batch-size", "8",
             "--train.micro_batch_size", "2", "--eval.every", "0", "--eval.sequences", "8", "--log.every", "1",
             "--log.progress", "off",
             "--checkpoint.every", "0", "--steps", "3", "--train.dtype", "bfloat16"]


def _losses(run_dir) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_trainer_runs_a_bf16_stream_in_one_process_and_over_a_pipeline(tmp_path):
    """--train.residual_dtype bfloat16 on the CPU: the trainer says so, the run trains, and a 2-stage pipeline
    (its stage buffers in the stream's bf16: the first stage's output would not fit an fp32 buffer) follows the
    one-process curve to fp32 rounding of the same bf16 products. The fp32 stream's curve differs (the flag acts)."""
    runs = {}
    for label, extra, nproc in (("one", [], 1), ("pp2", ["--pp", "2", "--layout.pp_schedule", "gpipe"], 2),
                                ("fp32", [], 1)):
        resid = "float32" if label == "fp32" else "bfloat16"
        r = run_trainer([*MICRO_RUN, "--train.residual_dtype", resid, "--run-dir", str(tmp_path / label), *extra],
                        nproc=nproc)
        assert r.returncode == 0, r.stderr[-3000:]
        runs[label] = _losses(tmp_path / label)
        if label == "one":
            assert "(bfloat16 residual stream)" in r.stdout
    assert len(runs["one"]) == 3 and all(map(math.isfinite, runs["one"]))
    assert runs["pp2"] == pytest.approx(runs["one"], rel=1e-4)
    assert runs["fp32"] != runs["one"] and runs["fp32"] == pytest.approx(runs["one"], rel=2e-2)


# ---------------------------------------------------------------------------------------------------
# the planner
# ---------------------------------------------------------------------------------------------------

B, S = 2, 64


@pytest.mark.parametrize("name,mode,over", [
    ("mixtral-tiny", "none", {}), ("mixtral-tiny", "full", {}), ("mixtral-tiny", "selective", {}),
    ("mixtral-tiny", "none", {"qk_norm": "head"}), ("deepseek-tiny", "none", {"mtp_layers": 1}),
    ("gpt-oss-tiny", "ffn", {}), ("qwen3.5-tiny", "none", {"full_attention_every": 2}),
    ("llama4-tiny", "none", {"attention_chunk": 16}),
])
@pytest.mark.parametrize("residual", ["bfloat16", "auto"])
def test_estimate_matches_one_process_with_either_stream_under_cpu_autocast(name, mode, over, residual):
    """The activation estimate (Workload.residual) against the bytes one CPU bf16-autocast forward keeps, for the
    bf16 stream and the fp32 one (auto on CPU). On CPU each norm of a bf16 stream keeps an fp32 copy of its input
    (Shapes.norm_in), the head's weight gradient stays fp32 (Shapes.w), and an MTP depth's stream is bf16 either
    way (its eh_proj output)."""
    cfg = dataclasses.replace(preset(name), num_layers=2, **over)
    model = build_model(cfg, seed=0)
    apply_activation_checkpointing(model, mode)
    model.train()
    model.residual_dtype = torch.bfloat16 if residual == "bfloat16" else None
    gen = torch.Generator().manual_seed(0)
    tokens, targets = (torch.randint(0, cfg.vocab_size, (B, S), generator=gen) for _ in range(2))
    measured = measure(model, tokens, targets, autocast=torch.bfloat16)["activations"]
    est = estimate_memory(cfg, Layout(), Workload(B, S, "bfloat16", mode, "cpu", residual=residual))
    assert est.activations == pytest.approx(measured, rel=0.005), est.breakdown


def test_the_planner_reads_the_stream_per_device_and_layout():
    cfg = preset("mixtral-tiny")

    def sh(layout=Layout(), **kw):
        return shapes(cfg, layout, Workload(2, 64, **kw))

    gpu = sh(dtype="bfloat16", device="cuda")  # auto on a GPU: the bf16 stream, weights still cast by autocast
    assert (gpu.r, gpu.casts, gpu.autocast, gpu.norm_in, gpu.w) == (2, False, True, 2, FP32)
    legacy = sh(dtype="bfloat16", device="cuda", residual="float32")  # each projection's bf16 copy of its input
    assert (legacy.r, legacy.casts, legacy.autocast) == (FP32, True, True)
    fsdp = sh(Layout(fsdp=2), dtype="bfloat16", device="cuda")  # FSDP's bf16 parameters: nothing cast
    assert (fsdp.r, fsdp.casts, fsdp.autocast, fsdp.w) == (2, False, False, 2)
    cpu = sh(dtype="bfloat16", device="cpu")  # auto on CPU: fp32
    assert (cpu.r, cpu.casts, cpu.norm_in) == (FP32, True, FP32)
    cpu16 = sh(dtype="bfloat16", device="cpu", residual="bfloat16")
    assert (cpu16.r, cpu16.casts, cpu16.norm_in) == (2, False, FP32)
    fp32 = sh(dtype="float32", device="cuda")
    assert (fp32.r, fp32.casts, fp32.autocast) == (FP32, False, False)
    with pytest.raises(ValueError, match="needs dtype='bfloat16'"):
        Workload(2, 64, "float32", residual="bfloat16")
    with pytest.raises(ValueError, match="residual='bf16' is invalid"):
        Workload(2, 64, residual="bf16")
    # the bf16 stream on one GPU keeps less than the fp32 one, and as much as FSDP's bf16 parameters outside the
    # weights' casts
    big = dataclasses.replace(preset("mixtral-1b"))
    one = estimate_memory(big, Layout(), Workload(4, 2048, "bfloat16", "none", "cuda"))
    old = estimate_memory(big, Layout(), Workload(4, 2048, "bfloat16", "none", "cuda", residual="float32"))
    assert one.activations < old.activations


def test_dry_run_says_which_stream_it_plans(capsys):
    """--dry-run plans a GPU run: bf16 stream by default, fp32 with --train.residual_dtype float32 (more activation
    memory: the stream's bytes double, each projection keeps its bf16 input copy)."""
    from moekit.train.planning import dryrun

    def plan(*extra):
        rc = dryrun.main(["--dry-run", "--preset", "mixtral-1b", "--world-size", "1", "--batch-size", "4", *extra])
        out = capsys.readouterr().out
        assert rc == 0, out
        line = next(ln for ln in out.splitlines() if ln.strip().startswith("activations"))
        return out, float(line.split()[-2])

    out16, act16 = plan()
    out32, act32 = plan("--train.residual_dtype", "float32")
    assert "bfloat16 autocast on cuda, bf16 residual stream" in out16
    assert "bfloat16 autocast on cuda, fp32 residual stream" in out32
    assert act32 > act16
