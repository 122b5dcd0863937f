"""--init-from-hf / --init-from-dense without --preset take the model architecture from the source
(moekit.train.modelsource); given model settings apply on top; with --preset the preset must match."""
from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from moekit.train import UserError
from moekit.train.cli import parse_args

RUN = ["--train.seq_len", "32", "--batch-size", "4", "--eval.every", "0", "--eval.sequences", "8",
       "--log.tensorboard", "false",
       "--checkpoint.every", "0"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("sources")
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        vocab_size=300, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_experts=4,
        num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        max_position_embeddings=64, norm_topk_prob=True, initializer_range=0.1)).save_pretrained(root / "moe")
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64)).save_pretrained(root / "dense")
    # gpt-oss: sinks, an 8-position window on layer 0 (under 32-token windows), biases everywhere, yarn
    oss = transformers.GptOssForCausalLM(transformers.GptOssConfig(
        vocab_size=300, hidden_size=32, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=8,
        max_position_embeddings=64, initializer_range=0.1))
    with torch.no_grad():
        for name, p in oss.named_parameters():
            if name.endswith(("bias", "sinks")):
                p.normal_(0.0, 0.5)
    oss.save_pretrained(root / "gpt-oss")
    from tests.test_hf_gpt_oss import mxfp4_folder

    mxfp4_folder(root / "gpt-oss", root / "gpt-oss-mxfp4")  # the release's format: MXFP4 experts
    return root


def test_hf_architecture_is_adopted_and_given_settings_apply(folders):
    from moekit.models.hf import config_from_hf

    cfg, _ = parse_args(["--init-from-hf", str(folders / "moe"), "--capacity-factor", "2.0",
                         "--model.aux_loss_coeff", "0.05", *RUN])
    want = config_from_hf(folders / "moe")
    m = cfg.model
    assert (m.hidden_size, m.num_layers, m.num_experts, m.qk_norm, m.vocab_size, m.top_k) == (
        want.hidden_size, want.num_layers, want.num_experts, "head", 300, 2)
    assert (m.capacity_factor, m.aux_loss_coeff) == (2.0, 0.05)
    assert m.router_options == want.router_options and "qwen3_moe" in cfg.source_note


def test_dense_source_upcycles_with_default_and_given_expert_counts(folders):
    cfg, _ = parse_args(["--init-from-dense", str(folders / "dense"), *RUN])
    m = cfg.model
    assert (m.num_experts, m.top_k, m.moe_ffn_hidden_size, m.hidden_size, m.aux_loss_coeff) == (8, 2, 48, 32, 0.01)
    cfg, _ = parse_args(["--init-from-dense", str(folders / "dense"), "--upcycle-granularity", "2",
                         "--model.num_experts", "6", "--model.top_k", "4", *RUN])
    assert (cfg.model.num_experts, cfg.model.top_k, cfg.model.moe_ffn_hidden_size) == (6, 4, 24)
    with pytest.raises(UserError, match="num_experts=5"):  # 5 experts cannot hold whole copies of 2 shards
        parse_args(["--init-from-dense", str(folders / "dense"), "--upcycle-granularity", "2",
                    "--model.num_experts", "5", *RUN])


def test_a_chosen_preset_still_has_to_match(folders, tmp_path, capsys):
    from moekit.train.loop import main

    cfg, _ = parse_args(["--preset", "mixtral-tiny", "--init-from-hf", str(folders / "moe"), *RUN])
    assert cfg.model.hidden_size == 128 and cfg.source_note is None
    code = main(["--preset", "mixtral-tiny", "--init-from-hf", str(folders / "moe"), "--run-dir",
                 str(tmp_path / "r"), "--steps", "1", *RUN])
    err = capsys.readouterr().err
    assert code == 2 and "hidden_size=128 (model) vs 32 (checkpoint)" in err and "leave out --preset" in err


