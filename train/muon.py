"""Muon for the weight matrices, AdamW for the rest, in one optimizer (``--train.optimizer muon``).

Muon (Jordan et al. 2024; at scale: Moonlight, Liu et al. 2025; Kimi K2; GLM-4.5) replaces each weight matrix's
update by the orthogonalised momentum: with B the momentum buffer of the gradient G,

    B <- mu B + G,   U = G + mu B (Nesterov) or B,   O = NS5(U) ~ the orthogonal factor of U's SVD
    W <- W - lr * wd * W - lr * 0.2 * sqrt(max(rows, cols)) * O

NS5 is five steps of the quintic Newton-Schulz iteration X <- aX + (b A + c A^2) X, A = X X^T, on U scaled to
unit Frobenius norm (coefficients a, b, c = 3.4445, -4.7750, 2.0315, the published tuned quintic), in float32.
The 0.2 * sqrt(max(rows, cols)) factor (Moonlight's) gives the update AdamW's RMS, so one learning rate and one
weight decay serve both groups, as in Moonlight's recipe.

What is a matrix here: every weight with two or more dims except the embedding and the output head (AdamW
keeps those, Moonlight's choice), so attention and dense projections, routers, shared experts, MTP projections,
and every expert of an expert stack [E, in, out] on its own (batched). A gated expert stack's w_in
[E, H, 2F] is two matrices per expert, gate and up, as transformers stores them. Norm scales, biases (expert
biases included), sinks and the embedding and head take AdamW (decoupled weight decay on the embedding and head,
as the AdamW optimizer does).

Layouts: every expert keeps its whole matrices on one expert-parallel rank, and data / context / pipeline ranks
hold whole tensors, so there each rank orthogonalises its own local matrices. FSDP and tensor parallelism cut
matrices across the R ranks of a group (an expert stack keeps its expert-parallel dim 0 local). Those matrices are
spread over the group (``spread``, the default), in batches of R, one matrix per rank:

    all-to-all     every rank sends its shard of matrix j to rank j
    rank j         assembles matrix j whole, orthogonalises it
    all-to-all     rank j sends every rank its shard of the update

so each rank runs Newton-Schulz on 1/R of the group's matrices, and receives (and holds whole) one matrix per
batch instead of all of them. ``spread=False`` all-gathers each matrix on every rank of the group and
orthogonalises it there (R times the work; the reference the spread step equals bit for bit). A matrix cut along
two mesh dims at once (FSDP over TP) or by FSDP's strided shards takes that all-gather path. Groups run in one
order on every rank (by their ranks), so no two ranks wait on each other's groups. Every layout computes one
process's update (tools/bench/muon_step.py times both paths).
"""
from __future__ import annotations

import math
from functools import reduce

import torch
import torch.distributed as dist
from torch import Tensor, nn

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


BATCH_ELEMENTS = 1 << 26  # matrices of a batch (an expert stack) orthogonalised together, at most this many values


def orthogonalize(g: Tensor, steps: int = 5, eps: float = 1e-7) -> Tensor:
    """NS5(g) for g [..., m, n] (a batch of matrices), float32: approximately U V^T of g = U S V^T, its singular
    values pushed into roughly [0.7, 1.2] (the iteration's tuned fixed point, not exactly 1). A batch larger than
    BATCH_ELEMENTS runs in slices of whole matrices, so the iteration's temporaries (about 4x its input) stay
    bounded for a large expert stack."""
    if g.dim() > 2 and g.numel() > BATCH_ELEMENTS:
        flat = g.reshape(-1, *g.shape[-2:])
        step = max(1, BATCH_ELEMENTS // (g.shape[-2] * g.shape[-1]))
        return torch.cat([_orthogonalize(flat[i : i + step], steps, eps) for i in range(0, flat.shape[0], step)])\
            .view(g.shape)
    return _orthogonalize(g, steps, eps)


def _orthogonalize(g: Tensor, steps: int, eps: float) -> Tensor:
    a, b, c = NS_COEFFICIENTS
    x = g.float()
    wide = x.shape[-2] > x.shape[-1]
    if wide:  # iterate on the side with fewer rows: A = X X^T is the smaller square
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + eps)
    for _ in range(steps):
        A = x @ x.mT
        x = a * x + (b * A + c * A @ A) @ x
    return x.mT if wide else x


