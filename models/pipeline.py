"""Pipeline parallelism for the Transformer: cost-balanced stage split, stage modules, the Pipeline.

Shape legend: b micro-batch sequences, S sequence, H hidden, V vocab, L layers, K = pp * v stages
(v stages per rank: 1 for gpipe / 1f1b, >= 2 for interleaved 1F1B).

    full model (on the meta device, or built and initialised; every rank builds it alike)
        embed | layers 0 .. L-1 | norm + lm_head
    split into K contiguous layer ranges that minimise the largest stage cost (balance_stages):
        stage 0: embed + layers [0, a)      tokens [b, S] -> hidden [b, S, H]
        stage k: layers [a_k, a_k+1)        hidden [b, S, H] -> hidden [b, S, H]
        stage K-1: layers [.., L) + norm + head (+ MTP depths)
                                            hidden [b, S, H], targets [b, S] -> the micro-batch's mean loss,
                                            a float32 scalar (the trainer's loss: models.loss, in token chunks,
                                            no [b, S, V] logits kept; with MTP the depths' objective rides on it)
    stage k lives on pipeline rank k % pp (torch's loop-style placement), so with pp=2, v=2:
        rank 0: stages 0, 2      rank 1: stages 1, 3

Stage modules reference the full model's submodules (no copy) and keep its parameter names:
``layers`` is keyed by the original layer index, so ``layers.3.attn.wq.weight`` and ``embed.weight``
mean the same tensor at every pp degree, and checkpoints move between layouts and into one process.
``PipelineModel`` gathers all of this rank's stages under those names: the trainer's one module for
the optimizer, gradient clipping, checkpoints, expert parallelism and activation checkpointing.

The token ids (and the targets) travel to every stage as keyword arguments (every rank reads the data),
so RoPE and the hash router see them on every stage; hidden states are the only tensors sent between ranks.

The embedding on the last stage. A tied output projection (``model.tie_embeddings``) and the multi-token
prediction depths (``model.mtp_layers``, which embed the tokens ahead) need ``embed.weight`` on the last
stage, which runs on another rank than stage 0. The last stage keeps a replica of it under the same name
(Megatron's approach): built from the same initialised weights, and after each ``Pipeline.step`` the two
ranks sum their gradients (a send / receive pair inside each pipeline, once per step), so both hold the
single-process gradient, take the same optimizer step and stay equal. Checkpoints hold one ``embed.weight``
(torch.distributed.checkpoint keeps one of equal entries), and the gradient norm counts the replica once.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from moekit.comm.grad_sync import local
from moekit.comm.pipeline import PipelineRunner, broadcast_from, check_schedule, gather_load, stage_ids_of
from moekit.models.config import ModelConfig
from moekit.models.mtp import MTPRecord
from moekit.models.transformer import Transformer, embed_tokens, forward_positions, meta_device, training_loss
from moekit.moe import moe_layers


# ---------------------------------------------------------------------------------------------------
# Stage costs and the balanced split
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LayerCosts:
    """Forward FLOPs per token: each decoder layer, and what the first / last stage add."""

    layers: list[float]
    embed: float  # the lookup: a row read forward, a scatter-add backward (2 H)
    head: float  # final norm is negligible; lm_head matmul 2 H V; plus each MTP depth (block, projection, head)


def layer_costs(config: ModelConfig, seq_len: int | None = None) -> LayerCosts:
    """Per-layer forward FLOPs per token, counted on a meta-device model (allocates nothing).

    attention: 2 x (its weights) + S N (Dqk + Dv) (scores and weighted values, causal half);
    FFN: 2 x dense weights, or 2 x (router + top_k of E routed experts + shared expert) for MoE.
    The last stage's head: 2 H V, and per multi-token-prediction depth its block, its [H, 2H] projection and
    the shared head again (depth k runs on S - k of S positions: counted as all of them).
    """
    S = seq_len or config.max_seq_len
    with meta_device():
        model = Transformer(config)

    def block_cost(block) -> float:
        attn = sum(p.numel() for p in block.attn.parameters())
        cost = 2.0 * attn + S * config.num_heads * (config.attn_qk_head_dim + config.attn_v_head_dim)
        if block.is_moe:
            moe = block.ffn
            experts = sum(p.numel() for p in moe.experts.parameters())  # weights (+ the ffn_bias biases)
            routed = experts * min(config.top_k, moe.num_experts) / moe.num_experts
            other = sum(p.numel() for n, p in moe.named_parameters() if not n.startswith("experts."))
            return cost + 2.0 * (routed + other)
        return cost + 2.0 * sum(p.numel() for p in block.ffn.parameters())

    H, V = config.hidden_size, config.vocab_size
    head = 2.0 * H * V
    mtp = sum(block_cost(m.block) + 2.0 * m.eh_proj.weight.numel() + head for m in model.mtp)
    return LayerCosts([block_cost(b) for b in model.layers], embed=2.0 * H, head=head + mtp)


def balance_stages(costs: list[float], num_stages: int, first_extra: float = 0.0,
                   last_extra: float = 0.0) -> list[range]:
    """Split layers 0..L-1 into ``num_stages`` contiguous non-empty ranges minimising the largest stage
    cost (stage 0 also pays ``first_extra``, the last stage ``last_extra``).

    Exact dynamic programme, O(K L^2): best[k][j] = the smallest possible maximum over the first k
    stages holding layers [0, j). A greedy equal-count split can be far off when costs are uneven
    (dense first layers, MoE every other layer, a large vocabulary head).
    """
    L = len(costs)
    if not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages={num_stages!r} is invalid; it must be a positive integer")
    if L < num_stages:
        raise ValueError(f"{L} layers cannot fill {num_stages} pipeline stages (each needs at least one "
                         f"layer); use fewer stages (pp x pp_stages_per_rank <= {L}) or more layers")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))

    def cost(k: int, i: int, j: int) -> float:  # stage k holding layers [i, j)
        return (prefix[j] - prefix[i] + (first_extra if k == 0 else 0.0)
                + (last_extra if k == num_stages - 1 else 0.0))

    inf = float("inf")
    best = [[inf] * (L + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (L + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for j in range(k, L - (num_stages - k) + 1):  # leave a layer for each later stage
            for i in range(k - 1, j):
                value = max(best[k - 1][i], cost(k - 1, i, j))
                if value < best[k][j]:
                    best[k][j], cut[k][j] = value, i
    bounds, j = [], L
    for k in range(num_stages, 0, -1):
        bounds.append(range(cut[k][j], j))
        j = cut[k][j]
    return bounds[::-1]


def check_pipeline_model(config: ModelConfig, num_stages: int) -> None:
    """Refuse models a pipeline of ``num_stages`` stages cannot run; ValueError naming the fix."""
    if config.num_layers < num_stages:
        raise ValueError(f"model.num_layers={config.num_layers} is fewer than the {num_stages} pipeline stages "
                         f"(pp x layout.pp_stages_per_rank); each stage needs a layer: lower --pp or "
                         f"--layout.pp_stages_per_rank")


# ---------------------------------------------------------------------------------------------------
# Stage modules
# ---------------------------------------------------------------------------------------------------


class StageLayers(nn.ModuleDict):
    """Decoder blocks keyed by their index in the full model ("3" -> ``layers.3.``), in index order.

    Iterating yields the blocks, as iterating ``Transformer.layers`` (a ModuleList) does, so code that
    loops over ``model.layers`` (activation checkpointing, init) runs unchanged on a stage.
    """

    def __iter__(self):
        return iter(self._modules.values())


def needs_embedding_replica(config: ModelConfig, num_stages: int) -> bool:
    """Whether the last of ``num_stages`` stages keeps a replica of ``embed`` (module docstring): a tied head
    or multi-token prediction, on a pipeline whose last stage is not the first."""
    return num_stages > 1 and (config.tie_embeddings or config.mtp_layers > 0)


class StageModule(nn.Module):
    """One pipeline stage: [embed] -> its blocks -> [norm -> lm_head (-> MTP depths)], sharing the full model's
    modules (the last stage's ``embed``, when it has one and is not also the first, is a replica: module
    docstring).

    forward(x, tokens, targets=None): x is the token ids [b, S] on the first stage, else the hidden state
    [b, S, H]; ``tokens`` [b, S] reaches every stage (RoPE length, hash router, the MTP depths). Returns hidden
    [b, S, H]; on the last stage, with ``targets`` [b, S] the micro-batch's mean loss (a float32 scalar, as
    ``Transformer.forward(tokens, targets=targets)`` computes it, MTP included), without them float32 logits
    [b, S, V].
    """

    def __init__(self, model: Transformer, layers: range, first: bool, last: bool, embedding_replica: bool = False):
        super().__init__()
        self.config = model.config
        self.is_first, self.is_last = first, last
        self.has_replica = last and not first and embedding_replica
        # the replica: a copy of the embedding (of its values when the model is initialised; on the meta device
        # models.init gives it stage 0's values, as it draws by name)
        self.embed = model.embed if first else copy.deepcopy(model.embed) if self.has_replica else None
        self.layers = StageLayers({str(i): model.layers[i] for i in layers})
        self.norm = model.norm if last else None
        self.lm_head = model.lm_head if last else None
        self.mtp = model.mtp if last else nn.ModuleList()  # multi-token prediction depths (models.mtp)
        self.mtp_record = MTPRecord()
        self.mtp_in_eval = False  # as Transformer.mtp_in_eval
        self.activation_dtype: torch.dtype | None = None  # of the hidden state sent on; None = parameter dtype
        self.context_parallel = None  # as Transformer.context_parallel
        self.document_eos: int | None = None  # as Transformer.document_eos
        self.residual_dtype: torch.dtype | None = None  # as Transformer.residual_dtype
        self.loss_normalizer: float | None = None  # as Transformer.loss_normalizer (the last stage's loss)
        self.mtp_normalizers: tuple[float, ...] | None = None  # as Transformer.mtp_normalizers
        if last and self.embed is None and (self.lm_head is None or len(self.mtp)):
            raise ValueError("the last pipeline stage needs the embedding (a tied head, or multi-token prediction): "
                             "build it with embedding_replica=True (build_pipeline does)")

    def forward(self, x: Tensor, tokens: Tensor, targets: Tensor | None = None) -> Tensor:
        cos, sin, segments = forward_positions(self, tokens)  # [S, R/2] x 2, [b, S] or None (document masking)
        emb = None
        if self.is_first:
            x = emb = embed_tokens(self, tokens)  # [b, S, H]
        for layer in self.layers:
            x = layer(x, cos, sin, tokens, segments=segments)  # [b, S, H]
        if not self.is_last:
            if x.dtype != self.hidden_dtype():  # the next stage receives into a buffer of the declared dtype
                raise RuntimeError(f"pipeline stage output is {x.dtype} but the stages declared "
                                   f"{self.hidden_dtype()}; pass build_pipeline(..., activation_dtype={x.dtype})")
            return x
        x = self.norm(x)
        weight = self.embed.weight if self.lm_head is None else self.lm_head.weight  # [V, H]
        if targets is None:
            return F.linear(x, weight).float()  # [b, S, V]
        if emb is None and len(self.mtp) and ((self.training and torch.is_grad_enabled()) or self.mtp_in_eval):
            emb = embed_tokens(self, tokens)  # the depths read it
        return training_loss(self, x, weight, emb, tokens, targets, cos, sin, segments).float()  # []

    def hidden_dtype(self) -> torch.dtype:
        """The residual stream's dtype: the parameters' (autocast too: the residual adds promote back),
        unless set: ``activation_dtype`` (e.g. bf16 when FSDP computes with bf16 parameters), else
        ``residual_dtype`` (models.transformer.embed_tokens)."""
        return self.activation_dtype or self.residual_dtype or next(self.parameters()).dtype

    def io_meta(self, tokens: Tensor) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...]]:
        """Meta tensors this stage receives and returns for a micro-batch of ``tokens`` [b, S] (run with targets):
        the static shapes torch.distributed.pipelining needs (no shape-probing forward, which would record load)."""
        b, S = tokens.shape
        H = self.config.hidden_size
        # pinned now: the receiving stage's buffers have this dtype for good (and inside FSDP's forward
        # the parameters are its unsharded compute-dtype copies, so they cannot tell it any more)
        self.activation_dtype = dtype = self.hidden_dtype()
        def meta(*shape, dtype=dtype, grad=True):
            return torch.empty(shape, dtype=dtype, device="meta", requires_grad=grad)

        inp = meta(b, S, dtype=tokens.dtype, grad=False) if self.is_first else meta(b, S, H)
        out = meta(dtype=torch.float32) if self.is_last else meta(b, S, H)  # the last stage: the loss
        return (inp,), (out,)


class PipelineModel(nn.Module):
    """All of this rank's stages under the single-process parameter names (embed., layers.<i>., norm.,
    lm_head., mtp.<k>.): hand it to the optimizer, clip_grad_norm, checkpoints, apply_expert_parallel and
    apply_activation_checkpointing. Run it through ``Pipeline.step``; it has no forward of its own.
    ``embed`` is the first stage's, or on the last stage's rank the replica (module docstring).

    ``moe_layer_names``: every MoE layer of the whole model (all stages), in module order; position i is
    MoE layer i's global index, the same on every rank (the non-finite guard's rows, its debug hook's LAYER).
    """

    def __init__(self, config: ModelConfig, stages: list[StageModule]):
        super().__init__()
        self.config = config
        with meta_device():  # the whole model's names from its config; allocates nothing
            self.moe_layer_names = tuple(name for name, _ in moe_layers(Transformer(config)))
        first = [s for s in stages if s.is_first]
        last = [s for s in stages if s.is_last]
        self.embed = first[0].embed if first else last[0].embed if last else None
        blocks = sorted(((int(k), b) for s in stages for k, b in s.layers.items()), key=lambda kb: kb[0])
        self.layers = StageLayers({str(i): b for i, b in blocks})
        self.norm = last[0].norm if last else None
        self.lm_head = last[0].lm_head if last else None
        self.mtp = last[0].mtp if last else None
        self.stages = tuple(stages)  # a tuple is not registered: no second name for the same parameters

    def forward(self, *args, **kwargs):
        raise RuntimeError("PipelineModel holds one rank's pipeline stages; run micro-batches with Pipeline.step "
                           "(or Pipeline.evaluate)")


def whole_structure(model: nn.Module) -> nn.Module:
    """The model whose structure a whole-model operation follows (HF import / export, upcycling): ``model``, or for
    a pipeline rank's PipelineModel the whole model on the meta device, with the import's family and folder."""
    if not hasattr(model, "stages"):
        return model
    with meta_device():
        whole = Transformer(model.config)
    for attr in ("hf_family", "hf_source"):
        if hasattr(model, attr):
            setattr(whole, attr, getattr(model, attr))
    return whole


def lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean next-token cross-entropy of one micro-batch from its logits [b, S, V] (a reference: the pipeline's
    last stage computes the same from hidden states, ``stage_loss``)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def stage_loss(output: Tensor, targets: Tensor) -> Tensor:
    """The runner's loss_fn: the last stage ran with the targets and returned its micro-batch's mean loss."""
    return output


# ---------------------------------------------------------------------------------------------------
# The pipeline
# ---------------------------------------------------------------------------------------------------


class Pipeline:
    """This rank's stages of a pipelined Transformer and the schedule that runs them.

    model:   PipelineModel, every parameter this rank holds (single-process names)
    ranges:  layer range of every stage of the pipeline (index = stage id)
    stage_ids: the stages this rank runs, in order
    """

    def __init__(self, model: PipelineModel, ranges: list[range], stage_ids: list[int], runner: PipelineRunner,
                 embedding_replica: bool = False):
        self.model, self.ranges, self.stage_ids, self.runner = model, ranges, stage_ids, runner
        # the embedding's two holders (module docstring): pipeline ranks 0 and pp - 1, when the last stage has one
        pp = dist.get_world_size(runner.group)
        me = dist.get_rank(runner.group)
        self.embedding_peer = (pp - 1 if me == 0 else 0) if embedding_replica and me in (0, pp - 1) else None

    def step(self, tokens: Tensor, targets: Tensor, microbatches: int) -> Tensor:
        """Forward and backward of one optimizer step's batch ``tokens``/``targets`` [B, S] in
        ``microbatches`` (M) equal contiguous micro-batches; gradients accumulate into ``model``'s
        parameters exactly as ``(loss_m / M).backward()`` per micro-batch would, provided the MoE layers'
        ``aux_loss_scale`` carries the 1/M (``moe.layer.set_aux_loss_scale(model, microbatches=M)``, once).
        The embedding's replica on the last stage gets the same gradient as stage 0's (module docstring).
        Returns the mean micro-batch loss, on every rank of the pipeline."""
        weight = self.model.embed.weight if self.embedding_peer is not None else None  # (FSDP swaps Parameters)
        if weight is None or not weight.requires_grad:  # no replica, or a frozen embedding (train.freezing)
            return self.runner.step((tokens,), targets, microbatches, kwargs={"tokens": tokens, "targets": targets})
        earlier, weight.grad = weight.grad, None  # exchange this step's part only: accumulation stays exact
        loss = self.runner.step((tokens,), targets, microbatches, kwargs={"tokens": tokens, "targets": targets})
        self._sum_embedding_grads(weight)
        if earlier is not None:
            local(weight.grad).add_(local(earlier))
        return loss

    def _sum_embedding_grads(self, weight: Tensor) -> None:
        """Ranks 0 and pp - 1 of the pipeline swap their embedding gradients (their local shards under FSDP, laid
        out alike: the two stages' data meshes have the same shape) and both add: a + b == b + a, bitwise."""
        weight.pipeline_replica = any(s.has_replica for s in self.model.stages)  # the gradient norm counts it once
        if weight.grad is None:  # e.g. MTP on sequences too short for any depth: this side added nothing
            weight.grad = torch.zeros_like(weight)
        mine = local(weight.grad)
        theirs = torch.empty_like(mine)
        group = self.runner.group
        ops = [dist.P2POp(dist.isend, mine, group=group, group_peer=self.embedding_peer),
               dist.P2POp(dist.irecv, theirs, group=group, group_peer=self.embedding_peer)]
        for request in dist.batch_isend_irecv(ops):
            request.wait()
        mine.add_(theirs)

    @torch.no_grad()
    def evaluate(self, tokens: Tensor, targets: Tensor, microbatches: int = 1) -> Tensor:
        """Mean micro-batch loss of a forward-only pass (call ``model.eval()`` first), on every pipeline rank."""
        return self.runner.evaluate((tokens,), targets, microbatches, kwargs={"tokens": tokens, "targets": targets})

    def pop_mtp_loss(self) -> Tensor | None:
        """The mean multi-token-prediction loss of the training micro-batches since the last call, on every rank of
        the pipeline (from the last stage's; collective over the pipeline), or None without depths."""
        if not self.model.config.mtp_layers:
            return None
        mine = [s.mtp_record.pop() for s in self.model.stages if s.is_last]
        value = mine[0] if mine and mine[0] is not None else torch.full((), float("nan"), device=self.runner.device)
        value = broadcast_from(value, self.runner.last_rank, self.runner.group)
        return None if value.isnan() else value

    def gather_load(self, load: dict) -> dict:
        """{layer name: LoadSummary} of this rank's stages -> the same for every stage, on every pipeline rank."""
        return gather_load(load, self.runner.group)


def build_pipeline(model: Transformer, topology, schedule: str = "1f1b", stages_per_rank: int = 1,
                   seq_len: int | None = None, activation_dtype: torch.dtype | None = None,
                   device: torch.device | None = None) -> Pipeline:
    """Split an initialised ``model`` into this rank's stages of ``topology``'s pipeline (``pp`` ranks,
    ``stages_per_rank`` stages each, balanced by ``layer_costs`` at ``seq_len``) and set up ``schedule``
    (gpipe | 1f1b | interleaved). The other layers' modules are not referenced: drop ``model`` after.
    ``activation_dtype``: of the hidden states sent between stages; None = the parameter dtype (fp32 and
    autocast runs); torch.bfloat16 when FSDP's MixedPrecisionPolicy computes with bf16 parameters.
    ``device``: where the stages will run; needed when ``model`` is still on the meta device (it is then
    parallelised, moved with ``to_empty`` and filled with models.init.init_weights, rank by rank)."""
    pp = topology.layout.pp
    check_schedule(schedule, pp, stages_per_rank)
    num_stages = pp * stages_per_rank
    check_pipeline_model(model.config, num_stages)
    costs = layer_costs(model.config, seq_len)
    ranges = balance_stages(costs.layers, num_stages, costs.embed, costs.head)
    stage_ids = stage_ids_of(topology.coords().pp, pp, stages_per_rank)
    replica = needs_embedding_replica(model.config, num_stages)
    stages = [StageModule(model, ranges[s], s == 0, s == num_stages - 1, replica) for s in stage_ids]
    for stage in stages:
        stage.activation_dtype = activation_dtype
    device = torch.device(device) if device is not None else next(model.parameters()).device
    if device.type == "meta":
        raise ValueError("build_pipeline: the model is on the meta device; pass device= (where the stages will run)")
    runner = PipelineRunner(stages, stage_ids, num_stages, topology.group("pp"), schedule, stage_loss, device)
    held = PipelineModel(model.config, stages)
    for attr in ("hf_family", "hf_source"):  # an imported model's family and folder: the HF export's defaults
        if hasattr(model, attr):
            setattr(held, attr, getattr(model, attr))
    return Pipeline(held, ranges, stage_ids, runner, replica)
