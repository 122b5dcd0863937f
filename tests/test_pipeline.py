"""Pipeline parallelism: the stage split, the error messages, and real gloo pipelines against one process.

The reference is the single-process model built from the same seed and trained on the same micro-batches
((loss_m / M).backward() per micro-batch, aux loss scaled by 1/M, AdamW): losses step by step and every
gradient, compared by parameter name.
"""
import dataclasses
import itertools
import random

import pytest
import torch
import torch.distributed as dist

from moekit.comm.expert_parallel import apply_expert_parallel
from moekit.comm.fsdp import apply_fsdp
from moekit.comm.grad_sync import global_grad_norm, gradient_roles, sync_gradients
from moekit.comm.pipeline import check_schedule, stage_ids_of
from moekit.comm.topology import Layout, Topology
from moekit.models.config import PRESETS, ModelConfig
from moekit.models.parallelize import apply_activation_checkpointing
from moekit.models.pipeline import (PipelineModel, StageModule, balance_stages, build_pipeline, check_pipeline_model,
                                    layer_costs, lm_loss, needs_embedding_replica)
from moekit.models.transformer import build_model
from moekit.moe import collect_load
from moekit.moe.layer import set_aux_loss_scale
from tests.dist_utils import run_ranks

S = 16  # sequence length


# --------------------------------------------------------------------------------------------------
# The balanced split (plain numbers)
# --------------------------------------------------------------------------------------------------


def stage_max(costs, ranges, first=0.0, last=0.0):
    sums = [sum(costs[i] for i in r) for r in ranges]
    sums[0] += first
    sums[-1] += last
    return max(sums)


def brute_force_best(costs, k, first=0.0, last=0.0):
    L = len(costs)
    best = float("inf")
    for cuts in itertools.combinations(range(1, L), k - 1):
        bounds = (0, *cuts, L)
        ranges = [range(bounds[i], bounds[i + 1]) for i in range(k)]
        best = min(best, stage_max(costs, ranges, first, last))
    return best


def test_balance_beats_equal_count_split():
    costs = [1, 1, 1, 1, 1, 5]  # one expensive layer at the end
    ranges = balance_stages(costs, 2)
    assert ranges == [range(0, 5), range(5, 6)]
    assert stage_max(costs, ranges) == 5 < stage_max(costs, [range(0, 3), range(3, 6)]) == 7
    # the lm_head's cost moves layers off the last stage
    assert balance_stages([1, 1, 1, 1], 2, last_extra=2) == [range(0, 3), range(3, 4)]
    assert balance_stages([1, 1, 1, 1], 2, first_extra=2) == [range(0, 1), range(1, 4)]
    assert balance_stages([3, 1, 2], 1) == [range(0, 3)]
    assert balance_stages([3, 1, 2], 3) == [range(0, 1), range(1, 2), range(2, 3)]


def test_balance_is_optimal_against_brute_force():
    rng = random.Random(0)
    for _ in range(60):
        L = rng.randint(1, 9)
        k = rng.randint(1, L)
        costs = [rng.choice([0.5, 1, 2, 3, 7]) for _ in range(L)]
        first, last = rng.choice([0, 1, 4]), rng.choice([0, 2, 5])
        ranges = balance_stages(costs, k, first, last)
        assert len(ranges) == k and all(len(r) > 0 for r in ranges)
        assert [i for r in ranges for i in r] == list(range(L))  # contiguous, in order, every layer once
        assert stage_max(costs, ranges, first, last) == brute_force_best(costs, k, first, last)