def _local(t: Tensor) -> Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _whole_matrices(u: Tensor):
    """(u's local matrices made whole, a function taking such an update back to this rank's shard). A DTensor
    sharded along a matrix dim (FSDP, TP) is all-gathered along it; an expert stack's dim 0 (expert parallelism)
    stays sharded: its local experts are whole matrices already."""
    if not hasattr(u, "to_local"):
        return u, lambda x: x
    from torch.distributed.tensor import DTensor, Replicate, Shard

    keep = [p if isinstance(p, Shard) and p.dim == 0 and u.dim() == 3 else
            (Replicate() if isinstance(p, Shard) else p) for p in u.placements]
    if list(keep) == list(u.placements):
        return u.to_local(), lambda x: x
    mesh, placements, shape, stride = u.device_mesh, u.placements, u.shape, u.stride()
    whole = u.redistribute(mesh, keep).to_local()

    def back(x: Tensor) -> Tensor:  # Replicate -> Shard: each rank takes its chunk, no communication
        full = DTensor.from_local(x, mesh, keep, run_check=False, shape=shape, stride=stride)
        return full.redistribute(mesh, placements).to_local()

    return whole, back


def _orthogonalize_parts(u: Tensor, n: int, steps: int) -> Tensor:
    """NS5 of ``u``'s matrices; a gated stack (n = 2) orthogonalises gate and up (last-dim halves) apart."""
    if n == 1:
        return orthogonalize(u, steps)
    return torch.cat([orthogonalize(x, steps) for x in u.chunk(n, dim=-1)], dim=-1)


def _apply(p: Tensor, update: Tensor, group: dict, whole_shape, n: int) -> None:
    """Decoupled weight decay, then the update at AdamW's RMS (0.2 sqrt(max(rows, cols)) of one whole matrix)."""
    lr, wd = group["lr"], group["weight_decay"]
    rows, cols = whole_shape[-2], whole_shape[-1] // n
    w = _local(p)
    if wd:
        w.mul_(1 - lr * wd)
    w.add_(update.to(w.dtype), alpha=-lr * 0.2 * math.sqrt(max(rows, cols)))


class _Cut:
    """The one mesh dim along which a DTensor parameter's matrices are cut: ``dim`` (the tensor dim), its process
    group of ``size`` ranks, this rank's ``index`` in it, and ``key``, which orders groups alike on every rank."""

    def __init__(self, dim: int, group, size: int, index: int, key: tuple):
        self.dim, self.group, self.size, self.index, self.key = dim, group, size, index, key


def _cut(p: Tensor) -> _Cut | None:
    """p's _Cut when its matrices are cut along exactly one mesh dim by a plain Shard (FSDP or TP alone); None
    for a plain tensor, a whole one, or one cut twice or by FSDP's strided shards (the all-gather path)."""
    if not hasattr(p, "placements"):
        return None
    from torch.distributed.tensor import Shard

    mesh, cuts = p.device_mesh, []
    for m, place in enumerate(p.placements):
        if place.is_partial() or (isinstance(place, Shard) and type(place) is not Shard):
            return None  # a pending sum, or _StridedShard (FSDP over TP on the same dim)
        if isinstance(place, Shard) and not (place.dim == 0 and p.dim() == 3) and mesh.size(m) > 1:
            cuts.append((m, place.dim))
    if len(cuts) != 1:
        return None
    m, d = cuts[0]
    if sum(isinstance(q, Shard) and q.dim == d for q in p.placements) > 1:
        return None
    group = mesh.get_group(m)
    ranks = tuple(dist.get_process_group_ranks(group))
    coord = mesh.get_coordinate()
    along = mesh.mesh[tuple(slice(None) if k == m else c for k, c in enumerate(coord))].tolist()
    if list(ranks) != along:  # the group's ranks not in shard order: the all-gather path needs no such match
        return None
    return _Cut(d, group, mesh.size(m), coord[m], ranks)


