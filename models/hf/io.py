"""Safetensors folders as HuggingFace's ``save_pretrained`` writes them: read lazily, write sharded.

    folder/
      config.json
      model.safetensors                          one file, or
      model-00001-of-00003.safetensors ...       shards, plus
      model.safetensors.index.json               {"metadata": {"total_size": N}, "weight_map": {key: shard}}

A safetensors file is an 8-byte little-endian header length n, n bytes of JSON
({key: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}), then the data.
``CheckpointReader`` parses every header first (shapes and dtypes for validation, no tensor data), checks
that each file is as long as its header says (a truncated download fails here, naming the file), and
reads a tensor only when asked, so loading a large checkpoint holds one tensor at a time beyond the model.
Block-wise float8 weights (DeepSeek-V3's release) are returned dequantized, their scales hidden from ``infos``
(models/hf/fp8.py); so are MXFP4 expert weights (gpt-oss's release: ``X_blocks`` + ``X_scales``, both uint8), which
appear in ``infos`` as the bf16 tensor ``X`` they decode to (models/hf/mxfp4.py).
"""
from __future__ import annotations

import json
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor

from moekit.models.hf.fp8 import SCALE_SUFFIX, BlockFp8, check_scales, dequantize, pair_scales
from moekit.models.hf.mxfp4 import dequantize_mxfp4, mxfp4_pairs

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on the JSON header
DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}  # config.json "dtype"
# model_types that are another family's architecture under their own name: read as that family, so the
# import, the sharded load and the export (a folder transformers reads without remote code) all follow it.
# Kimi K2 / K2-Instruct: DeepseekV3ForCausalLM with model_type "kimi_k2" and a tiktoken tokenizer (remote code).
MODEL_TYPE_ALIASES = {"kimi_k2": "deepseek_v3"}


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    shape: tuple[int, ...]
    dtype: str  # safetensors name: "F32", "BF16", ...


def read_config(folder: str | Path) -> dict:
    """config.json of a HuggingFace model folder as a dict."""
    path = Path(folder) / CONFIG_FILE
    if not Path(folder).exists():
        raise ValueError(f"{folder}: no such directory; pass a HuggingFace model folder (config.json + *.safetensors)")
    if not Path(folder).is_dir():
        raise ValueError(f"{folder}: not a directory; pass a HuggingFace model folder (config.json + *.safetensors)")
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path}: missing; a HuggingFace model folder has config.json next to its weights") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: holds a JSON {type(config).__name__}, not the object of a model config")
    alias = config.get("model_type")
    if isinstance(alias, str) and alias in MODEL_TYPE_ALIASES:  # the family it is (module constant above)
        config = {**config, "model_type": MODEL_TYPE_ALIASES[alias], "moekit_model_type_alias": alias}
    return config


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Shapes and dtypes of every tensor in one safetensors file, after checking the file is complete."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        n = struct.unpack("<Q", raw)[0] if len(raw) == 8 else -1
        if n < 2 or n > MAX_HEADER_BYTES or 8 + n > size:
            raise ValueError(f"{path}: not a safetensors file or truncated ({size} bytes, header length field "
                             f"{n}); re-download or re-save it")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{path}: corrupt safetensors header ({exc}); re-download or re-save it") from None
    header.pop("__metadata__", None)
    end = max((int(v["data_offsets"][1]) for v in header.values()), default=0)
    if 8 + n + end != size:
        raise ValueError(f"{path}: {size} bytes on disk but its header describes {8 + n + end}; the file is "
                         f"{'truncated' if size < 8 + n + end else 'corrupt'}; re-download or re-save it")
    return {k: TensorInfo(path, tuple(v["shape"]), v["dtype"]) for k, v in header.items()}