def test_layer_costs_follow_the_architecture():
    ds = layer_costs(PRESETS["deepseek-tiny"], 64)
    assert ds.layers[0] != ds.layers[1] == ds.layers[2] == ds.layers[3]  # first layer dense
    sw = layer_costs(PRESETS["switch-tiny"], 64)
    assert sw.layers[0] == sw.layers[2] != sw.layers[1] == sw.layers[3]  # MoE every other layer
    cfg = PRESETS["mixtral-tiny"]
    assert ds.head == 2 * cfg.hidden_size * cfg.vocab_size
    # a real model with dense first layers and a large vocabulary: the balanced split is never worse
    big = layer_costs(PRESETS["deepseek-v3-like"])
    ranges = balance_stages(big.layers, 8, big.embed, big.head)
    equal = [range(i * 61 // 8, (i + 1) * 61 // 8) for i in range(8)]
    assert stage_max(big.layers, ranges, big.embed, big.head) <= stage_max(big.layers, equal, big.embed, big.head)


# --------------------------------------------------------------------------------------------------
# Error messages (no processes)
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("args,match", [
    (("zb", 2, 1), "pp_schedule='zb' is unknown"),
    (("interleaved", 2, 1), "needs layout.pp_stages_per_rank >= 2"),
    (("1f1b", 2, 2), "use layout.pp_schedule interleaved or layout.pp_stages_per_rank 1"),
    (("1f1b", 4, 1, 2), "at least pp=4 micro-batches"),
    (("interleaved", 2, 2, 5), "5 is not a multiple of 2"),
    (("gpipe", 2, 1, 0), "pp_microbatches=0 is invalid"),
    (("gpipe", 0, 1), "pp=0 is invalid"),
])
def test_schedule_errors(args, match):
    with pytest.raises(ValueError, match=match):
        check_schedule(*args)


def test_schedules_torch_accepts_pass():
    for args in (("gpipe", 4, 1, 1), ("1f1b", 2, 1, 2), ("interleaved", 2, 2, 3), ("interleaved", 4, 2, 8)):
        check_schedule(*args)
    assert stage_ids_of(1, 2, 2) == [1, 3] and stage_ids_of(0, 4, 1) == [0]


def test_model_errors():
    with pytest.raises(ValueError, match="num_layers=4 is fewer than the 8 pipeline stages"):
        check_pipeline_model(PRESETS["mixtral-tiny"], 8)
    with pytest.raises(ValueError, match="4 layers cannot fill 5"):
        balance_stages([1.0] * 4, 5)
    check_pipeline_model(PRESETS["switch-tiny"], 2)  # tied: the last stage keeps a replica of the embedding
    model = build_model(PRESETS["switch-tiny"], seed=0)
    with pytest.raises(ValueError, match="embedding_replica=True"):
        StageModule(model, range(2, 4), False, True)


@pytest.mark.parametrize("over", [{}, {"tie_embeddings": True}, {"mtp_layers": 2}, {"tie_embeddings": True, "mtp_layers": 1}],
                         ids=["untied", "tied", "mtp2", "tied-mtp"])
def test_the_memory_plan_counts_each_stages_parameters(over):
    """The dry run's per-stage parameter tensors (train.planning.memory) against the stage modules built here, part by
    part: the last stage's embedding replica (tied head, MTP) included, and nothing on stage 0 changes."""
    from moekit.train.planning.dryrun import part_of
    from moekit.train.planning.memory import Stage, param_tensors

    cfg = dataclasses.replace(PRESETS["mixtral-tiny"], **over)
    model = build_model(cfg, seed=0)
    ranges = balance_stages(layer_costs(cfg, S).layers, 2)
    replica = needs_embedding_replica(cfg, 2)
    assert replica == bool(over)
    for i, r in enumerate(ranges):
        stage = StageModule(model, r, i == 0, i == 1, replica)
        built: dict[str, int] = {}
        for name, p in stage.named_parameters():
            built[part_of(name)] = built.get(part_of(name), 0) + p.numel()
        planned: dict[str, int] = {}
        for part, n in param_tensors(cfg, Layout(pp=2), Stage(i, tuple(r), i == 0, i == 1)):
            planned[part] = planned.get(part, 0) + n
        assert built == planned, (i, built, planned)
        assert ("embedding" in built) == (i == 0 or replica)
        if stage.has_replica:  # a copy, not the same tensor: the two stages live on different ranks
            assert stage.embed is not model.embed and torch.equal(stage.embed.weight, model.embed.weight)


# --------------------------------------------------------------------------------------------------
# Real pipelines vs one process
# --------------------------------------------------------------------------------------------------


def tiny(**over) -> ModelConfig:
    base = dict(name="pp-test", hidden_size=32, num_layers=4, num_heads=2, num_kv_heads=1, max_seq_len=S,
                ffn_hidden_size=64, num_experts=4, moe_ffn_hidden_size=32, top_k=2, capacity_factor=None,
                aux_loss_coeff=0.05, z_loss_coeff=0.01, router_options={"normalize": True})
    base.update(over)
    return ModelConfig(**base)


CONFIGS = {
    "mixtral": tiny(),
    # DeepSeek-like: dense first layer, shared expert, hash routing (every stage needs the token ids)
    "hash": tiny(first_dense_layers=1, shared_ffn_hidden_size=32, router="hash", aux_loss_coeff=0.0,
                 z_loss_coeff=0.0, router_options={}),
    # Switch-like: MoE every other layer, top-1; no jitter (its random draws happen in another order per layout)
    "switch": tiny(moe_every=2, top_k=1, activation="relu", router="switch", router_options={"jitter": 0.0}),
    # the last stage needs the embedding: a tied head and a multi-token-prediction depth (an MoE block)
    "tied_mtp": tiny(tie_embeddings=True, mtp_layers=1, mtp_loss_coeff=0.5),
    # MTP alone (untied head), two depths: the replica serves only the depths' lookups
    "mtp2": tiny(mtp_layers=2, moe_every=2),
}


def test_stages_chain_to_the_model_under_its_names():
    """One process, no schedule: the stage modules chained are the model's forward, bitwise; their
    static shapes are what they compute; names are the model's; a wrong declared dtype is named."""
    cfg = tiny(first_dense_layers=1, shared_ffn_hidden_size=32)
    model = build_model(cfg, seed=3)
    ranges = balance_stages(layer_costs(cfg, S).layers, 3)
    stages = [StageModule(model, r, i == 0, i == 2) for i, r in enumerate(ranges)]
    tokens = torch.randint(0, cfg.vocab_size, (2, S), generator=torch.Generator().manual_seed(0))
    targets = torch.randint(0, cfg.vocab_size, (2, S), generator=torch.Generator().manual_seed(1))
    x = tokens
    for stage in stages:
        (meta_in,), (meta_out,) = stage.io_meta(tokens)
        assert (meta_in.shape, meta_in.dtype) == (x.shape, x.dtype)
        out = stage(x, tokens, targets)  # the last stage: the loss, as the schedule runs it
        assert (meta_out.shape, meta_out.dtype) == (out.shape, out.dtype)
        if not stage.is_last:
            x = out
    assert torch.equal(out, model(tokens, targets=targets))
    assert torch.equal(stages[-1](x, tokens), model(tokens))  # without targets: the logits
    both = PipelineModel(cfg, [stages[0], stages[2]])  # an interleaved rank's stages: one module, model names
    want = {n for n in model.state_dict() if not any(n.startswith(f"layers.{i}.") for i in ranges[1])}
    assert set(both.state_dict()) == want
    assert [b for b in both.layers] == [model.layers[i] for i in [*ranges[0], *ranges[2]]]
    stages[0].activation_dtype = torch.bfloat16
    assert stages[0].io_meta(tokens)[1][0].dtype == torch.bfloat16
    with pytest.raises(RuntimeError, match=r"activation_dtype=torch.float32"):
        stages[0](tokens, tokens)


def local(t):
    """The part of a tensor this rank holds (expert-parallel weights may be DTensor shards)."""
    return t.to_local() if hasattr(t, "to_local") else t


def average_gradients(model, topo):
    """The data-parallel mean, written out: expert weights over the ranks holding the same experts (the EP
    all-to-all already brought the EP peers' tokens; with ep=1 that is every data rank), the rest over all
    data ranks; each rank's loss is the mean over its share, so divide by the number of data ranks."""
    for name, p in model.named_parameters():
        group = topo.group("edp" if ".experts." in name else "dp")
        dist.all_reduce(local(p.grad), group=group)
        local(p.grad).div_(topo.layout.data_parallel)


def full(t):
    """The whole tensor from this rank's shard (collective over the shard's mesh: experts, FSDP)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def check_grads(pipe_model, ref, atol=1e-5):
    """Every parameter of this rank's stages has the reference gradient."""
    ref_params = dict(ref.named_parameters())
    for name, p in pipe_model.named_parameters():
        want = ref_params[name].grad
        assert want.abs().sum() > 0, name
        torch.testing.assert_close(full(p.grad), want, atol=atol, rtol=1e-4, msg=lambda m: f"{name}: {m}")


def _pipeline_rank(rank, world, config, schedule, v, ep, fsdp, microbatches, ac, ckpt=None):
    cfg = CONFIGS[config]
    topo = Topology(Layout(pp=2, dp=world // 2 // fsdp, fsdp=fsdp, ep=ep), rank, world).build()
    D, d, M, per = topo.layout.data_parallel, topo.data_rank(), microbatches, 2 * microbatches
    torch.manual_seed(0)  # router jitter and the like draw alike in both models
    ref = build_model(cfg, seed=7)
    pipe = build_pipeline(build_model(cfg, seed=7), topo, schedule, v, seq_len=S)
    apply_expert_parallel(pipe.model, topo)
    apply_activation_checkpointing(pipe.model, ac)
    if fsdp > 1:  # per stage module: each is an FSDP root, since only the stages' forwards ever run
        for stage in pipe.model.stages:
            apply_fsdp(stage, topo)
    for model in (ref, pipe.model):  # the aux loss is averaged over micro-batches like the LM loss
        set_aux_loss_scale(model, microbatches=M)
    ref.train(), pipe.model.train()
    check_bad_input(pipe, schedule)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=3e-3, foreach=False)
    opt = torch.optim.AdamW(pipe.model.parameters(), lr=3e-3, foreach=False)
    gen = torch.Generator().manual_seed(1)
    for step in range(3):
        seqs = torch.randint(0, cfg.vocab_size, (D * per, S + 1), generator=gen)
        x, y = seqs[:, :-1], seqs[:, 1:]  # the global batch; data rank r reads rows [r*per, (r+1)*per)
        ref_loss = 0.0
        for m in range(M):  # global micro-batch m = every data rank's m-th micro-batch
            rows = [r * per + m * 2 + i for r in range(D) for i in range(2)]
            loss_m = ref(x[rows], targets=y[rows])  # the trainer's loss, as the last stage computes it
            (loss_m / M).backward()
            ref_loss += loss_m.item() / M
        mine = slice(d * per, (d + 1) * per)
        loss = pipe.step(x[mine], y[mine], M)
        if fsdp > 1:  # FSDP reduce-scattered inside the pipeline's last backward; experts still need 1/ep
            sync_gradients(pipe.model, topo, gradient_roles(pipe.model), fsdp=True)
        else:
            average_gradients(pipe.model, topo)
        dist.all_reduce(loss, group=topo.group("dp"))  # every data rank (dp x fsdp)
        assert abs(loss.item() / D - ref_loss) < 1e-5, (step, loss.item() / D, ref_loss)
        mtp, mtp_ref = pipe.pop_mtp_loss(), ref.pop_mtp_loss()  # on every pipeline rank
        assert (mtp is None) == (mtp_ref is None) == (not cfg.mtp_layers)
        if mtp is not None and D == 1:  # (with D > 1 the reference's micro-batches mix the data ranks' rows)
            assert abs(mtp.item() - mtp_ref.item()) < 1e-5, (step, mtp.item(), mtp_ref.item())
        if step == 0:
            check_grads(pipe.model, ref)
            check_load(pipe, ref, topo, M)
            want = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()])
            got = global_grad_norm(list(pipe.model.parameters()), torch.device("cpu"), topo.group("pp"))
            torch.testing.assert_close(got, want, rtol=1e-5, atol=0)  # an embedding replica is counted once
        opt.step(), opt_ref.step()
        opt.zero_grad(), opt_ref.zero_grad()
    # after 3 AdamW steps: the data ranks' gradients are summed in another order than one process sums them, and
    # Adam turns a relative error in a near-zero gradient into up to ~lr x that error per step (1 element in 512
    # was 4e-6 off at lr 3e-3, dp2 x ep2); one data rank is all but bitwise
    check_names(pipe, ref, topo, atol=3e-5 if D > 1 else 1e-6)
    if ckpt:
        check_checkpoint(pipe, cfg, topo, ckpt)
    check_eval(pipe, ref, x[: 2 * D], y[: 2 * D], D, d)


def check_load(pipe, ref, topo, M):
    """The gathered record has every MoE layer in model order, M forwards each (recomputation not
    counted), and its counts summed over the data ranks are the single-process counts."""
    load = pipe.gather_load(collect_load(pipe.model))
    want = collect_load(ref)
    assert list(load) == list(want)
    for name, summary in load.items():
        assert summary.forwards == M, (name, summary.forwards)
        counts = torch.tensor(summary.assigned_per_expert)
        dist.all_reduce(counts, group=topo.group("dp"))
        assert counts.tolist() == want[name].assigned_per_expert, name


def check_names(pipe, ref, topo, atol=1e-6):
    """The stages' state-dict names are the single-process ones and together cover the whole model."""
    mine = list(pipe.model.state_dict())
    names = [None] * topo.layout.pp
    dist.all_gather_object(names, mine, group=topo.group("pp"))
    every = [n for part in names for n in part]
    replica = needs_embedding_replica(ref.config, len(pipe.ranges))  # on the first and the last rank
    assert sorted({n for n in every if every.count(n) > 1}) == (["embed.weight"] if replica else [])
    assert sorted(set(every)) == sorted(ref.state_dict())
    for name, value in pipe.model.state_dict().items():  # sharded tensors: the whole, as checkpoints hold it
        torch.testing.assert_close(full(value), ref.state_dict()[name], atol=atol, rtol=1e-5, msg=lambda m: f"{name}: {m}")


def check_checkpoint(pipe, cfg, topo, path):
    """A torch.distributed.checkpoint written by the pipeline loads into one process, and into a pipeline
    with another stage split (interleaved, 4 stages), under the same names."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    dcp.save(get_model_state_dict(pipe.model), checkpoint_id=path)
    dist.barrier()  # the coordinator's metadata file is complete
    mine = {name: full(t) for name, t in pipe.model.state_dict().items()}
    single = build_model(cfg, seed=99)  # another init: what matches came from the checkpoint
    state = single.state_dict()
    dcp.load(state, checkpoint_id=path, no_dist=True)
    for name, value in mine.items():
        torch.testing.assert_close(state[name], value, atol=0, rtol=0)
    other = build_pipeline(build_model(cfg, seed=99), topo, "interleaved", 2, seq_len=S)
    apply_expert_parallel(other.model, topo)
    state = get_model_state_dict(other.model)
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(other.model, state)
    for name, value in other.model.state_dict().items():
        torch.testing.assert_close(full(value), single.state_dict()[name] if name not in mine else mine[name],
                                   atol=0, rtol=0)


def check_eval(pipe, ref, x, y, D, d):
    pipe.model.eval(), ref.eval()
    with torch.no_grad():
        want = lm_loss(ref(x[2 * d: 2 * d + 2]), y[2 * d: 2 * d + 2]).item()
        got = pipe.evaluate(x[2 * d: 2 * d + 2], y[2 * d: 2 * d + 2], 2).item()
    # the two micro-batches are equal halves: the mean of their means is the mean
    assert abs(got - want) < 1e-5, (got, want)


# (model, schedule, stages per rank, micro-batches, activation checkpointing)
PP2_CASES = [
    ("mixtral", "gpipe", 1, 3, "none"),
    ("hash", "1f1b", 1, 2, "ffn"),
    ("switch", "interleaved", 2, 2, "full"),
    ("tied_mtp", "1f1b", 1, 2, "none"),
    ("mtp2", "interleaved", 2, 2, "ffn"),
]


def _pp2_cases_rank(rank, world, ckpt):
    for case in PP2_CASES:  # one spawn for all of them: starting processes costs far more than the cases
        try:
            _pipeline_rank(rank, world, case[0], case[1], case[2], 1, 1, case[3], case[4],
                           f"{ckpt}-{case[0]}" if case[0] in ("mixtral", "tied_mtp") else None)
        except AssertionError as exc:
            raise AssertionError(f"case {case}: {exc}") from exc


def test_pp2_gpipe_1f1b_interleaved_match_single_process(tmp_path):
    """2 ranks, one pipeline: each schedule (interleaved: 2 stages per rank, 4 stages of 1 layer) gives the
    single-process losses over 3 AdamW steps, gradients and gradient norm, for five router / layer patterns,
    two of them with the embedding replicated on the last stage (a tied head and MTP; MTP alone with two
    depths); the mixtral and the tied case also move their checkpoint into one process and into the
    interleaved split."""
    run_ranks(_pp2_cases_rank, 2, str(tmp_path / "ckpt"))


def _ep_cases_rank(rank, world, ckpt):
    # (model, schedule, stages per rank, ep, fsdp, micro-batches, activation checkpointing)
    for case in [("mixtral", "1f1b", 1, 2, 1, 2, "none"), ("tied_mtp", "interleaved", 2, 2, 2, 2, "full")]:
        try:
            _pipeline_rank(rank, world, *case, f"{ckpt}-fsdp{case[4]}")
        except AssertionError as exc:
            raise AssertionError(f"case {case}: {exc}") from exc


def test_pp2_ep2_and_pp2_fsdp2_ep2_match_single_process(tmp_path):
    """4 ranks, 2 stages x 2 data ranks, experts split over those 2 (EP inside each stage): replicated
    (dp2, 1f1b), then fully sharded (fsdp2, interleaved with activation checkpointing, a tied head and an MTP
    depth: the embedding's replica is an FSDP shard whose gradient the two stages sum)."""
    run_ranks(_ep_cases_rank, 4, str(tmp_path / "ckpt"))


def check_bad_input(pipe, schedule):
    """Bad micro-batching fails on every rank alike before any communication, with the fix named."""
    x = torch.zeros(3, S, dtype=torch.long)
    with pytest.raises(ValueError, match="3 sequences does not split into 2 equal micro-batches"):
        pipe.step(x, x, 2)
    if schedule == "1f1b":
        with pytest.raises(ValueError, match="at least pp=2 micro-batches"):
            pipe.step(x[:1], x[:1], 1)
    with pytest.raises(RuntimeError, match="Pipeline.step"):
        pipe.model(x)
