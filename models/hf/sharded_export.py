"""``save_hf_sharded``: every rank writes the HF tensors it owns, nobody gathers the model (models/hf/sharded.py
has the picture, the box arithmetic and the load).

Pipeline parallelism: a rank holds only its stages' tensors (models.pipeline.PipelineModel, single-process
names). The export's structure (family, rules, zero-filled parts, config.json) then comes from the whole model
built on the meta device, each rank offers the tensors it holds, and a tensor two ranks hold alike (the last
stage's replica of the embedding) is taken from one of them, as data-parallel replicas are.

Expert placements (comm.placement): a placed expert tensor's rows are slots, each holding one logical expert.
Each slot then counts as its own piece, one expert row of the logical [E, ...] tensor, and a replicated expert
is a piece several ranks hold alike, taken from one of them as above.

One HF tensor at a time: its owner (the rank holding most of it, least loaded on ties) receives the other
parts (send / recv from one rank per distinct shard), transposes and writes it. Peak extra memory: one HF
tensor. Files: model-0000i-of-0000N.safetensors, each written by one rank (streamed: header first, then each
tensor as it is assembled); rank 0 writes config.json and model.safetensors.index.json last, so a folder with
an index is complete.

Fused tensors (Family.fuse: Qwen3-Next's in_proj_qkvz / in_proj_ba, each built from several of the tensors the
rules write): the units one module's fused tensors are made of (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a of
one linear layer) form a group with one owner, who assembles them one by one as above, applies the family's fuse
to them and writes the fused tensors (``_Fused``). Peak extra memory: one layer's group.
"""
from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor

from moekit.models.hf import fp8
from moekit.models.hf.families import FAMILIES
from moekit.models.hf.io import CONFIG_FILE, DTYPE_NAMES, INDEX_FILE, parse_size
from moekit.models.hf.mxfp4 import MXFP4_CONFIG, MXFP4_EXPERTS, quantize_mxfp4
from moekit.models.hf.sharded import (Box, _agree, _distributed, _local, _meet, _rel,
                                      _reshard, _to_source, placed_rows, shard_box)
from moekit.models.hf.weights import Rule, weave
from moekit.models.lora import fold_lora
from moekit.models.pipeline import whole_structure

__all__ = ["save_hf_sharded"]

# safetensors dtype names (the header's "dtype")
ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
             torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
             torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3"}