class CheckpointReader:
    """Every tensor of a folder's safetensors files by key: ``infos`` up front, ``get(key)`` on demand.

    ``fp8``: the checkpoint's float8 scheme (``fp8.scheme(config)``); its weights' scales are then left out of
    ``infos`` (``scales`` holds them by weight key) and ``get`` returns those weights dequantized, in float32.
    ``rename``: (stored prefix, prefix): keys that start with the first are known by the second instead (Qwen3.5's
    release keeps its language model under ``model.language_model.``, read as ``model.``); ``stored(key)`` gives
    the key on disk.
    """

    def __init__(self, folder: str | Path, fp8: BlockFp8 | None = None, rename: tuple[str, str] | None = None):
        self.folder = Path(folder)
        self.infos: dict[str, TensorInfo] = {}
        files = self._files()
        for path in files:
            self.infos.update(read_header(path))
        self._check_index(files)
        self._stored: dict[str, str] = {}
        if rename is not None:
            old, new = rename
            renamed = {new + k[len(old):]: k for k in self.infos if k.startswith(old)}
            clash = sorted(set(renamed) & set(self.infos))
            if clash:
                raise ValueError(f"checkpoint {self.folder} holds both {clash[0]} and {renamed[clash[0]]}; a "
                                 f"{old!r} checkpoint keeps its weights under one of them only")
            self.infos = {**{k: i for k, i in self.infos.items() if not k.startswith(old)},
                          **{k: self.infos[s] for k, s in renamed.items()}}
            self._stored = renamed
        self.fp8 = fp8
        self.scales: dict[str, TensorInfo] = pair_scales(self.infos, fp8, self.folder)
        self.mxfp4: dict[str, tuple[str, str]] = self._pair_mxfp4()
        self._handles: dict[Path, object] = {}
        # keys that are rows of stored ones (``derive``): key -> (its source, the source rows it holds)
        self.derived: dict[str, tuple[str, Tensor]] = {}
        self._source_info: dict[str, TensorInfo] = {}  # the sources derived keys replaced in ``infos``
        self._last: tuple[str, Tensor] | None = None  # the last source read for a derived key (several share one)

    def derive(self, key: str, source: str, rows: Tensor) -> None:
        """Make ``key`` appear in ``infos`` as the rows ``rows`` (int64, along dim 0) of the stored ``source``, which
        leaves ``infos``: a family whose release fuses tensors moekit keeps apart (Qwen3-Next's in_proj_qkvz, its
        q / k / v / z rows interleaved per key-head group) is read as the split tensors, slice by slice too
        (``sharded.SliceReader`` reads the rows a slice covers). Call for every key of a source before reading."""
        info = self.infos.pop(source, None) or self._source_info[source]
        self._source_info[source] = info
        self.infos[key] = TensorInfo(info.file, (len(rows), *info.shape[1:]), info.dtype)
        self.derived[key] = (source, rows)

    def _pair_mxfp4(self) -> dict[str, tuple[str, str]]:
        """Replace each uint8 ``X_blocks`` [E, out, G, 16] + ``X_scales`` [E, out, G] pair in ``infos`` by ``X``
        [E, G * 32, out] in bf16, the tensor it decodes to; returns {X: (blocks key, scales key)}."""
        candidates = [k for k, i in self.infos.items() if i.dtype == "U8" and k.endswith(("_blocks", "_scales"))]
        if not candidates:
            return {}
        try:
            pairs = mxfp4_pairs(candidates)
        except ValueError as exc:
            raise ValueError(f"checkpoint {self.folder}: {exc}") from None
        for name, (bkey, skey) in pairs.items():
            b, sc = self.infos[bkey], self.infos[skey]
            if len(b.shape) != 4 or b.shape[-1] != 16 or sc.shape != b.shape[:-1]:
                raise ValueError(f"checkpoint {self.folder}: {bkey} {list(b.shape)} / {skey} {list(sc.shape)} are not "
                                 f"MXFP4 blocks [E, out, G, 16] and scales [E, out, G]; re-download the checkpoint")
            if name in self.infos:
                raise ValueError(f"checkpoint {self.folder} holds both {name} and its MXFP4 form {bkey}; keep one")
            del self.infos[bkey], self.infos[skey]
            E, out, G, _ = b.shape
            self.infos[name] = TensorInfo(b.file, (E, G * 32, out), "BF16")
        return pairs

    def _files(self) -> list[Path]:
        index = self.folder / INDEX_FILE
        if index.is_file():
            self.weight_map = self._read_index(index)
            names = sorted(set(self.weight_map.values()))
            missing = [n for n in names if not (self.folder / n).is_file()]
            if missing:
                keys = [k for k, v in self.weight_map.items() if v == missing[0]][:3]
                raise ValueError(f"{index} lists shard(s) {missing} that are not in {self.folder} (shard {missing[0]} "
                                 f"holds e.g. {keys}); copy every shard the index names")
            return [self.folder / n for n in names]
        self.weight_map = None
        if (self.folder / SINGLE_FILE).is_file():
            return [self.folder / SINGLE_FILE]
        found = sorted(p.name for p in self.folder.iterdir())
        raise ValueError(f"{self.folder}: neither {SINGLE_FILE} nor {INDEX_FILE} (found {found[:10]}); "
                         f"save the model with save_pretrained(..., safe_serialization=True)")

    @staticmethod
    def _read_index(index: Path) -> dict[str, str]:
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"{index}: not a safetensors index ({type(exc).__name__}: {exc}); it needs a "
                             f"\"weight_map\" of key -> shard file") from None
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: \"weight_map\" must map tensor names to shard files")
        return weight_map

    def _check_index(self, files: list[Path]) -> None:
        """The index and the shards must agree key by key: a stale index means a mixed-up download."""
        if self.weight_map is None:
            return
        for key, name in self.weight_map.items():
            info = self.infos.get(key)
            if info is None or info.file.name != name:
                where = "no shard" if info is None else f"shard {info.file.name}"
                raise ValueError(f"{self.folder / INDEX_FILE} puts {key} in {name}, but {where} holds it; the index "
                                 f"and the shards come from different saves")
        extra = sorted(set(self.infos) - set(self.weight_map))
        if extra:
            raise ValueError(f"{self.folder / INDEX_FILE} does not list {extra[:3]} ({len(extra)} tensor(s)) found in "
                             f"{self.infos[extra[0]].file.name}; the index and the shards come from different saves")

    def stored(self, key: str) -> str:
        """The name ``key`` has in the files (``rename``)."""
        return self._stored.get(key, key)

    def _read(self, file: Path, key: str) -> Tensor:
        if file not in self._handles:
            self._handles[file] = safe_open(str(file), framework="pt")
        return self._handles[file].get_tensor(self.stored(key))

    def get(self, key: str) -> Tensor:
        """The tensor stored under ``key``; a block-wise float8 weight comes dequantized, in float32, an MXFP4 one
        in bf16; a derived key (``derive``) computed from its sources."""
        if key in self.derived:
            source, rows = self.derived[key]
            return self._source(source)[rows]
        if key in self.mxfp4:
            bkey, skey = self.mxfp4[key]
            return dequantize_mxfp4(self._read(self._file(bkey), bkey), self._read(self._file(skey), skey), name=key)
        value = self._read(self.infos[key].file, key)
        if key in self.scales:
            scale = check_scales(key, self._read(self.scales[key].file, key + SCALE_SUFFIX))
            value = dequantize(value, scale, self.fp8.block)
        return value

    def source_info(self, key: str) -> TensorInfo:
        """The stored tensor ``key`` whose rows derived keys hold (it left ``infos``)."""
        return self._source_info[key]

    def _source(self, key: str) -> Tensor:
        """A derived key's source tensor (dequantized if float8), the last one kept: the keys split from one fused
        tensor read it once."""
        if self._last is None or self._last[0] != key:
            info = self._source_info[key]
            value = self._read(info.file, key)
            if key in self.scales:
                value = dequantize(value, check_scales(key, self._read(self.scales[key].file, key + SCALE_SUFFIX)),
                                   self.fp8.block)
            self._last = (key, value)
        return self._last[1]

    def _file(self, key: str) -> Path:
        """The file holding a stored key (also one hidden from ``infos``: an MXFP4 pair's)."""
        if self.weight_map is not None:
            return self.folder / self.weight_map[self.stored(key)]
        return self.folder / SINGLE_FILE

    def dtypes(self) -> set[str]:
        """The dtypes ``get`` returns (float8 weights come back as float32)."""
        return {"F32" if k in self.scales or (k in self.derived and self.derived[k][0] in self.scales) else i.dtype
                for k, i in self.infos.items()}


