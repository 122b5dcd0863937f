"""HuggingFace import and export for a model already split by models.parallelize: no rank ever holds it whole.

    load_hf_sharded(model, path)   each rank reads only the slices of the checkpoint it holds
    save_hf_sharded(model, path)   each rank writes the HF tensors it owns into its own safetensors file
    FolderSlices(path)             a folder's tensors by moekit name, read box by box (sliced upcycling)

Every moekit tensor is a plain tensor (replicated: every rank has all of it) or a DTensor whose local part
is one box of the global tensor: TP (Shard over "tp"), FSDP (Shard / _StridedShard over "fsdp", experts
Shard(1) over "edp") and EP (experts Shard(0) over "ep": a rank holds the whole [E/ep, ...] block of its
experts, global shape [E, ...]). ``shard_box`` turns the placements into that box (one range per dim).
Each ``weights.Rule`` says where its HF tensors sit inside the moekit tensor (``Rule.layout``: an identity,
or per-expert ``Piece``s such as "expert e's gate is w_in[e, :, :F] transposed"), so a box of the moekit
tensor maps to boxes of HF tensors:

    load    box of w_in on this rank (experts 2..3, H/fsdp rows) -> for each HF tensor that meets it, the
            intersecting slice, read with safetensors' get_slice: bytes outside it are never read, and the
            keys of other ranks' experts are never opened
    export  one HF tensor at a time: its owner (the rank holding most of it, least loaded on ties)
            receives the other parts (send / recv from one rank per distinct shard), transposes and writes
            it. Peak extra memory: one HF tensor. Files: model-0000i-of-0000N.safetensors, each written by
            one rank (streamed: header first, then each tensor as it is assembled); rank 0 writes
            config.json and model.safetensors.index.json last, so a folder with an index is complete.

Failures: the checks (config, keys, shapes and counts from the file headers, as load_hf_into does) run
before any collective; their outcome, and that of reading or writing, is exchanged (``_agree``) so every
rank raises the same error and none is left waiting in a collective. ``path`` must be a file system every
rank sees. A pipeline rank (models.pipeline.PipelineModel) loads and exports its stages' tensors.

Expert placements (comm.placement): a placed expert tensor's rows are physical slots, each holding the logical
expert ``dispatcher.local_expert_ids`` names (replicas: the same expert in several slots). The load reads each
slot's row from its logical expert's HF tensors, so a placed model loads by slices like any other.

Tensors the folder does not hold (multi-token-prediction depths beyond the folder's, models.mtp) start from
``init_seed`` by models.init, exactly as the whole model initialised and then loaded would.

This file holds the box arithmetic, the cross-rank agreement and the load; models/hf/sharded_export.py holds
the export (re-exported here).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import Tensor
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from moekit.models.hf import fp8
from moekit.models.hf.io import CheckpointReader
from moekit.models.hf.mxfp4 import dequantize_mxfp4
from moekit.models.hf.weights import Rule, check_keys, woven_index

__all__ = ["FolderSlices", "load_hf_sharded", "save_hf_sharded", "shard_box"]

Box = tuple[range, ...]


# ---------------------------------------------------------------------------------------------------
# Which part of a tensor this rank holds
# ---------------------------------------------------------------------------------------------------


def _chunk(seq: Sequence[int], parts: int, i: int) -> Sequence[int]:
    """torch.chunk's i-th piece (what DTensor's Shard keeps): ceil-sized pieces, the last ones short or empty."""
    size = -(-len(seq) // parts)
    return seq[i * size : (i + 1) * size]


def shard_box(t: Tensor, name: str = "tensor") -> Box:
    """The global indices of this rank's part of ``t`` (a DTensor's ``to_local()``, all of a plain tensor),
    one range per dim. Placements are replayed left to right as DTensor does: Shard(d) keeps chunk c of the
    indices along d; _StridedShard(d, sf) (FSDP over TP on the same dim) splits them into sf pieces and keeps
    chunk c of each. A part that is not one box (never made by moekit's layouts) is a ValueError."""
    if not isinstance(t, DTensor):
        return tuple(range(n) for n in t.shape)
    mesh, coord = t.device_mesh, t.device_mesh.get_coordinate()
    idx: list[Sequence[int]] = [range(n) for n in t.shape]
    for m, p in enumerate(t.placements):
        n, c = mesh.size(m), coord[m]
        if isinstance(p, _StridedShard):
            sf = int(p.split_factor)
            idx[p.dim] = [i for j in range(sf) for i in _chunk(_chunk(idx[p.dim], sf, j), n, c)]
        elif isinstance(p, Shard):
            idx[p.dim] = _chunk(idx[p.dim], n, c)
        elif p.is_partial():
            raise ValueError(f"{name} has a Partial placement ({t.placements}): pending sums cannot be saved or "
                             f"loaded; redistribute it to Replicate or Shard first")
    box = []
    for d, ix in enumerate(idx):
        if not isinstance(ix, range):  # Shard keeps a range; _StridedShard's pieces must join up again
            run = range(ix[0], ix[0] + len(ix)) if ix else range(0)
            if ix != list(run):
                raise ValueError(f"{name}: this rank's part along dim {d} is not contiguous (placements "
                                 f"{t.placements}); sharded HF load / export needs each rank's part to be one box")
            ix = run
        box.append(ix)
    local = t.to_local().shape
    if tuple(len(r) for r in box) != tuple(local):  # the replay must agree with DTensor's own split
        raise RuntimeError(f"{name}: computed local shape {[len(r) for r in box]} but the local tensor is "
                           f"{list(local)} (placements {t.placements})")
    return tuple(box)


def _local(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _meet(a: Box, b: Box) -> Box | None:
    out = tuple(range(max(x.start, y.start), min(x.stop, y.stop)) for x, y in zip(a, b))
    return None if any(len(r) == 0 for r in out) else out


def _rel(box: Box, origin: Box) -> tuple[slice, ...]:
    """``box`` as slices of a tensor whose indices start at ``origin``'s starts."""
    return tuple(slice(r.start - o.start, r.stop - o.start) for r, o in zip(box, origin))


def _to_target(part: Tensor, dims: tuple[int | None, ...], ndim: int) -> Tensor:
    """A source-ordered slice -> the target's dim order (dropped target dims back as size 1; source dims of
    size 1 the target lacks, ``None`` in ``dims``, dropped)."""
    if None in dims:
        part = part.squeeze([k for k, d in enumerate(dims) if d is None])
        dims = tuple(d for d in dims if d is not None)
    kept = sorted(dims)
    out = part.permute([dims.index(d) for d in kept])
    for d in range(ndim):
        if d not in dims:
            out = out.unsqueeze(d)
    return out


def _to_source(region: Tensor, dims: tuple[int | None, ...]) -> Tensor:
    """A target-ordered region (dropped dims of size 1) -> the HF tensor's dim order (``None``: a source dim of
    size 1 the target lacks)."""
    real = tuple(d for d in dims if d is not None)
    kept = sorted(real)
    out = region.reshape([region.shape[d] for d in kept]).permute([kept.index(d) for d in real])
    for k, d in enumerate(dims):
        if d is None:
            out = out.unsqueeze(k)
    return out


# ---------------------------------------------------------------------------------------------------
# Every rank fails together
# ---------------------------------------------------------------------------------------------------


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _agree(fn: Callable, *args):
    """``fn(*args)`` on every rank; when it raises on any rank, every rank raises the same error: the lowest
    failing rank's message (naming the failing ranks when not all failed), as a ValueError for bad input
    (a ValueError or safetensors' error), an OSError for an OSError (disk full, permissions), else a
    RuntimeError. One all_gather_object."""
    error, result = None, None
    try:
        result = fn(*args)
    except Exception as exc:  # noqa: BLE001  re-raised below, on every rank
        if not _distributed():
            raise
        error = exc
    if not _distributed():
        return result
    mine = None if error is None else (_kind(error), str(error))
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    failed = [r for r, e in enumerate(everyone) if e is not None]
    if not failed:
        return result
    kind, message = everyone[failed[0]]
    if len(failed) < len(everyone):
        message += f" (on rank{'s' if len(failed) > 1 else ''} {', '.join(map(str, failed))} of {len(everyone)})"
    raise {"value": ValueError, "os": OSError}.get(kind, RuntimeError)(message) from error


def _kind(exc: Exception) -> str:
    if isinstance(exc, OSError):
        return "os"
    return "value" if isinstance(exc, ValueError) or type(exc).__name__ == "SafetensorError" else "other"


def _reshard(model: torch.nn.Module) -> None:
    """FSDP modules back to their sharded parameters (after a forward the root may hold unsharded ones)."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


# ---------------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------------


class SliceReader:
    """Slices of a checkpoint's tensors by key (safetensors ``get_slice``); ``read`` records bytes per key.
    A block-wise float8 weight's slice comes dequantized (float32), read with just the scale blocks covering it
    (their bytes are recorded under the scale's own key)."""

    def __init__(self, reader: CheckpointReader):
        self.reader = reader
        self.bytes_read: dict[str, int] = {}
        self._handles: dict[Path, object] = {}

    def _slice(self, file: Path, key: str, index: tuple[slice, ...]) -> Tensor:
        if file not in self._handles:
            self._handles[file] = safe_open(str(file), framework="pt")
        part = self._handles[file].get_slice(self.reader.stored(key))[index]
        self.bytes_read[key] = self.bytes_read.get(key, 0) + part.numel() * part.element_size()
        return part

    def read(self, key: str, index: tuple[slice, ...]) -> Tensor:
        """The slice ``index`` of ``key`` (a stored key, or a derived one: CheckpointReader.derive)."""
        if key in self.reader.derived:  # rows of a fused tensor (Qwen3-Next): each run of consecutive source rows
            source, rows = self.reader.derived[key]  # (the fused tensor interleaves its parts by key-head group,
            want = rows[index[0]].tolist()  # so one span from the first row to the last would read the others')
            runs = [self.read(source, (slice(r.start, r.stop), *index[1:])) for _, r in _row_runs(want)]
            if not runs:
                return self.read(source, (slice(0, 0), *index[1:]))
            return runs[0] if len(runs) == 1 else torch.cat(runs)
        if key in self.reader.mxfp4:  # [E, in, out]: the experts' and outputs' blocks over every input, decoded
            bkey, skey = self.reader.mxfp4[key]
            e, i, o = index
            blocks = self._slice(self.reader._file(bkey), bkey, (e, o))
            scales = self._slice(self.reader._file(skey), skey, (e, o))
            return dequantize_mxfp4(blocks, scales, name=key)[:, i]
        info = self.reader.infos.get(key) or self.reader.source_info(key)
        part = self._slice(info.file, key, index)
        scale = self.reader.scales.get(key)
        if scale is None:
            return part
        block = self.reader.fp8.block
        blocks = fp8.check_scales(key, self._slice(scale.file, key + fp8.SCALE_SUFFIX,
                                                   fp8.scale_index(index, info.shape, block)))
        start = tuple(s.indices(n)[0] for s, n in zip(index[-2:], info.shape[-2:]))
        return fp8.dequantize(part, blocks, block, start)


def slot_experts(layer: torch.nn.Module) -> list[int] | None:
    """The logical expert of each local expert row of MoE ``layer`` under an expert placement
    (``dispatcher.local_expert_ids``: the rows are physical slots), else None (the rows are the shard's own)."""
    dispatcher = getattr(layer, "dispatcher", None)
    if getattr(dispatcher, "placement", None) is None:
        return None
    return [int(e) for e in dispatcher.local_expert_ids]


def placed_rows(model: torch.nn.Module) -> dict[str, list[int]]:
    """The expert tensors under an expert placement, by state-dict name: the logical expert of each local row
    (``slot_experts``; the tensor's global dim 0 counts physical slots)."""
    from moekit.moe.load import moe_layers

    names = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for _, layer in moe_layers(model):
        rows = slot_experts(layer)
        if rows is not None:
            for w in (layer.experts.w_in, layer.experts.w_out):
                out[names[id(w)]] = rows
    return out


def _row_runs(rows: list[int]) -> list[tuple[slice, range]]:
    """``rows`` (e.g. a placed tensor's local rows' logical experts) in runs of consecutive values: (positions in
    ``rows``, their values)."""
    runs, j = [], 0
    while j < len(rows):
        k = j
        while k + 1 < len(rows) and rows[k + 1] == rows[k] + 1:
            k += 1
        runs.append((slice(j, k + 1), range(rows[j], rows[k] + 1)))
        j = k + 1
    return runs


@dataclass
class _LoadPlan:
    reader: CheckpointReader
    rules: list[Rule]
    boxes: dict[str, Box]  # moekit key -> this rank's box
    rows: dict[str, list[int]]  # placed expert tensors (placed_rows): the logical expert of each local row
    fresh: list[str]  # model tensors the folder does not hold (MTP depths it lacks): initialised from the seed
    tied_copy: bool  # the checkpoint stores lm_head.weight for a tied model: it must equal the embedding
    family: str  # config.json's model_type
    mtp_copies: tuple = ()  # (checkpoint key, model tensor): MTP layers' copies of the embedding / head (LoadSpec)


def _logical_shape(t: Tensor, rows: list[int] | None, experts: int) -> tuple[int, ...]:
    return tuple(t.shape) if rows is None else (experts,) + tuple(t.shape[1:])


def _plan_load(model, path, check_config: bool, init_seed: int | None) -> _LoadPlan:
    """Everything load_hf_into checks (the same calls, in the same order, minus its data reads), from
    config.json and the safetensors headers only; plus this rank's box of every tensor."""
    from moekit.models.hf import plan_load
    from moekit.models.pipeline import whole_structure

    whole = whole_structure(model)  # a pipeline rank: the whole model on the meta device names every tensor and checks
    spec = plan_load(whole, path, check_config)
    state, rows = model.state_dict(), placed_rows(model)
    E = model.config.num_experts
    logical = {name: torch.empty(_logical_shape(state[name], placed, E), device="meta")
               for name, placed in rows.items()}  # the checkpoint's shapes: experts, not slots
    check_keys(spec.reader, spec.rules, {**whole.state_dict(), **state, **logical}, spec.allowed_extra)
    rules = [r for r in spec.rules if r.target in state]  # this rank's (a pipeline rank: its stages')
    boxes = {}
    for r in rules:
        if r.layout(_logical_shape(state[r.target], rows.get(r.target), E)) is None:
            raise ValueError(f"{r.target}: its HuggingFace rule has no slice layout (weights.Rule.pieces), so it "
                             f"cannot be loaded slice by slice; use load_hf_into before parallelize")
        boxes[r.target] = shard_box(state[r.target], r.target)
    fresh = sorted(n for n in state if n not in boxes)  # parameters and persistent buffers
    if fresh and init_seed is None:
        raise ValueError(f"{len(fresh)} model tensor(s) are not in {spec.reader.folder} ({', '.join(fresh[:4])}"
                         f"{', ...' if len(fresh) > 4 else ''}): pass init_seed to initialise them (models.init), or "
                         f"build the model with only what the folder holds")
    copies = tuple((key, main) for key, main in spec.mtp_copies if main in state)
    return _LoadPlan(spec.reader, rules, boxes, rows, fresh, spec.tied_copy and "embed.weight" in state,
                     spec.family.model_type, copies)


def _parts(rule: Rule, pieces, want: Box, slices: SliceReader):
    """(index into a tensor of box ``want``, its values in the target's dim order) for each HF tensor of ``rule``
    (laid out as ``pieces``) that meets the box; an HF tensor that does not is not even opened."""
    for source, (where, dims), woven in zip(rule.sources, pieces, rule.weaves()):
        meet = _meet(want, where)
        if meet is None:
            continue
        # the same box in the HF tensor's own indices and dim order
        index = [slice(0, 1) if d is None else slice(meet[d].start - where[d].start, meet[d].stop - where[d].start)
                 for d in dims]
        if woven is None:
            part = slices.read(source, tuple(index))
        else:  # interleaved along source dim k (Piece.interleave): the run that covers them, then those columns
            k, ways = woven
            src = woven_index(range(index[k].start, index[k].stop), len(where[dims[k]]), ways)
            lo = min(src)
            index[k] = slice(lo, max(src) + 1)
            part = slices.read(source, tuple(index)).index_select(k, torch.tensor([i - lo for i in src]))
        yield _rel(meet, want), _to_target(part, dims, len(want))


@torch.no_grad()
def _read_slices(model, plan: _LoadPlan, slices: SliceReader, init_seed: int | None) -> None:
    if plan.fresh:  # first, so the loaded tensors overwrite init_weights' norms and biases
        from moekit.models.init import canonical_name, init_weights

        init_weights(model, init_seed, only={canonical_name(n) for n in plan.fresh})
    state = model.state_dict()
    for r in plan.rules:
        target, box, rows = state[r.target], plan.boxes[r.target], plan.rows.get(r.target)
        local = _local(target)
        pieces = r.layout(_logical_shape(target, rows, model.config.num_experts))
        runs = [(local, box)] if rows is None else [(local[here], (indices,) + box[1:])
                                                    for here, indices in _row_runs(rows)]
        for dest, want in runs:  # a placement: each run of slots from its logical experts' rows
            for here, part in _parts(r, pieces, want, slices):
                dest[here].copy_(part)
    if plan.tied_copy:
        _check_tied_slice(model, plan, slices)
    for key, main in plan.mtp_copies:  # this rank's rows of each copy must equal the main tensor's
        local = _local(state[main])
        if local.numel():
            part = slices.read(key, tuple(slice(r.start, r.stop) for r in plan.boxes[main])).to(local.dtype)
            if not torch.equal(part, local.cpu()):
                from moekit.models.hf import mtp_copy_differs

                raise ValueError(mtp_copy_differs(plan.reader.folder, key, main))
    persistent = set(model.state_dict())  # to_empty() leaves buffers uninitialised; unsaved ones start at 0
    for name, buf in model.named_buffers():
        if name not in persistent:
            buf.zero_()


def _check_tied_slice(model, plan: _LoadPlan, slices: SliceReader) -> None:
    """A tied checkpoint that also stores lm_head.weight: this rank's rows of it must equal the embedding's."""
    embed = model.state_dict()["embed.weight"]
    box, local = plan.boxes["embed.weight"], _local(embed)
    if local.numel() == 0:
        return
    head = slices.read("lm_head.weight", tuple(slice(r.start, r.stop) for r in box)).to(local.dtype)
    if not torch.equal(head, local.cpu()):
        raise ValueError(_tied_differs(plan.reader.folder))


def _tied_differs(folder) -> str:
    return (f"{folder}/config.json has tie_word_embeddings=true but lm_head.weight differs from "
            f"model.embed_tokens.weight; set tie_word_embeddings to false")


def load_hf_sharded(model, path: str | Path, *, check_config: bool = True,
                    init_seed: int | None = None) -> dict[str, int]:
    """Fill an already parallelised ``model`` (models.parallelize) from a HuggingFace folder, each rank reading
    only the slices it holds. Call on every rank, collectively (one process without torch.distributed works
    too). ``model`` may have been built on the meta device, parallelised and moved with ``to_empty``: every
    parameter and persistent buffer is overwritten, the others zeroed. Placed experts read their logical
    experts' rows (module docstring).

    ``init_seed``: parameters the folder does not hold (MTP depths beyond the folder's) are initialised from it
    (models.init.init_weights: the values the whole model initialised from that seed has); without it they are
    a ValueError.

    Checks as load_hf_into (the config's math, missing / extra keys, shapes, counts), from the file headers
    before any data is read; any failure, on any rank, raises the same ValueError on every rank.
    Returns the bytes this rank read per checkpoint key.
    """
    _reshard(model)
    plan = _agree(_plan_load, model, path, check_config, init_seed)
    slices = SliceReader(plan.reader)
    _agree(_read_slices, model, plan, slices, init_seed)
    model.hf_family, model.hf_source = plan.family, Path(path)  # as load_hf_into: save_hf's default family
    return dict(slices.bytes_read)


class FolderSlices:
    """A HuggingFace folder's tensors by moekit state-dict name, read box by box; no model is built or held.

    The source of sliced upcycling (models.upcycle.upcycle_into): each rank reads just the parts of the dense
    model its shards are made from. Opening reads config.json and the safetensors headers and checks them as
    a load does (keys, shapes, counts); ``read`` reads data.

        config                the folder's ModelConfig (models.hf.config_from_hf)
        shapes                every moekit tensor's shape, by state-dict name
        read(name, box)       the tensor's values at ``box`` (one range per dim), in the folder's dtype (block
                              float8 dequantized to float32); a tied lm_head copy or an MTP layer's embedding /
                              head copy is read alongside and must be equal (else a ValueError)
        bytes_read            bytes read per checkpoint key
    """

    def __init__(self, path: str | Path):
        from moekit.models.hf import config_from_hf, plan_load
        from moekit.models.transformer import Transformer, meta_device

        self.folder = Path(path)
        self.config = config_from_hf(path)
        with meta_device():
            model = Transformer(self.config)
        spec = plan_load(model, path, check_config=False)  # the model is the folder's config
        state = model.state_dict()
        check_keys(spec.reader, spec.rules, state, spec.allowed_extra)
        self.shapes = {k: tuple(v.shape) for k, v in state.items()}
        self._rules = {r.target: r for r in spec.rules}
        for name, rule in self._rules.items():
            if rule.layout(self.shapes[name]) is None:
                raise ValueError(f"{name}: its HuggingFace rule has no slice layout (weights.Rule.pieces), so it "
                                 f"cannot be read slice by slice")
        self._copies: dict[str, list[str]] = {}  # model tensor -> checkpoint keys that must equal it
        if spec.tied_copy:
            self._copies["embed.weight"] = ["lm_head.weight"]
        for key, main in spec.mtp_copies:
            self._copies.setdefault(main, []).append(key)
        self._slices = SliceReader(spec.reader)

    @property
    def bytes_read(self) -> dict[str, int]:
        return self._slices.bytes_read

    def read(self, name: str, box: Box) -> Tensor:
        rule, shape = self._rules[name], self.shapes[name]
        out = None
        for here, part in _parts(rule, rule.layout(shape), tuple(box), self._slices):
            if out is None:
                out = torch.empty([len(r) for r in box], dtype=part.dtype)
            out[here].copy_(part)
        if out is None:  # an empty box
            return torch.empty([len(r) for r in box])
        for key in self._copies.get(name, ()):
            if not torch.equal(self._slices.read(key, tuple(slice(r.start, r.stop) for r in box)).to(out.dtype), out):
                if key == "lm_head.weight":
                    raise ValueError(_tied_differs(self.folder))
                from moekit.models.hf import mtp_copy_differs

                raise ValueError(mtp_copy_differs(self.folder, key, name))
        return out


from moekit.models.hf.sharded_export import save_hf_sharded  # noqa: E402  (uses the helpers above)
