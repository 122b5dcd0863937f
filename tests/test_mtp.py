"""Multi-token prediction (models.mtp): the objective against the paper's formula computed here from full logits,
the reported loss left as the next-token loss, depths only in training, and runs under dp / fsdp / ep matching one
process (torchrun over gloo: fsdp, ep, tp with sequence parallelism, and pp with the depths on the last stage),
with checkpoints that resume."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

from moekit.models.config import preset
from moekit.models.rope import rope_tables
from moekit.models.transformer import build_model
from tests.test_train_distributed import TINY, losses, run

# the final validation on 8 sequences (its losses are compared like for like), no TensorBoard writer per rank
TINY = [*TINY, "--eval.sequences", "8", "--log.tensorboard", "false"]

B, S = 2, 20


def tiny(**over):
    return dataclasses.replace(preset("deepseek-tiny"), num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=4,
                               ffn_hidden_size=48, moe_ffn_hidden_size=16, shared_ffn_hidden_size=16, **over)


def batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (B, S), generator=g), torch.randint(0, 256, (B, S), generator=g)


def reference_objective(model, tokens, targets, coeff: float) -> torch.Tensor:
    """main CE + coeff * mean_k CE_k from materialised logits, each depth written out from the paper: depth k
    combines the previous depth's state at i with the embedding of token i + k and predicts targets[i + k]."""
    cfg = model.config
    cos, sin = rope_tables(cfg, S, tokens.device, 0)
    x = emb = model.embed.weight[tokens]
    for layer in model.layers:
        x = layer(x, cos, sin, tokens)
    h = model.norm(x)
    head = model.embed.weight if model.lm_head is None else model.lm_head.weight
    main = F.cross_entropy((h @ head.T).flatten(0, 1), targets.flatten())
    depth_losses = []
    for k, m in enumerate(model.mtp, start=1):
        n = S - k
        mixed = torch.cat([m.enorm(emb[:, k:]), m.hnorm(h[:, :n])], dim=-1) @ m.eh_proj.weight.T
        h = m.block(mixed, cos[:n], sin[:n], tokens[:, k:])
        depth_losses.append(F.cross_entropy((m.norm(h) @ head.T).flatten(0, 1), targets[:, k:].flatten()))
    return main + coeff * torch.stack(depth_losses).mean()


@pytest.mark.parametrize("depths,coeff,tie", [(1, 0.3, False), (3, 0.5, False), (2, 1.0, True)])
def test_gradient_is_the_papers_objective_and_the_value_the_next_token_loss(depths, coeff, tie):
    cfg = tiny(mtp_layers=depths, mtp_loss_coeff=coeff, tie_embeddings=tie)
    model = build_model(cfg, seed=int(torch.randint(0, 1000, ())))
    tokens, targets = batch(depths)
    loss = model(tokens, targets=targets)
    plain = build_model(dataclasses.replace(cfg, mtp_layers=0), seed=0)
    plain.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("mtp.")})
    assert torch.equal(loss, plain(tokens, targets=targets))  # the value: the next-token loss, bit for bit
    loss.backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    ref_model = model  # the same weights; the reference objective from full logits
    reference_objective(ref_model, tokens, targets, coeff).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(got[name], p.grad, rtol=2e-5, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")
    assert all(got[n].abs().sum() > 0 for n in got if n.startswith("mtp.") and "expert" not in n)
    mtp = model.pop_mtp_loss()
    assert mtp is not None and model.pop_mtp_loss() is None  # popped: the running mean restarts


def test_coefficient_zero_leaves_the_main_model_alone_and_depths_run_only_in_training():
    """With mtp_loss_coeff 0 no gradient reaches the main model through the depths (the depths' own MoE aux
    loss, like any MoE layer's, would: it is off here), and the initial weights are the plain model's."""
    cfg = tiny(mtp_layers=2, mtp_loss_coeff=0.0, aux_loss_coeff=0.0)
    model = build_model(cfg, seed=3)
    plain = build_model(dataclasses.replace(cfg, mtp_layers=0), seed=3)  # depths initialise after the main model
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in plain.state_dict().items())
    tokens, targets = batch(0)
    model(tokens, targets=targets).backward()
    plain(tokens, targets=targets).backward()
    grads = dict(plain.named_parameters())
    for name, p in model.named_parameters():
        if name.startswith("mtp."):
            assert p.grad is None or not p.grad.any(), name
        else:
            torch.testing.assert_close(p.grad, grads[name].grad, rtol=0, atol=1e-7)
    model.pop_mtp_loss()
    with torch.no_grad():  # evaluation: no depth runs, nothing is recorded
        model(tokens, targets=targets)
    model.eval()
    model(tokens, targets=targets)
    assert model.pop_mtp_loss() is None
    model.train()
    short = torch.randint(0, 256, (B, 2))
    model(short, targets=short)  # S = 2: depth 1 runs on one position, depth 2 on none
    assert model.pop_mtp_loss() is not None
    one = torch.randint(0, 256, (B, 1))
    model(one, targets=one)
    assert model.pop_mtp_loss() is None