def _whole_shape(p: Tensor, u: Tensor, cut: _Cut) -> list[int]:
    """The shape of ``u`` (this rank's shard of p's update) made whole along the cut."""
    shape = list(u.shape)
    shape[cut.dim] = p.shape[cut.dim]
    return shape


def _chunk_span(n: int, parts: int, i: int) -> tuple[int, int]:
    """(start, length) of chunk i of n indices in ``parts``, as DTensor's Shard cuts them (torch.chunk: ceil-sized
    chunks, the last ones short or empty)."""
    size = -(-n // parts)
    begin = min(i * size, n)
    return begin, min(size, n - begin)


def _wire_dtype(dtype: torch.dtype, group) -> torch.dtype:
    """What the spread step sends: the update's own dtype, or float32 where gloo has no kernel for it."""
    if dist.get_backend(group) == "gloo" and dtype not in (torch.float32, torch.float64, torch.float16):
        return torch.float32
    return dtype


class Muon(torch.optim.Optimizer):
    """Param groups carry ``kind``: "muon" (matrices: ``momentum``, ``nesterov``, ``ns_steps``, and per parameter
    ``chunks`` along the last dim, 2 for a gated expert stack's w_in) or "adamw" (``betas``, ``eps``). Both take
    ``lr`` and ``weight_decay`` (decoupled). Build one for a model with ``muon_param_groups``. ``spread``: share
    the orthogonalisation of matrices cut over FSDP / TP ranks among them (module docstring)."""

    def __init__(self, groups: list[dict], lr: float, betas=(0.9, 0.95), eps: float = 1e-8, momentum: float = 0.95,
                 nesterov: bool = True, ns_steps: int = 5, spread: bool = True):
        defaults = dict(lr=lr, weight_decay=0.0, betas=betas, eps=eps, momentum=momentum, nesterov=nesterov,
                        ns_steps=ns_steps, kind="adamw", chunks=None)
        super().__init__(groups, defaults)
        self.spread = spread
        self._cuts: dict[int, _Cut | None] = {}  # id(param) -> its cut (placements do not change)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        spread: dict[tuple, list] = {}  # cut group's key -> [(param, local update input, chunks, group, cut)]
        for group in self.param_groups:
            if group["kind"] == "muon":
                self._muon(group, spread)
            else:
                self._adamw(group)
        for key in sorted(spread):  # the same order on every rank: no two ranks wait on each other's groups
            self._spread(spread[key])
        return loss

    def _muon(self, group: dict, spread: dict) -> None:
        mu = group["momentum"]
        chunks = group["chunks"] or [1] * len(group["params"])
        for p, n in zip(group["params"], chunks):
            if p.grad is None:
                continue
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            g, buf = _local(p.grad), _local(state["momentum_buffer"])
            buf.mul_(mu).add_(g)
            u = g.add(buf, alpha=mu) if group["nesterov"] else buf
            if id(p) not in self._cuts:
                self._cuts[id(p)] = _cut(p) if self.spread else None
            cut = self._cuts[id(p)]
            if cut is not None:  # orthogonalised by one rank of the cut's group (_spread)
                spread.setdefault(cut.key, []).append((p, u, n, group, cut))
                continue
            if hasattr(p, "to_local"):  # FSDP / TP shards: the whole matrices (EP's experts stay local)
                u = type(p).from_local(u, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                       stride=p.stride())
            u, back = _whole_matrices(u)
            _apply(p, back(_orthogonalize_parts(u, n, group["ns_steps"])), group, u.shape, n)

    def _spread(self, items: list) -> None:
        """Orthogonalise matrices cut over one group's R ranks, one matrix per rank per batch of R (module
        docstring): an all-to-all brings rank j every shard of matrix j, rank j orthogonalises it whole, a second
        all-to-all returns each rank its shard of the update."""
        group_, R, me = items[0][4].group, items[0][4].size, items[0][4].index
        for start in range(0, len(items), R):
            batch = items[start:start + R]
            dtype = _wire_dtype(reduce(torch.promote_types, [u.dtype for _, u, *_ in batch]), group_)
            send = torch.cat([u.reshape(-1).to(dtype) for _, u, *_ in batch])
            sent = [u.numel() for _, u, *_ in batch] + [0] * (R - len(batch))
            got, spans = [0] * R, []
            if me < len(batch):  # this rank orthogonalises batch[me]: every rank's shard of it comes here
                p, u, n, group, cut = batch[me]
                whole_shape = _whole_shape(p, u, cut)
                spans = [_chunk_span(whole_shape[cut.dim], R, i) for i in range(R)]  # rank i's indices
                across = math.prod(whole_shape) // whole_shape[cut.dim] if whole_shape[cut.dim] else 0
                got = [across * length for _, length in spans]
            recv = send.new_empty(sum(got))
            dist.all_to_all_single(recv, send, got, sent, group=group_)
            if spans:
                whole = recv.new_empty(whole_shape)
                for (begin, length), piece in zip(spans, recv.split(got)):
                    part = whole.narrow(cut.dim, begin, length)
                    part.copy_(piece.view(part.shape))
                update = _orthogonalize_parts(whole, n, group["ns_steps"])
                back = torch.cat([update.narrow(cut.dim, b, k).reshape(-1) for b, k in spans])
            else:
                back = torch.empty(0, dtype=torch.float32, device=send.device)
            updates = back.new_empty(sum(sent))
            dist.all_to_all_single(updates, back, sent, got, group=group_)
            for (p, u, n, group, cut), piece in zip(batch, updates.split(sent)):
                _apply(p, piece.view(u.shape), group, _whole_shape(p, u, cut), n)

    def _adamw(self, group: dict) -> None:
        lr, wd, (b1, b2), eps = group["lr"], group["weight_decay"], group["betas"], group["eps"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if "step" not in state:
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            w, g = _local(p), _local(p.grad)
            m, v = _local(state["exp_avg"]), _local(state["exp_avg_sq"])
            state["step"] += 1
            t = float(state["step"])
            if wd:
                w.mul_(1 - lr * wd)
            m.lerp_(g, 1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            denom = (v / (1 - b2 ** t)).sqrt_().add_(eps)
            w.addcdiv_(m, denom, value=-lr / (1 - b1 ** t))


def muon_param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Muon's matrices and AdamW's rest (module docstring), with their weight decay."""
    from moekit.moe.activations import get_activation
    from moekit.moe.experts import GroupedExperts

    gated = {}  # id(w_in) of a gated expert stack -> 2
    for module in model.modules():
        if isinstance(module, GroupedExperts):
            act = get_activation(module.activation)
            gated[id(module.w_in)] = act.in_features(module.ffn_hidden_size) // module.ffn_hidden_size
    head = {id(p) for name, p in model.named_parameters()
            if name.endswith(("embed.weight", "lm_head.weight", "embed_tokens.weight"))}
    matrices, chunks, decayed, rest = [], [], [], []
    for name, p in model.named_parameters():
        bias = name.endswith(("bias", ".b_in", ".b_out", "sinks"))
        if p.dim() >= 2 and id(p) not in head and not bias:
            matrices.append(p)
            chunks.append(gated.get(id(p), 1))
        elif p.dim() >= 2:
            decayed.append(p)
        else:
            rest.append(p)
    return [{"params": matrices, "kind": "muon", "chunks": chunks, "weight_decay": weight_decay},
            {"params": decayed, "kind": "adamw", "weight_decay": weight_decay},
            {"params": rest, "kind": "adamw", "weight_decay": 0.0}]