def parse_size(size: int | str) -> int:
    """Bytes (at least 1) from an int or a string: plain bytes ("1000000") or a size such as "5GB", "200MB",
    "10KiB" (decimal and binary units)."""
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        units = {"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "KB": 10**3, "MB": 10**6, "GB": 10**9, "B": 1}
        text = str(size).strip().upper()
        unit = next((u for u in units if text.endswith(u)), "")
        number = text[: len(text) - len(unit)].strip()
        value = int(float(number) * units.get(unit, 1)) if number.replace(".", "", 1).isdigit() else 0
    if value < 1:
        raise ValueError(f"max_shard_size={size!r} is invalid; use a positive number of bytes or a size such as "
                         f"'5GB' or '200MB'")
    return value


def save_safetensors(tensors: dict[str, Tensor], path: Path, metadata: dict[str, str]) -> None:
    """safetensors' ``save_file``, with its I/O failures (a full disk, a read-only folder) as the OSError they
    are, naming ``path`` (safetensors reports them as a SafetensorError naming its temporary file)."""
    try:
        save_file(tensors, str(path), metadata=metadata)
    except SafetensorError as exc:
        found = re.search(r"\(os error (\d+)\)", str(exc))
        if found is None:
            raise
        code = int(found.group(1))
        raise OSError(code, os.strerror(code), str(path)) from None


def write_safetensors(tensors: dict[str, Tensor], folder: Path, max_shard_size: int | str) -> list[Path]:
    """Write ``tensors`` (in order) into one file or shards of at most ``max_shard_size`` bytes, plus an index.

    A tensor larger than the limit gets a shard of its own, as save_pretrained does. Returns the files.
    """
    limit = parse_size(max_shard_size)
    shards: list[dict[str, Tensor]] = [{}]
    size = 0
    for key, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][key] = t.contiguous()
        size += nbytes
    for stale in [*folder.glob("model*.safetensors"), folder / INDEX_FILE]:  # never mix with an earlier save
        stale.unlink(missing_ok=True)
    if len(shards) == 1:
        save_safetensors(shards[0], folder / SINGLE_FILE, {"format": "pt"})
        return [folder / SINGLE_FILE]
    paths, weight_map = [], {}
    for i, shard in enumerate(shards):
        path = folder / f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_safetensors(shard, path, {"format": "pt"})
        weight_map.update(dict.fromkeys(shard, path.name))
        paths.append(path)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return paths

