"""Tensor parallelism over the TP group: DTensor sharding of attention and dense MLPs, MoE token split.

    Attention   wq wk wv  column-wise (biases too): each rank computes N/tp query and K/tp key/value heads
                wo        row-wise: partial [B, S, H] outputs all-reduced into a replicated one (its bias, if
                          any, replicated and added once)
                sinks     (gpt-oss) sharded with the query heads: each rank holds its N/tp heads' logits
                q_norm, k_norm (qk_norm "head") replicated: each rank normalises its own heads, so their
                          gradients are partial over TP (returned for the "moe" gradient role, below);
                          qk_norm "full" (OLMoE, MiniMax-M2) normalises over all heads at once: its scale is sharded
                          with the heads (Shard(0)), the sum of squares all-reduced over TP (TPFullRMSNorm)
    MLA         wq | wq_b, wkv_b column-wise (N/tp heads), wo row-wise; wq_a, q_a_norm, wkv_a, kv_a_norm
                replicated. Their outputs reach the heads through a column-wise input, whose backward
                all-reduces the gradient, except the shared RoPE key (wkv_a's last rope columns), which each
                rank's heads use directly: a hook all-reduces that slice's gradient over TP, so every
                replicated MLA weight gets its full gradient (the "dense" role)
    Dense MLP   w_gate w_up column-wise (matching gate / up columns), w_out row-wise
    MoE layer   the TP ranks hold the same tokens (replicated activations), so routing them on every rank
                would compute each token tp times. Instead each rank takes a contiguous 1/tp slice of the
                tokens, routes and computes it (with its own EP group: EP groups are per TP position),
                and the slices are all-gathered back (Megatron's token de-duplication):

                    x [T, H] (same on all TP ranks) --slice--> [T/tp, H] --MoE--> [T/tp, H] --all-gather--> [T, H]

                backward: the gathered output's gradient is replicated, so each rank keeps its slice's rows;
                the slice's input gradient is all-gathered (every rank's x contributed only its slice).
    Replicated: embedding, norms, lm_head, the router, experts and shared expert (token split instead).
    Gated DeltaNet (models.linear_attention: Qwen3.5 / Qwen3-Next's linear layers) Nk/tp key and Nv/tp value heads
                a rank: wz wb wa column-wise, wo row-wise; wqkv and the convolution replicated, each rank reading
                its heads' q, k and v row blocks, as dt_bias, A_log and the gated norm its heads' entries: their
                gradients are partial over TP (the layer's ``tp_partial``, "moe" role below)
    MTP depths  (models.mtp) each depth's block as any block; its input norms and projection replicated. The
                depths run on the whole sequence after the main model, sequence parallel or not (their inputs
                are shifted along it), so their blocks take the plain TP plan and TP token split

The MoE token split is the layer's ``token_split`` strategy (``TPTokenSplit``, or ``SequenceParallelTokens``
whose input already is this rank's slice of the sequence); MoELayer.forward calls it.

Gradients: DTensor reduces what the sharded linears need. The MoE layer's parameters (and the
sequence-parallel norms) saw only this rank's token slice, so their gradients are partial sums over the TP
group: ``apply_tensor_parallel`` returns those norms, the recipe gives them the "moe" gradient role and
comm.grad_sync adds them up. Each rank's aux loss covers its slice: moe.layer.set_aux_loss_scale(...,
token_slices=tp) makes it count 1/tp (the mean over slices).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.nn.functional import all_reduce
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, parallelize_module

from moekit.comm.topology import LayoutError
from moekit.moe.layer import sequence_grid
from moekit.moe.load import moe_layers


def check_tensor_parallel(config, tp: int) -> None:
    """Head and width divisibility, before anything is sharded (``config``: a models.config.ModelConfig)."""
    if tp == 1:
        return
    heads = ("num_heads",) if getattr(config, "attention", "gqa") == "mla" else ("num_heads", "num_kv_heads")
    if getattr(config, "linear_attention", "none") != "none" and config.num_linear_layers:  # Gated DeltaNet's heads
        heads += ("linear_num_key_heads", "linear_num_value_heads")
    bad = {name: getattr(config, name) for name in heads if getattr(config, name) % tp}
    dense = [i for i in range(config.num_layers + getattr(config, "mtp_layers", 0)) if not config.is_moe_layer(i)]
    if dense and config.ffn_hidden_size % tp:  # the dense blocks' MLP width (MTP depths included)
        bad["ffn_hidden_size"] = config.ffn_hidden_size
    if bad:
        values = ", ".join(f"{k}={v}" for k, v in bad.items())
        raise LayoutError(f"--tp {tp} must divide {values}: tensor parallelism shards attention heads and the "
                          f"dense MLP width; choose tp dividing all of them")


def apply_tensor_parallel(model: nn.Module, topology, sequence_parallel: bool = False) -> list[nn.Module]:
    """Shard every block of ``model.layers`` over the TP mesh and split MoE tokens over the TP group.

    Returns the modules besides the MoE layers whose gradients are partial sums over the TP group (the
    per-head q/k norms, and the sequence-parallel norms).

    sequence_parallel: between the TP regions (norms, residual adds, the MoE layer) each rank keeps only
    its 1/tp slice of the sequence, so those activations take 1/tp of the memory; attention and dense MLP
    inputs are all-gathered over the sequence and their outputs reduce-scattered back (instead of one
    all-reduce: the same bytes). The sequence is split at the first block of each stage's layers and
    gathered after its last, so a pipeline stage sends and receives whole sequences.
    """
    tp = topology.layout.tp
    if tp == 1:
        return []
    mesh = topology.mesh("world")["tp"]
    group = topology.group("tp")
    rank = topology.members("tp").index(topology.rank)
    blocks = list(model.layers.values() if isinstance(model.layers, nn.ModuleDict) else model.layers)
    partial = []  # modules whose gradients are partial sums over TP
    for block in blocks:
        partial += _shard_block(block, mesh, group, sequence_parallel)
    split = SequenceParallelTokens(rank, tp) if sequence_parallel else TPTokenSplit(group, rank, tp)
    for _, layer in moe_layers(model):
        layer.token_split = split
    for depth in getattr(model, "mtp", None) or ():  # multi-token prediction: whole sequences (module docstring)
        partial += _shard_block(depth.block, mesh, group, sequence_parallel=False)
        for _, layer in moe_layers(depth.block):
            layer.token_split = TPTokenSplit(group, rank, tp)
    if not sequence_parallel:
        return partial
    for root in getattr(model, "stages", (model,)):  # each pipeline stage sends and receives whole sequences
        stage_blocks = list(root.layers)
        if stage_blocks:
            stage_blocks[0].register_forward_pre_hook(
                lambda m, args: (_slice_sequence(args[0], rank, tp, group),) + args[1:])
            stage_blocks[-1].register_forward_hook(
                lambda m, args, out: _GatherTokens.apply(out, rank, [out.shape[1]] * tp, group, 1))  # S % tp == 0
    # norms see only this rank's positions: their gradients are partial over TP
    return partial + [norm for block in blocks for norm in (block.attn_norm, block.ffn_norm)]


def _shard_block(block: nn.Module, mesh, group, sequence_parallel: bool) -> list[nn.Module]:
    """Shard one block's attention and dense MLP over the TP mesh; returns its per-head q/k norms, whose gradients
    are partial over TP."""
    plan = _block_plan(block, sequence_parallel)
    parallelize_module(block, mesh, plan)
    for name, style in plan.items():  # LoRA adapters (models.lora): a column-wise projection's A replicated
        module = block.get_submodule(name)
        if isinstance(style, ColwiseParallel) and hasattr(module, "lora_a"):
            _replicate(module, "lora_a", mesh)
    attn = block.attn
    if hasattr(attn, "tp_partial"):  # Gated DeltaNet: its heads' rows of the replicated fused projection (module doc)
        attn.tp = (dist.get_rank(group), dist.get_world_size(group), group)
        return []
    if getattr(attn, "sinks", None) is not None:  # gpt-oss: one logit per query head, sharded like the heads
        attn.sinks = nn.Parameter(distribute_tensor(attn.sinks.data, mesh, [Shard(0)]))
    if hasattr(attn, "wkv_a"):  # MLA: the shared rope key's gradient is partial over the heads' ranks
        attn.wkv_a.register_forward_hook(
            lambda m, args, out, start=attn.kv_lora_rank: _ReduceGradTail.apply(out, start, group))
    if getattr(attn, "qk_norm", "none") == "full":  # over the whole (sharded) projection: all-reduced
        for name in ("q_norm", "k_norm"):
            setattr(attn, name, TPFullRMSNorm(getattr(attn, name), mesh, group))
        return []
    if hasattr(attn, "q_norm"):
        return [attn.q_norm, attn.k_norm]  # qk_norm "head": replicated, each rank's heads
    return []


def _replicate(module: nn.Module, name: str, mesh) -> None:
    """Re-place ``module.name`` (a DTensor ColwiseParallel sharded on dim 0, still on the meta device or holding
    values) as replicated over the TP mesh. A column-wise projection's LoRA A [r, in] then computes the [T, r] product
    whole on every rank (ColwiseParallel's split of r would make DTensor all-gather it in forward and reduce-scatter
    its gradient in backward, per micro-batch); its gradient comes out partial and comm.grad_sync.match_grad_placements
    all-reduces it once per step (r x in elements)."""
    p = getattr(module, name)
    full = p.full_tensor() if not p.is_meta else torch.empty(p.shape, dtype=p.dtype, device="meta")
    module.register_parameter(name, nn.Parameter(distribute_tensor(full, mesh, [Replicate()]),
                                                 requires_grad=p.requires_grad))


class TPFullRMSNorm(nn.Module):
    """RMSNorm over a projection whose columns are sharded over the TP group (qk_norm "full" under TP): each rank
    holds its heads' columns of x [..., n/tp] and of the scale (a DTensor, Shard(0)); the mean square is over all n
    columns, so the local sums of squares are all-reduced (differentiably: backward all-reduces their gradient,
    since every rank's output depends on every rank's columns)."""

    def __init__(self, norm: nn.RMSNorm, mesh, group):
        super().__init__()
        self.eps, self.group, self.full = norm.eps, group, norm.normalized_shape[0]
        self.weight = nn.Parameter(distribute_tensor(norm.weight.data, mesh, [Shard(0)]))

    def forward(self, x: Tensor) -> Tensor:
        eps = torch.finfo(x.dtype).eps if self.eps is None else self.eps  # nn.RMSNorm's default
        squares = all_reduce(x.float().pow(2).sum(-1, keepdim=True), group=self.group)  # [..., 1] over all columns
        y = x.float() * torch.rsqrt(squares / self.full + eps)
        return y.to(x.dtype) * self.weight.to_local()


def _block_plan(block: nn.Module, sequence_parallel: bool) -> dict:
    seq = Shard(1)  # [B, S, H] activations sharded over S
    out = dict(output_layouts=seq) if sequence_parallel else {}
    heads = ("wq", "wk", "wv", "wq_b", "wkv_b", "wz", "wb", "wa")  # GQA's q/k/v, MLA's query and key/value
    # up-projections, Gated DeltaNet's gate and per-head projections
    plan = {f"attn.{w}": ColwiseParallel() for w in heads if hasattr(block.attn, w)}
    plan["attn.wo"] = RowwiseParallel(**out)
    if sequence_parallel:  # attention needs every position: gather the sequence (backward: reduce-scatter)
        # MLA's replicated projections (wkv_a, wq_a) and Gated DeltaNet's wqkv are plain modules: they get the
        # gathered local tensor, whose gradient is complete on every rank (see the module docstring), as without
        # sequence parallelism
        local = hasattr(block.attn, "wkv_a") or hasattr(block.attn, "tp_partial")
        plan["attn"] = PrepareModuleInput(input_layouts=(seq, None, None),
                                          desired_input_layouts=(Replicate(), None, None), use_local_output=local)
    if not block.is_moe:
        plan.update({"ffn.w_up": ColwiseParallel(), "ffn.w_out": RowwiseParallel(**out)})
        if block.ffn.w_gate is not None:
            plan["ffn.w_gate"] = ColwiseParallel()
        if sequence_parallel:
            plan["ffn"] = PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),))
    return plan


def check_sequence_parallel(seq_len: int, tp: int) -> None:
    if tp == 1:
        raise LayoutError("layout.sequence_parallel splits each sequence over the tensor-parallel ranks, and --tp "
                          "is 1; use --tp > 1, or turn layout.sequence_parallel off")
    if seq_len % tp:
        raise LayoutError(f"sequence parallelism splits each sequence over the TP ranks: seq_len={seq_len} is not "
                          f"divisible by --tp {tp}; choose a seq_len that is, or turn layout.sequence_parallel off")


def split_sizes(tokens: int, parts: int) -> list[int]:
    """Contiguous near-equal slices (torch.tensor_split's sizes): any token count works, e.g. 7 over 2 = [4, 3]."""
    return [tokens // parts + (i < tokens % parts) for i in range(parts)]


def _all_gather_rows(x: Tensor, sizes: list[int], group, dim: int = 0) -> Tensor:
    """Concatenate every rank's slice (``sizes[r]`` along ``dim`` on rank r) in rank order; pads to the largest."""
    x = x.movedim(dim, 0)
    most = max(sizes)
    padded = x.new_zeros((most,) + x.shape[1:])
    padded[: x.shape[0]] = x
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded.contiguous(), group=group)
    return torch.cat([p[:n] for p, n in zip(parts, sizes)]).movedim(0, dim).contiguous()  # e.g. sent to a stage


class _ReduceGradTail(torch.autograd.Function):
    """Identity forward; backward all-reduces the gradient's last-dim slice [start:] over ``group`` (the rest
    is already complete: MLA's wkv_a output, whose rope slice each TP rank's heads use directly)."""

    @staticmethod
    def forward(ctx, y: Tensor, start: int, group) -> Tensor:
        ctx.start, ctx.group = start, group
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.clone()
        tail = grad[..., ctx.start :].contiguous()
        dist.all_reduce(tail, group=ctx.group)
        grad[..., ctx.start :] = tail
        return grad, None, None


class _SliceTokens(torch.autograd.Function):
    """Replicated x -> this rank's slice along ``dim``; backward all-gathers every rank's slice gradient."""

    @staticmethod
    def forward(ctx, x: Tensor, rank: int, parts: int, group, dim: int = 0) -> Tensor:
        ctx.sizes, ctx.group, ctx.dim = split_sizes(x.shape[dim], parts), group, dim
        return x.narrow(dim, sum(ctx.sizes[:rank]), ctx.sizes[rank])

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _all_gather_rows(grad, ctx.sizes, ctx.group, ctx.dim), None, None, None, None


class _GatherTokens(torch.autograd.Function):
    """This rank's slice -> the replicated whole (``sizes``: every rank's slice length along ``dim``);
    backward keeps this rank's slice of the gradient: every rank computes the same thing from the whole,
    so its gradient is already complete."""

    @staticmethod
    def forward(ctx, y: Tensor, rank: int, sizes: list[int], group, dim: int = 0) -> Tensor:
        ctx.start, ctx.n, ctx.dim = sum(sizes[:rank]), sizes[rank], dim
        return _all_gather_rows(y, sizes, group, dim)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad.narrow(ctx.dim, ctx.start, ctx.n).contiguous(), None, None, None, None


def _slice_sequence(x: Tensor, rank: int, parts: int, group) -> Tensor:
    # [B, S, H] -> [B, S/tp, H], copied: a view would keep the whole [B, S, H] alive as long as the
    # first norm saves its input for backward
    return _SliceTokens.apply(x, rank, parts, group, 1).clone()


class TPTokenSplit:
    """moe TokenSplit over the TP group: the TP ranks hold the same tokens (replicated input), each routes
    a contiguous 1/tp slice and the outputs are all-gathered (module docstring)."""

    def __init__(self, group, rank: int, parts: int):
        self.group, self.rank, self.parts = group, rank, parts

    def split(self, x: Tensor, token_ids: Tensor | None) -> tuple[Tensor, Tensor | None, list[int]]:
        flat = x.reshape(-1, x.shape[-1])  # [T, H], the same on every TP rank
        sizes = split_sizes(flat.shape[0], self.parts)
        start = sum(sizes[: self.rank])
        mine = _SliceTokens.apply(flat, self.rank, self.parts, self.group)  # [T/tp, H]
        ids = None if token_ids is None else token_ids.reshape(-1)[start : start + sizes[self.rank]]
        return mine, ids, sizes

    def gather(self, y: Tensor, sizes: list[int]) -> Tensor:
        return _GatherTokens.apply(y, self.rank, sizes, self.group)  # [T, H] on every TP rank

    def sequences(self, x: Tensor):
        """This rank's slice of the flattened tokens among the sequences (a slice may cut a sequence)."""
        whole = sequence_grid(x)
        sizes = split_sizes(whole.length * whole.count, self.parts)
        return sequence_grid(x, offset=sum(sizes[: self.rank]))


class SequenceParallelTokens:
    """moe TokenSplit under sequence parallelism: the input already is this rank's slice of the sequence
    ([B, S/tp, H]), so only the token ids [B, S] (hash router) follow it; the outputs stay sliced."""

    def __init__(self, rank: int, parts: int):
        self.rank, self.parts = rank, parts

    def split(self, x: Tensor, token_ids: Tensor | None) -> tuple[Tensor, Tensor | None, None]:
        ids = None if token_ids is None else token_ids.narrow(1, self.rank * x.shape[1], x.shape[1]).reshape(-1)
        return x.reshape(-1, x.shape[-1]), ids, None  # [B*S/tp, H], [B*S/tp]

    def gather(self, y: Tensor, meta: None) -> Tensor:
        return y

    def sequences(self, x: Tensor):
        return sequence_grid(x)  # x is this rank's [B, S/tp, H]: its slice of every sequence