@pytest.mark.parametrize("source", ["moe", "gpt-oss", "gpt-oss-mxfp4"])
def test_training_from_an_hf_folder_starts_from_its_loss(folders, tmp_path, capsys, source):
    """Step 1's loss is the HF model's own loss on the trainer's first batch: the architecture and weights both
    came from the folder (an MXFP4 one: transformers given the decoded weights of the bf16 folder it was made
    from, so the reference is the bf16 folder's model with the MXFP4 round trip applied)."""
    from moekit.train.data import Sampler, gather, split_windows
    from moekit.train.loop import main
    from moekit.train.tokens import embedded_corpus

    run = tmp_path / "run"
    assert main(["--init-from-hf", str(folders / source), "--run-dir", str(run), "--steps", "1", *RUN]) == 0, \
        capsys.readouterr().err
    split = split_windows(embedded_corpus()[0], 32, 0.05)
    x, y = gather(split.tokens, Sampler(split.train_starts, 0).next(4), 32)
    ref = transformers.AutoModelForCausalLM.from_pretrained(folders / source.removesuffix("-mxfp4")).eval()
    if source.endswith("mxfp4"):
        from moekit.models.hf.io import CheckpointReader

        reader = CheckpointReader(folders / source)
        with torch.no_grad():
            for key in reader.mxfp4:
                module, name = key.rsplit(".", 1)
                getattr(ref.get_submodule(module), name).copy_(reader.get(key))
    with torch.no_grad():
        want = torch.nn.functional.cross_entropy(ref(x).logits.flatten(0, 1).float(), y.flatten()).item()
    first = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert first["loss"] == pytest.approx(want, rel=1e-5)
    assert "model architecture from --init-from-hf" in capsys.readouterr().out


@pytest.mark.parametrize("source", ["moe", "gpt-oss"])
def test_expert_parallel_run_loads_its_shards_and_exports_without_gathering(folders, tmp_path, source):
    """torchrun --ep 2 --init-from-hf: each rank reads only its experts (models.hf.load_hf_sharded) and the first
    loss is still the HF model's; --export-hf writes per-rank files that transformers loads with moekit's logits."""
    from moekit.models.hf import load_hf
    from tests.test_train_distributed import run

    run_dir, out = tmp_path / "run", tmp_path / "hf"
    r = run(["--init-from-hf", str(folders / source), "--ep", "2", "--run-dir", str(run_dir), "--steps", "2",
             "--export-hf", str(out), *RUN], nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    single = tmp_path / "single"
    r = run(["--init-from-hf", str(folders / source), "--run-dir", str(single), "--steps", "2", *RUN])
    assert r.returncode == 0, r.stderr[-3000:]
    losses = [[json.loads(line)["loss"] for line in (d / "metrics.jsonl").read_text().splitlines()]
              for d in (run_dir, single)]
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) >= 2  # each rank wrote its own file
    ours = load_hf(out)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    x = torch.randint(0, 300, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x).logits.float(), rtol=1e-5, atol=1e-5)
    assert transformers.AutoTokenizer.from_pretrained(out).decode([104, 105]) == "hi"  # the run's byte tokenizer


def test_a_gpt_oss_run_exports_mxfp4(folders, tmp_path, capsys):
    """--train.export_hf_mxfp4 true: the run's --export-hf folder holds the experts in MXFP4 (the release format)
    and loads back; without --export-hf the flag is refused in one line."""
    from moekit.models.hf import load_hf
    from moekit.train.loop import main

    out = tmp_path / "hf"
    assert main(["--init-from-hf", str(folders / "gpt-oss"), "--run-dir", str(tmp_path / "run"), "--steps", "1",
                 "--export-hf", str(out), "--train.export_hf_mxfp4", "true", *RUN]) == 0, capsys.readouterr().err
    assert "MXFP4 expert weights" in capsys.readouterr().out
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == "mxfp4"
    assert load_hf(out).config.name == "hf:gpt_oss"
    assert main(["--init-from-hf", str(folders / "gpt-oss"), "--run-dir", str(tmp_path / "r2"), "--steps", "1",
                 "--train.export_hf_mxfp4", "true", *RUN]) == 2
    assert "--train.export_hf_mxfp4 true writes the --export-hf folder's experts in MXFP4" in capsys.readouterr().err