@dataclass
class _Unit:
    """One HF tensor: the region of a moekit tensor it is made of, who assembles it and from whom."""

    key: str
    target: str | None  # None: a part the family always has and the model lacks, written as zeros
    region: Box  # in the moekit tensor's indices
    dims: tuple[int | None, ...]  # target dim of each HF dim (None: a dim of size 1 the target lacks)
    dtype: torch.dtype  # on disk
    owner: int
    parts: list[tuple[int, Box]]  # (rank sending it, sub-box of region) for every part the owner lacks
    fp8_block: tuple[int, int] | None = None  # written as float8 + its weight_scale_inv (models/hf/fp8.py)
    woven: tuple[int, int] | None = None  # (HF dim, ways): written interleaved (weights.Piece.interleave)
    mxfp4: bool = False  # written as MXFP4 blocks and scales (gpt-oss's expert weights, models/hf/mxfp4.py)

    @property
    def shape(self) -> list[int]:
        return [1 if d is None else len(self.region[d]) for d in self.dims]

    @property
    def entries(self) -> list[tuple[str, torch.dtype, list[int]]]:
        """(key, dtype, shape) of each tensor this unit writes: itself, or a float8 weight and its scales."""
        if self.mxfp4:  # [E, in, out] -> blocks [E, out, in / 32, 16] and scales [E, out, in / 32]
            E, n_in, n_out = self.shape
            return [(self.key + "_blocks", torch.uint8, [E, n_out, n_in // 32, 16]),
                    (self.key + "_scales", torch.uint8, [E, n_out, n_in // 32])]
        if self.fp8_block is None:
            return [(self.key, self.dtype, self.shape)]
        return [(self.key, torch.float8_e4m3fn, self.shape),
                (self.key + fp8.SCALE_SUFFIX, torch.float32, list(fp8.grid(tuple(self.shape), self.fp8_block)))]

    @property
    def nbytes(self) -> int:
        return sum(math.prod(shape) * dtype.itemsize for _, dtype, shape in self.entries)

    def encode(self, value: Tensor) -> list[Tensor]:
        """The tensors of ``entries`` for this unit's assembled ``value`` (in the model's precision)."""
        if self.mxfp4:
            return list(quantize_mxfp4(value.float().cpu()))
        if self.fp8_block is None:
            return [value.to("cpu", self.dtype)]
        return [t.cpu() for t in fp8.quantize(value, self.fp8_block)]


@dataclass
class _Fused:
    """HF tensors a family fuses from several units (Family.fuse; Qwen3-Next's in_proj_qkvz and in_proj_ba of one
    linear layer): the owner assembles the members, fuses them and writes ``outputs``; written as one unit."""

    members: list[_Unit]  # every one owned by ``owner``, in plan order
    outputs: list[tuple[str, torch.dtype, list[int]]]  # (HF key, dtype, shape) of each fused tensor, before fp8
    fp8_block: tuple[int, int] | None  # save_hf's fp8 block (each output quantized when fp8.quantizable)
    owner: int

    @property
    def key(self) -> str:
        return self.outputs[0][0]

    def _block(self, key: str, shape: list[int]) -> tuple[int, int] | None:
        return self.fp8_block if self.fp8_block is not None and fp8.quantizable(key, tuple(shape)) else None

    @property
    def entries(self) -> list[tuple[str, torch.dtype, list[int]]]:
        out = []
        for key, dtype, shape in self.outputs:
            block = self._block(key, shape)
            scales = None if block is None else list(fp8.grid(tuple(shape), block))
            out += [(key, dtype, shape)] if block is None else [(key, torch.float8_e4m3fn, shape),
                                                                (key + fp8.SCALE_SUFFIX, torch.float32, scales)]
        return out

    @property
    def nbytes(self) -> int:
        return sum(math.prod(shape) * dtype.itemsize for _, dtype, shape in self.entries)

    def encode(self, fused: dict[str, Tensor]) -> list[Tensor]:
        """The tensors of ``entries`` from the family's fuse output (save_hf's quantize_tensors on it)."""
        out = []
        for key, _, shape in self.outputs:
            block = self._block(key, shape)
            out += [fused[key].cpu()] if block is None else [t.cpu() for t in fp8.quantize(fused[key], block)]
        return out


@dataclass
class _ExportSpec:
    family: str
    rules: list[Rule]
    zeros: dict[str, tuple[tuple[int, ...], torch.dtype]]  # HF key -> shape, dtype of the all-zero parts
    dtype: torch.dtype | None  # on disk for floating tensors (None: the model's)
    dtype_name: str  # config.json's "dtype"
    fp8_block: tuple[int, int] | None = None  # save_hf's fp8: the linear weights as block-wise float8
    mxfp4: bool = False  # save_hf's mxfp4: gpt-oss's expert weights as MXFP4 blocks and scales
    hf: dict | None = None  # the family's config.json as fuse reads it (families whose Family.fuse is set)


def _export_spec(model, family: str | None, dtype: torch.dtype | None, layout: str,
                 fp8_on: bool = False, fp8_block=fp8.DEFAULT_BLOCK, mxfp4: bool = False) -> _ExportSpec:
    """What save_hf writes for ``model`` (family, rules, zero-filled parts), without touching any tensor."""
    from moekit.models.hf import check_mxfp4_family, export_rules, fp8_export_args, mxfp4_export_dtype
    from moekit.models.hf.export import hf_config, zero_fill

    block, dtype = fp8_export_args(fp8_on, fp8_block, mxfp4_export_dtype(mxfp4, fp8_on, dtype), layout)
    whole = whole_structure(model)
    name, rules, out_dtype = export_rules(whole, family, dtype, layout)
    check_mxfp4_family(mxfp4, name)
    hf = hf_config(whole, name, "float32") if FAMILIES[name].fuse is not None else None  # as save_hf's fuse reads it
    if dtype is None:  # the model's own (a meta stand-in has the default dtype)
        out_dtype = next(model.parameters()).dtype
    with torch.device("meta"):  # shapes only
        zeros = {k: (tuple(t.shape), t.dtype) for k, t in zero_fill(whole, name, out_dtype).items()}
    return _ExportSpec(name, rules, zeros, dtype, {v: k for k, v in DTYPE_NAMES.items()}[out_dtype], block, mxfp4,
                       hf)


def _pieces(model, rows: dict[str, list[int]]) -> dict[str, list[tuple[Box, Tensor]]]:
    """What this rank holds of each tensor: (box in the tensor's logical indices, the local values). One piece, the
    shard box, for most tensors; under an expert placement (``rows``: placed_rows) one per slot (its logical
    expert's row), a rank's second copy of an expert left out."""
    state = model.state_dict()
    out = {}
    for name, t in state.items():
        box, local = shard_box(t, name), _local(t)
        if name not in rows:
            out[name] = [(box, local)]
            continue
        seen: dict[int, tuple[Box, Tensor]] = {}
        for j, e in enumerate(rows[name]):
            seen.setdefault(e, ((range(e, e + 1),) + box[1:], local[j:j + 1]))
        out[name] = list(seen.values())
    return out


def _export_boxes(model, spec: _ExportSpec, max_shard_size) -> tuple[dict, dict]:
    """This rank's boxes (``_pieces``), and the logical shape and the dtype, of every rule's tensor it holds (a
    pipeline rank: its stages' only)."""
    parse_size(max_shard_size)
    placed = placed_rows(model)
    state, pieces = model.state_dict(), _pieces(model, placed)
    experts = getattr(model.config, "num_experts", 0)
    boxes, meta = {}, {}
    for r in spec.rules:
        if r.target not in state and hasattr(model, "stages"):  # another pipeline rank's
            continue
        t = state[r.target]
        shape = (experts,) + tuple(t.shape[1:]) if r.target in placed else tuple(t.shape)
        if r.layout(shape) is None:
            raise ValueError(f"{r.target}: its HuggingFace rule has no slice layout (weights.Rule.pieces), so it "
                             f"cannot be exported shard by shard; gather the model and use save_hf")
        if t.dtype not in ST_DTYPES:
            raise ValueError(f"{r.target} has dtype {t.dtype}, which safetensors cannot store")
        boxes[r.target] = [tuple((b.start, b.stop) for b in box) for box, _ in pieces[r.target]]
        meta[r.target] = (shape, t.dtype)
    return boxes, meta


def _fuse_groups(spec: _ExportSpec, meta: dict) -> list[tuple[list[str], list[tuple[str, torch.dtype, list]]]]:
    """The family's fused tensors (Family.fuse), per module: (the unit keys it consumes, (key, dtype, shape) of each
    tensor it writes instead), found by running the fuse on meta tensors of the units' shapes and of the dtypes
    save_hf fuses them in (the model's for an fp8 export's quantizable weights, else the export's); [] without a fuse."""
    fuse = FAMILIES[spec.family].fuse
    if fuse is None:
        return []
    units: dict[str, Tensor] = {}
    for r in spec.rules:
        if r.target not in meta:
            continue  # _plan_export says which
        shape, dtype = meta[r.target]
        out_dtype = spec.dtype if spec.dtype is not None and dtype.is_floating_point else dtype
        for key, (region, dims) in zip(r.sources, r.layout(shape)):
            hf_shape = [1 if d is None else len(region[d]) for d in dims]
            keep = spec.fp8_block is not None and dtype.is_floating_point and fp8.quantizable(key, tuple(hf_shape))
            units[key] = torch.empty(hf_shape, dtype=dtype if keep else out_dtype, device="meta")
    for key, (shape, dtype) in spec.zeros.items():
        units[key] = torch.empty(shape, dtype=dtype, device="meta")
    fused = fuse(spec.hf, units)
    consumed = [k for k in units if k not in fused]
    produced = [k for k in fused if k not in units]
    changed = [k for k in units if k in fused and fused[k] is not units[k]]
    if changed:
        raise ValueError(f"{spec.family}'s fuse rewrites {changed[:3]} in place, which the sharded export does not "
                         f"assemble; save with models.hf.save_hf from one process")
    groups = []
    for module in dict.fromkeys(k.rsplit(".", 2)[0] for k in consumed + produced):
        members = [k for k in consumed if k.rsplit(".", 2)[0] == module]
        outputs = [k for k in produced if k.rsplit(".", 2)[0] == module]
        alone = fuse(spec.hf, {k: units[k] for k in members})
        if not members or not outputs or set(alone) != set(outputs):
            raise ValueError(f"{spec.family}'s fused tensors ({module}: {members} -> {outputs}) are not each made "
                             f"of one module's tensors, which the sharded export assembles; save with "
                             f"models.hf.save_hf from one process")
        groups.append((members, [(k, alone[k].dtype, list(alone[k].shape)) for k in outputs]))
    return groups


def _plan_export(spec: _ExportSpec, meta: dict, all_boxes: list[dict]) -> list[_Unit | _Fused]:
    """Every HF tensor, its owner and its senders; the same on every rank (a function of gathered facts). The units
    of one fused group (``_fuse_groups``) share the owner of the first, and are written as one ``_Fused``."""
    world = len(all_boxes)
    owned, sent = [0] * world, [0] * world  # bytes each rank writes / sends so far: work is balanced
    units = []
    groups = _fuse_groups(spec, meta)
    group_of = {k: g for g, (members, _) in enumerate(groups) for k in members}
    group_owner: dict[int, int] = {}

    def volume(box: Box) -> int:
        return math.prod(map(len, box))

    for r in spec.rules:
        if r.target not in meta:
            raise RuntimeError(f"no rank holds {r.target}, which the export writes; are the pipeline's stages complete?")
        shape, dtype = meta[r.target]
        out_dtype = spec.dtype if spec.dtype is not None and dtype.is_floating_point else dtype
        held: dict[Box, list[int]] = {}  # distinct shards of this tensor -> the ranks holding each
        for rank, boxes in enumerate(all_boxes):
            for box in boxes.get(r.target, ()):  # (under pipeline parallelism, only its stages' ranks)
                held.setdefault(tuple(range(a, b) for a, b in box), []).append(rank)
        for key, (region, dims), woven in zip(r.sources, r.layout(shape), r.weaves()):
            meets = {box: m for box in held if (m := _meet(box, region)) is not None}
            if sum(map(volume, meets.values())) != volume(region):
                raise RuntimeError(f"the ranks' shards of {r.target} do not tile {key} exactly (shards "
                                   f"{[[(x.start, x.stop) for x in b] for b in held]}); are placements overlapping?")
            # owner: holds the most of it; then the least loaded; then the lowest rank
            most = max(map(volume, meets.values()))
            best = [k for b, m in meets.items() if volume(m) == most for k in held[b]]
            owner = min(best, key=lambda k: (owned[k], k))
            if key in group_of:  # a fused tensor's part: its group's owner (the first part's)
                owner = group_owner.setdefault(group_of[key], owner)
            owned[owner] += volume(region) * out_dtype.itemsize
            parts = []
            for box, m in meets.items():
                if owner not in held[box]:
                    sender = min(held[box], key=lambda k: (sent[k], k))
                    sent[sender] += volume(m)
                    parts.append((sender, m))
            units.append(_Unit(key, r.target, region, dims, out_dtype, owner, parts, _block(spec, key, region, dims),
                               woven, spec.mxfp4 and key.endswith(MXFP4_EXPERTS)))
    for key, (shape, dtype) in spec.zeros.items():
        owner = min(range(world), key=lambda k: (owned[k], k))
        if key in group_of:
            owner = group_owner.setdefault(group_of[key], owner)
        owned[owner] += math.prod(shape) * dtype.itemsize
        region, dims = tuple(range(n) for n in shape), tuple(range(len(shape)))
        units.append(_Unit(key, None, region, dims, dtype, owner, [], _block(spec, key, region, dims)))
    if not groups:
        return units
    out: list[_Unit | _Fused] = []  # each group where its first member was
    by_key = {u.key: u for u in units}
    for u in units:
        if u.key not in group_of:
            out.append(u)
        elif (g := group_of[u.key]) in group_owner:
            members, outputs = groups[g]
            out.append(_Fused([by_key[k] for k in members], outputs, spec.fp8_block, group_owner.pop(g)))
    return out


def _block(spec: _ExportSpec, key: str, region: Box, dims: tuple[int, ...]) -> tuple[int, int] | None:
    """The fp8 block of HF tensor ``key`` when the export quantizes it (save_hf's choice, by key and shape)."""
    shape = tuple(1 if d is None else len(region[d]) for d in dims)
    return spec.fp8_block if spec.fp8_block is not None and fp8.quantizable(key, shape) else None


def _files(units: list[_Unit | _Fused], world: int, limit: int) -> list[tuple[int, list[_Unit | _Fused]]]:
    """(writing rank, its units) per output file: each rank's units in plan order, cut at ``limit`` bytes."""
    files = []
    for rank in range(world):
        current: list[_Unit | _Fused] = []
        size = 0
        for u in (u for u in units if u.owner == rank):
            if current and size + u.nbytes > limit:
                files.append((rank, current))
                current, size = [], 0
            current.append(u)
            size += u.nbytes
        if current:
            files.append((rank, current))
    return files


class _StreamWriter:
    """A safetensors file written tensor by tensor: the header (known up front) first, then each tensor's bytes
    in header order as it arrives, so a rank holds one tensor at a time however large its file."""

    def __init__(self, path: Path, units: list[_Unit | _Fused]):
        header, offset = {}, 0
        for u in units:
            for key, dtype, shape in u.entries:
                nbytes = math.prod(shape) * dtype.itemsize
                header[key] = {"dtype": ST_DTYPES[dtype], "shape": shape, "data_offsets": [offset, offset + nbytes]}
                offset += nbytes
        header["__metadata__"] = {"format": "pt"}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned
        self.path, self.expected = path, [u.key for u in units]
        self.file = open(path, "wb")
        self.file.write(len(raw).to_bytes(8, "little") + raw)

    def write(self, key: str, tensors: list[Tensor]) -> None:
        """Unit ``key``'s tensors (``_Unit.encode``), in header order."""
        assert self.expected and self.expected[0] == key, (key, self.expected[:1])
        self.expected.pop(0)
        for tensor in tensors:
            self.file.write(tensor.contiguous().view(torch.uint8).reshape(-1).numpy())
        if not self.expected:
            self.file.close()


def _prepare_folder(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for stale in [*folder.glob("model*.safetensors"), folder / INDEX_FILE]:  # never mix with an earlier save
        stale.unlink(missing_ok=True)


def _check_folder(folder: Path) -> None:
    if not folder.is_dir():
        raise ValueError(f"{folder}: rank 0 created it but this rank does not see it; save_hf_sharded needs a "
                         f"path on a file system every rank shares")


def _assemble(u: _Unit, pieces: dict, rank: int) -> Tensor | None:
    """Unit ``u`` in the model's precision (woven, HF dim order) on its owner, None elsewhere; this rank's parts of
    it sent to the owner meanwhile."""
    if u.target is None:  # all zeros: nothing to gather
        return torch.zeros(u.shape, dtype=u.dtype) if u.owner == rank else None
    if u.target not in pieces:  # another pipeline stage's tensor: its owner and senders hold it, this rank neither
        return None
    held = pieces[u.target]
    like = held[0][1]
    if u.owner != rank:
        for sender, part in u.parts:
            if sender == rank:  # the part is one of this rank's boxes, or inside one
                box, local = next((b, t) for b, t in held if _meet(b, part) == part)
                dist.send(local[_rel(part, box)].contiguous(), dst=u.owner)
        return None
    region = torch.empty([len(r) for r in u.region], dtype=like.dtype, device=like.device)
    for box, local in held:
        if (mine := _meet(box, u.region)) is not None:
            region[_rel(mine, u.region)] = local[_rel(mine, box)]
    for sender, part in u.parts:
        buf = torch.empty([len(r) for r in part], dtype=like.dtype, device=like.device)
        dist.recv(buf, src=sender)
        region[_rel(part, u.region)] = buf
    source = _to_source(region, u.dims)
    return source if u.woven is None else weave(source, *u.woven)


@torch.no_grad()
def _stream(model, units: list[_Unit | _Fused], files: list[tuple[int, list[_Unit | _Fused]]], folder: Path,
            names: list[str], rank: int, fuse: Callable[[dict], dict] | None = None) -> Exception | None:
    """Assemble and write this rank's HF tensors, sending its parts of the others' (``fuse``: the family's, on a
    ``_Fused`` group's members). A failed write is kept
    (returned) while this rank goes on sending and receiving, so no peer waits on it forever."""
    pieces = _pieces(model, placed_rows(model))
    writers: dict[str, _StreamWriter] = {}  # HF key -> the open writer of its file
    error: Exception | None = None
    try:
        for (writer_rank, its), name in zip(files, names):
            if writer_rank == rank:
                w = _StreamWriter(folder / name, its)
                writers.update(dict.fromkeys((u.key for u in its), w))
    except Exception as exc:  # noqa: BLE001
        error = exc

    def write(u: _Unit, make: Callable[[], Tensor]) -> None:
        nonlocal error
        if error is None:
            try:
                writers[u.key].write(u.key, make())
            except Exception as exc:  # noqa: BLE001
                error = exc

    for u in units:
        if isinstance(u, _Fused):  # one module's fused tensors: its members assembled, then fused, on the owner
            values = {}
            for m in u.members:
                value = _assemble(m, pieces, rank)
                if value is not None:  # as save_hf fuses them: an fp8 export's quantizable weights in the model's
                    values[m.key] = value if m.fp8_block is not None else value.to(m.dtype)  # precision
            if u.owner == rank:
                write(u, lambda: u.encode(fuse(values)))
            values = value = None  # held one group at a time
            continue
        value = _assemble(u, pieces, rank)
        if value is not None:
            write(u, lambda: u.encode(value))
        value = None  # held one tensor at a time
    for w in set(writers.values()):
        if not w.file.closed:
            w.file.close()
    return error


def _write_index(folder: Path, config: dict, units: list[_Unit | _Fused],
                 files: list[tuple[int, list[_Unit | _Fused]]], names: list[str]) -> None:
    weight_map = {}
    for (_, its), name in zip(files, names):
        path = folder / name
        if not path.is_file() or path.stat().st_size < 8 + sum(u.nbytes for u in its):
            raise ValueError(f"{path}: missing or short after every rank wrote its files; save_hf_sharded needs a "
                             f"path on a file system every rank shares")
        weight_map.update(dict.fromkeys((key for u in its for key, _, _ in u.entries), name))
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    index = {"metadata": {"total_size": sum(u.nbytes for u in units)}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def save_hf_sharded(model, path: str | Path, *, family: str | None = None, dtype: torch.dtype | None = None,
                    max_shard_size: int | str = "5GB", layout: str = "per_expert",
                    tokenizer_from: str | Path | None = None, fp8: bool = False,
                    fp8_block: tuple[int, int] = fp8.DEFAULT_BLOCK, mxfp4: bool = False) -> Path:
    """``save_hf`` for a parallelised ``model`` (models.parallelize), without gathering it on any rank.

    Call on every rank, collectively; ``path`` must be on a file system they all see. Each rank assembles
    the HF tensors it owns one at a time (receiving the parts other ranks hold) and streams them into its
    own file(s) of at most ``max_shard_size``; rank 0 copies the tokenizer and, once every rank is done,
    writes config.json and the index naming every file. Arguments and the folder written (LoRA adapters folded
    into the weights) as save_hf's;
    any failure raises the same error on every rank.
    """
    from moekit.models.hf import _imported_tokenizer
    from moekit.models.hf.export import copy_tokenizer, hf_config

    _reshard(model)
    spec = _agree(_export_spec, model, family, dtype, layout, fp8, fp8_block, mxfp4)
    fold_lora(model)  # LoRA adapters into the weights, each rank what it holds (save_hf's docstring)
    boxes, meta = _agree(_export_boxes, model, spec, max_shard_size)
    world = dist.get_world_size() if _distributed() else 1
    rank = dist.get_rank() if _distributed() else 0
    gathered = [(boxes, meta)] * world
    if _distributed():
        dist.all_gather_object(gathered, (boxes, meta))
    all_boxes = [b for b, _ in gathered]
    meta = {k: v for _, m in gathered for k, v in m.items()}  # under pipeline parallelism each rank knows its stages'
    units = _agree(_plan_export, spec, meta, all_boxes)
    files = _files(units, world, parse_size(max_shard_size))
    names = [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))]
    folder = Path(path)
    token_ids: dict = {}

    def prepare() -> None:  # rank 0, before anyone writes: the folder, no stale shards, the tokenizer
        if rank == 0:
            _prepare_folder(folder)
            source = tokenizer_from if tokenizer_from is not None else _imported_tokenizer(model)
            if source:
                token_ids.update(copy_tokenizer(source, folder, model.config.vocab_size, model.config.max_seq_len))

    _agree(prepare)
    _agree(_check_folder, folder)
    fuse = FAMILIES[spec.family].fuse
    error = _stream(model, units, files, folder, names, rank, fuse and (lambda tensors: fuse(spec.hf, tensors)))

    def finish() -> None:  # after this exchange every rank has closed its files
        if error is not None:
            raise error

    _agree(finish)
    config = hf_config(whole_structure(model), spec.family, spec.dtype_name, token_ids, spec.fp8_block)
    if spec.mxfp4:
        config["quantization_config"] = MXFP4_CONFIG
    _agree(lambda: _write_index(folder, config, units, files, names) if rank == 0 else None)
    return folder
