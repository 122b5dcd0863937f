"""Context parallelism: the ``cp`` ranks of a data rank split each of its sequences; attention gathers keys.

Long sequences are what make attention's activations outgrow a GPU; everything else in a block (norms,
projections, the MoE layer) is per token. So each CP rank keeps S / cp positions of every sequence
through the whole model, and only attention talks: it all-gathers the keys and values of the other
positions (Llama 3's "all-gather" context parallelism, torchtitan's ``allgather`` rotate method) and
computes its own queries' rows. The MoE layers route and dispatch the rank's own tokens, exactly as
a data-parallel rank's (comm.topology folds EP, gradient averaging and load counts over dp x fsdp x cp).

Load-balanced ("zigzag") sharding: with causal attention the last positions see the most keys, so the
sequence is cut into 2 * cp chunks of c = S / (2 cp) positions and rank r keeps chunks r and 2cp - 1 - r,
one cheap and one expensive: every rank then computes the same number of query-key pairs.

    S = 16, cp = 2, c = 4:   chunks   0    1    2    3
                             rank 0: [0:4]           [12:16]     positions 0-3, 12-15
                             rank 1:      [4:8] [8:12]           positions 4-7, 8-11

Keys and values are gathered once per layer and reordered into position order; the gather's backward
is a reduce-scatter (functional collectives: torch.compile traces them). Memory per rank: the full
[B, K, S, D] keys and values of one layer at a time (K key heads; MLA gathers its compressed latent,
kv_lora_rank + rope dims per position, and expands it locally), against S / cp of everything else.

Nothing here knows about models: ``ContextParallel`` is a strategy object that the attention modules
and the model call (``positions``, ``chunks``, ``gather``); ``apply_context_parallel`` plugs it into every
module that has a ``context_parallel`` attribute (models.parallelize's recipe). Multi-token prediction reads
the tokens past each position: its depths look them up in the gathered ids (models.mtp.context_depth_losses).
"""
from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torch import Tensor, nn

from moekit.comm.topology import LayoutError, Topology

# torch renamed the autograd all-gather (2.12); the older name stays for the GPU machines' torch 2.11
_all_gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
_all_gather_ids = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor  # no autograd


class ContextParallel:
    """This rank's share of every sequence (zigzag chunks, module docstring) and the key/value gather.

    ``degree``: cp; ``index``: this rank's position in its CP group; ``group``: the CP process group
    (None only for degree 1, which ``shard`` / ``positions`` serve as the identity)."""

    def __init__(self, degree: int, index: int, group=None):
        if degree < 1 or not 0 <= index < degree:
            raise ValueError(f"context parallel rank {index} of {degree} is invalid")
        self.degree, self.index, self.group = degree, index, group

    def __repr__(self) -> str:
        return f"ContextParallel(rank {self.index} of {self.degree}, zigzag)"

    def chunk(self, seq_len: int) -> int:
        """c: positions per chunk of a global sequence of ``seq_len`` (2 * degree chunks)."""
        check_sequence(seq_len, self.degree)
        return seq_len // (2 * self.degree)

    def chunks(self, local_len: int) -> list[tuple[int, int, int]]:
        """This rank's two chunks as (local start, global start, length), for ``local_len`` local positions."""
        c, r = local_len // 2, self.index
        return [(0, r * c, c), (c, (2 * self.degree - 1 - r) * c, c)]

    def positions(self, local_len: int, device=None) -> Tensor:
        """[local_len] int64: the global position of each local position."""
        return torch.cat([torch.arange(g, g + n, device=device) for _, g, n in self.chunks(local_len)])

    def shard(self, t: Tensor, dim: int = 1) -> Tensor:
        """This rank's positions of ``t``, whose ``dim`` is a whole sequence (tokens, targets: [B, S])."""
        S = t.shape[dim]
        c = self.chunk(S)
        return torch.cat([t.narrow(dim, g, c) for _, g, _ in self.chunks(2 * c)], dim=dim)

    def gather(self, t: Tensor, dim: int) -> Tensor:
        """Every rank's ``t`` along ``dim`` (this rank's positions) -> the whole sequence in position order;
        differentiable (the backward sums each position's gradient from every rank back to its owner)."""
        return self._gather(t, dim, _all_gather)

    def gather_ids(self, t: Tensor, dim: int = 1) -> Tensor:
        """``gather`` for tensors without gradients (token ids: the whole sequence's documents)."""
        return self._gather(t, dim, _all_gather_ids)

    def _gather(self, t: Tensor, dim: int, all_gather) -> Tensor:
        if self.degree == 1:
            return t
        x = t.movedim(dim, 0).contiguous()  # [S_local, ...]
        c = x.shape[0] // 2
        parts = all_gather(x, 0, self.group).view(self.degree, 2, c, *x.shape[1:])  # [rank, slot, c, ...]
        # slot 0 of rank r is chunk r, slot 1 chunk 2cp - 1 - r: slots 0 in rank order, then slots 1 reversed
        whole = torch.cat((parts[:, 0], parts[:, 1].flip(0)), dim=0).flatten(0, 1)  # [S, ...]
        return whole.movedim(0, dim)


def check_sequence(seq_len: int, cp: int) -> None:
    """A sequence splits into 2 * cp equal chunks (zigzag sharding), or a LayoutError naming the fix."""
    if cp > 1 and seq_len % (2 * cp):
        raise LayoutError(f"--cp {cp} splits each sequence into 2*cp = {2 * cp} equal chunks (zigzag, for balanced "
                          f"causal attention), but --seq-len {seq_len} is not a multiple of {2 * cp}; use e.g. "
                          f"--seq-len {max(1, seq_len // (2 * cp)) * 2 * cp}")


def check_context_parallel(config, cp: int, seq_len: int | None = None) -> None:
    """What context parallelism cannot run, refused before anything is built (LayoutError: value and fix)."""
    if cp == 1:
        return
    if seq_len is not None:
        check_sequence(seq_len, cp)


def apply_context_parallel(model: nn.Module, topology: Topology) -> ContextParallel | None:
    """Set the strategy on every module with a ``context_parallel`` attribute (the model or its pipeline
    stages: RoPE positions; attention: the key/value gather). Returns it (None when cp == 1)."""
    cp = topology.layout.cp
    if cp == 1:
        return None
    strategy = ContextParallel(cp, topology.members("cp").index(topology.rank), topology.group("cp"))
    set_attribute(model, "context_parallel", strategy)
    return strategy


def set_attribute(model: nn.Module, name: str, value) -> None:
    """``module.name = value`` on every module of ``model`` that has the attribute, a pipeline rank's stage modules
    included (models.pipeline.PipelineModel keeps them in ``stages``, outside its registered children)."""
    for root in (model, *getattr(model, "stages", ())):
        for module in root.modules():
            if hasattr(module, name):
                setattr(module, name, value)