@pytest.mark.parametrize("field,value,match", [
    ("mtp_layers", -1, "model.mtp_layers=-1 is invalid; it must be an integer >= 0"),
    ("mtp_layers", 1.5, "model.mtp_layers=1.5 is invalid"),
    ("mtp_loss_coeff", float("nan"), "model.mtp_loss_coeff=nan is invalid"),
    ("mtp_loss_coeff", -0.1, "model.mtp_loss_coeff=-0.1 is invalid"),
])
def test_bad_config_values_are_named(field, value, match):
    with pytest.raises(ValueError, match=match):
        tiny(**{field: value}).validate()


@pytest.mark.parametrize("args,match", [
    (["--model.mtp_layers", "2", "--train.seq_len", "2"], "--model.mtp_layers 2 predicts up to 3 tokens ahead"),
])
def test_trainer_refuses_what_mtp_cannot_run(tmp_path, capsys, args, match):
    from tests.test_bad_inputs import refused

    refused(capsys, tmp_path / "r", ["--preset", "deepseek-tiny", *args], match)


def test_a_pipeline_trains_mtp_and_a_tied_head_on_its_last_stage(tmp_path):
    """pp2 (1f1b): the depths and the tied head run on the last stage with its replica of the embedding; loss,
    mtp_loss and the gradient norm (which counts the replica once) follow one process over the same 4
    micro-batches, at pp2 x cp2 too, and the pipeline's checkpoint (both stages hold embed.weight) resumes in one
    process.
    (Gradients parameter by parameter, FSDP and interleaving: tests/test_pipeline.py.)"""
    args = ["--preset", "deepseek-tiny", "--model.mtp_layers", "2", "--model.tie_embeddings", "true", "--steps", "4",
            "--train.micro_batch_size", "2", *TINY]
    single, piped, resumed = tmp_path / "single", tmp_path / "pp2", tmp_path / "resumed"
    r = run([*args, "--run-dir", str(single), "--checkpoint.every", "0"])
    assert r.returncode == 0, r.stderr[-3000:]
    r = run([*args, "--run-dir", str(piped), "--checkpoint.every", "2", "--pp", "2", "--export-hf",
             str(tmp_path / "hf-pp2")], nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "pipeline: 1f1b, 2 stages" in r.stdout and "(HuggingFace glm4_moe)" in r.stdout
    want, got = ([json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()] for d in (single, piped))
    for key in ("loss", "mtp_loss", "grad_norm"):
        assert [g[key] for g in got] == pytest.approx([w[key] for w in want], rel=1e-5, abs=1e-6), key
    for key in ("val_loss", "val_mtp_loss"):  # the last stage's validation, the depths' included
        assert got[-1][key] == pytest.approx(want[-1][key], rel=1e-5), key
    # pp2 x cp2: the last stage's depths read the ids ahead from the gathered sequence through its replica
    r = run([*args, "--run-dir", str(tmp_path / "pp2-cp2"), "--checkpoint.every", "0", "--pp", "2", "--cp", "2"],
            nproc=4)
    assert r.returncode == 0, r.stderr[-3000:]
    got = [json.loads(line) for line in (tmp_path / "pp2-cp2" / "metrics.jsonl").read_text().splitlines()]
    for key in ("loss", "mtp_loss", "grad_norm"):
        assert [g[key] for g in got] == pytest.approx([w[key] for w in want], rel=1e-5, abs=1e-6), key
    r = run([*args, "--run-dir", str(resumed), "--checkpoint.every", "0", "--resume",
             str(piped / "checkpoints" / "step_000002")])
    assert r.returncode == 0, r.stderr[-3000:]
    assert losses(resumed) == pytest.approx(losses(single)[2:], rel=1e-5, abs=1e-6)
    from safetensors.torch import load_file

    # --export-hf under pp: each rank wrote the tensors of its stages (the depths with their copies of the tied
    # embedding too), the same folder as one process exporting the pipeline's final checkpoint
    r = run([*args, "--run-dir", str(tmp_path / "export"), "--resume", str(piped / "checkpoints" / "step_000004"),
             "--export-hf", str(tmp_path / "hf-one")])
    assert r.returncode == 0 and "done: nothing to train (the checkpoint is at step 4" in r.stdout, r.stderr[-3000:]
    folders = [tmp_path / "hf-pp2", tmp_path / "hf-one"]
    assert [json.loads((f / "config.json").read_text()) for f in folders].count(
        json.loads((folders[0] / "config.json").read_text())) == 2
    pp2, one = ({k: v for p in f.glob("*.safetensors") for k, v in load_file(p).items()} for f in folders)
    assert sorted(pp2) == sorted(one) and "model.layers.3.shared_head.head.weight" in pp2  # 2 layers + 2 depths
    assert all(torch.equal(pp2[k], one[k]) for k in one)


@pytest.fixture(scope="module")
def single_mtp(tmp_path_factory):
    d = tmp_path_factory.mktemp("single_mtp")
    r = run(["--preset", "deepseek-tiny", "--model.mtp_layers", "2", "--steps", "4", "--run-dir", str(d),
             "--checkpoint.every", "2", *TINY])
    assert r.returncode == 0, r.stderr
    return d


def test_one_process_records_the_mtp_loss_and_resumes_bitwise(tmp_path, single_mtp):
    rows = [json.loads(line) for line in (single_mtp / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and all(0 < r["mtp_loss"] < 10 for r in rows)  # recorded every step, finite
    assert [("val_mtp_loss" in r) for r in rows] == [False] * 3 + [True]  # with val_loss, at the final evaluation
    assert 0 < rows[-1]["val_mtp_loss"] < 10 and rows[-1]["val_mtp_loss"] != rows[-1]["val_loss"]
    resumed = tmp_path / "resumed"
    r = run(["--preset", "deepseek-tiny", "--model.mtp_layers", "2", "--resume",
             str(single_mtp / "checkpoints" / "step_000002"), "--steps", "4", "--run-dir", str(resumed),
             "--checkpoint.every", "0", *TINY])
    assert r.returncode == 0, r.stderr[-3000:]
    assert losses(resumed) == losses(single_mtp)[2:]


def test_tensor_expert_and_fsdp_run_matches_one_process(tmp_path, single_mtp):
    """tp2 x fsdp2 x ep2 with sequence parallelism: the depths' blocks are TP-sharded and run on whole sequences
    (their inputs are shifted along it) with the TP token split, their MoE layers expert-parallel like the
    others (experts split over the EP ranks, then FSDP-sharded), their other parameters in FSDP's root unit; the
    loss and the MTP loss follow the one-process run. (Plain ep2 from an HF folder:
    test_a_checkpoints_mtp_layer_trains_sharded_and_exports; pp: the test above.)"""
    r = run(["--preset", "deepseek-tiny", "--model.mtp_layers", "2", "--steps", "4", "--run-dir", str(tmp_path),
             "--checkpoint.every", "0", *TINY, "--tp", "2", "--layout.sequence_parallel", "true", "--ep", "2",
             "--fsdp", "2"], nproc=4)
    assert r.returncode == 0, r.stderr[-3000:]
    want = [json.loads(line) for line in (single_mtp / "metrics.jsonl").read_text().splitlines()]
    got = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for key in ("loss", "mtp_loss"):
        assert [g[key] for g in got] == pytest.approx([w[key] for w in want], rel=1e-5, abs=1e-6), key
    assert got[-1]["val_mtp_loss"] == pytest.approx(want[-1]["val_mtp_loss"], rel=1e-5)


def test_context_parallel_runs_match_one_process(tmp_path, single_mtp):
    """cp2 x ep2 (2 ranks; each sequence's 4 chunks of 8 over 2 ranks): the depths read the ids ahead from the
    gathered sequence, route only the positions with a token ahead and weigh each rank's share, so the loss, the
    MTP loss and the validation MTP loss follow the one-process run; the dry run plans the same layout.
    (Gradients parameter by parameter, pipelines and TP: tests/test_context_parallel.py.)"""
    args = ["--preset", "deepseek-tiny", "--model.mtp_layers", "2", "--steps", "4", "--checkpoint.every", "0", *TINY,
            "--cp", "2", "--ep", "2"]
    r = run([*args, "--run-dir", str(tmp_path)], nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "cp=2" in r.stdout
    want = [json.loads(line) for line in (single_mtp / "metrics.jsonl").read_text().splitlines()]
    got = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for key in ("loss", "mtp_loss"):
        assert [g[key] for g in got] == pytest.approx([w[key] for w in want], rel=1e-5, abs=1e-6), key
    assert got[-1]["val_mtp_loss"] == pytest.approx(want[-1]["val_mtp_loss"], rel=1e-5)
    r = run([*args, "--run-dir", str(tmp_path / "dry"), "--dry-run", "--world-size", "2"])
    assert r.returncode == 0 and "x cp 2 x" in r.stdout and " mtp 4096" in r.stdout, r.stdout[-3000:] + r.stderr


MLA = ["--model.attention", "mla", "--model.kv_lora_rank", "16", "--model.q_lora_rank", "32",
       "--model.qk_nope_head_dim", "16", "--model.qk_rope_head_dim", "8", "--model.v_head_dim", "16"]


@pytest.mark.parametrize("layout", [["--tp", "2", "--ep", "2", "--layout.sequence_parallel", "true"],
                                    ["--tp", "2", "--fsdp", "2", *MLA]], ids=["tp2-sp", "tp2-fsdp2-mla"])
def test_the_recipe_shards_the_depths_as_the_dry_run_plans(capsys, layout):
    """The dry run builds rank 0's share with the real recipe and compares its parameter shards, part by part, with
    train.planning.memory's: under TP the depth's block is sharded as any block (an unsharded block would be a
    MISMATCH in attention). (The last pipeline stage's replica: tests/test_pipeline.py builds it.)"""
    from moekit.train.planning import dryrun

    rc = dryrun.main(["--dry-run", "--preset", "deepseek-tiny", "--model.mtp_layers", "1", "--world-size", "4",
                      *layout])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert "the estimate agrees" in out.out and "MISMATCH" not in out.out, out.out


HF_RUN = ["--train.seq_len", "32", "--batch-size", "4", "--eval.every", "0", "--eval.sequences", "8",
          "--log.tensorboard", "false", "--checkpoint.every", "0"]


@pytest.fixture(scope="module")
def deepseek_with_mtp(tmp_path_factory):
    """A tiny DeepSeek-V3 saved by transformers (vocab 300: the byte data fits), with a release-style MTP layer."""
    transformers = pytest.importorskip("transformers")
    from tests.test_hf import add_mtp_layer, edit_config

    folder = tmp_path_factory.mktemp("deepseek") / "hf"
    torch.manual_seed(0)
    transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
        vocab_size=300, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, n_routed_experts=4,
        num_experts_per_tok=2, num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=4,
        num_key_value_heads=4, kv_lora_rank=8, q_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
        n_group=1, topk_group=1, max_position_embeddings=64, initializer_range=0.1)).save_pretrained(folder)
    edit_config(folder, num_nextn_predict_layers=1)
    return folder, add_mtp_layer(folder, 2)


def test_a_checkpoints_mtp_layer_trains_sharded_and_exports(deepseek_with_mtp, tmp_path):
    """--init-from-hf a DeepSeek-V3 folder with its MTP layer: the run adopts one depth and loads it (one process,
    each of 2 EP ranks reading only its shards, and 2 pipeline stages each reading its own), records mtp_loss
    alike, and --export-hf writes the layer back (lr 1e-9: the values are the checkpoint's)."""
    from safetensors.torch import load_file

    src, added = deepseek_with_mtp
    single, sharded, piped, out = tmp_path / "single", tmp_path / "ep2", tmp_path / "pp2", tmp_path / "out"
    args = ["--init-from-hf", str(src), "--steps", "2", "--train.lr", "1e-9", *HF_RUN]
    r = run([*args, "--run-dir", str(single), "--export-hf", str(out)])
    assert r.returncode == 0, r.stderr[-3000:]
    r = run([*args, "--run-dir", str(sharded), "--ep", "2"], nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    # a pipeline reads the folder by slices too: each rank its stages' (the MTP layer on the last stage, the
    # embedding there as well), none the whole model (models.hf.load_hf_sharded)
    r = run([*args, "--run-dir", str(piped), "--pp", "2", "--train.micro_batch_size", "2"], nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [[json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
            for d in (single, sharded, piped)]
    for key in ("loss", "mtp_loss"):
        for other in rows[1:]:
            assert [r[key] for r in other] == pytest.approx([r[key] for r in rows[0]], rel=1e-5), key
    written = {}
    for f in out.glob("*.safetensors"):
        written.update(load_file(f))
    assert {k for k in written if k.startswith("model.layers.2.")} == set(added)
    for key in added:  # the embedding / head copies are the main tensors, written again
        torch.testing.assert_close(written[key], added[key], rtol=0, atol=1e-6, msg=key)
    assert torch.equal(written["model.layers.2.shared_head.head.weight"], written["lm_head.weight"])


def test_depths_a_checkpoint_lacks_start_fresh(deepseek_with_mtp, tmp_path):
    """--model.mtp_layers 2 over a checkpoint with one MTP layer: the first depth loads, the second starts from the
    seed, and it trains. Two EP ranks with replicated experts (--layout.expert_replicas 2) read the folder by
    slices, each slot its logical expert's rows, the missing depth from the seed (models.hf.load_hf_sharded; no
    whole-model build): the same losses as one process."""
    src, _ = deepseek_with_mtp
    args = ["--init-from-hf", str(src), "--model.mtp_layers", "2", "--steps", "2", *HF_RUN]
    r = run([*args, "--run-dir", str(tmp_path / "one")])
    assert r.returncode == 0, r.stderr[-3000:]
    r = run([*args, "--run-dir", str(tmp_path / "ep2"), "--ep", "2", "--layout.expert_replicas", "2"], nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [[json.loads(line) for line in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
            for d in ("one", "ep2")]
    assert all(0 < r["mtp_loss"] < 20 for r in rows[0])
    for key in ("loss", "mtp_loss"):
        assert [r[key] for r in rows[1]] == pytest.approx([r[key] for r in rows[0]], rel=1e-5), key


def test_an_adopted_mtp_layer_says_where_it_came_from_when_refused(deepseek_with_mtp, tmp_path, capsys):
    from tests.test_bad_inputs import refused

    src, _ = deepseek_with_mtp
    refused(capsys, tmp_path / "r", ["--init-from-hf", str(src), "--train.seq_len", "1"],
            "--model.mtp_layers 1 (the --init-from-hf checkpoint's num_nextn_predict_layers) predicts up to 2",
            "--model.mtp_layers")


def test_an_fp8_export_keeps_the_mtp_projection_and_head_copy_in_bf16(tmp_path):
    """As DeepSeek-V3's fp8 release: an MTP depth's block is float8 with scales like any layer's, its eh_proj and its
    copies of the embedding / head stay bf16 (served as plain linears), and the folder loads back with its depth."""
    import json as _json
    import struct

    from moekit.models.hf import load_hf, save_hf

    model = build_model(tiny(mtp_layers=1, attention="mla", kv_lora_rank=8, qk_nope_head_dim=8,
                             qk_rope_head_dim=4, v_head_dim=8, q_lora_rank=16, aux_loss_coeff=0.0,
                             router_options={"score": "sigmoid", "expert_bias": True, "num_groups": 4,
                                             "group_top_k": 2, "group_score_top": 2, "scaling": 1.0}), seed=0)
    save_hf(model, tmp_path, fp8=True, fp8_block=(8, 8))
    raw = (tmp_path / "model.safetensors").read_bytes()
    header = _json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]])
    dtypes = {k: v["dtype"] for k, v in header.items() if k.startswith("model.layers.2.")}
    for key in ("eh_proj.weight", "embed_tokens.weight", "shared_head.head.weight", "enorm.weight"):
        assert dtypes[f"model.layers.2.{key}"] == "BF16", key
    assert dtypes["model.layers.2.self_attn.kv_a_proj_with_mqa.weight"] == "F8_E4M3"
    assert "model.layers.2.self_attn.kv_a_proj_with_mqa.weight_scale_inv" in dtypes
    back = load_hf(tmp_path)
    assert back.config.mtp_layers == 1
    torch.testing.assert_close(back.mtp[0].eh_proj.weight, model.mtp[0].eh_proj.weight.bfloat16().float())
