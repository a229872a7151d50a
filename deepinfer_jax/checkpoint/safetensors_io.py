"""Lazy safetensors reading and writing with numpy + ml_dtypes (no torch).

``safetensors.safe_open(framework="numpy")`` cannot return FP8 tensors (numpy has no FP8
dtype), so the format is handled here directly: an 8-byte little-endian header length, a JSON
header ``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`` and
the raw little-endian byte buffer. Files are memory-mapped and each tensor is returned as a
read-only zero-copy view, so a checkpoint is read one tensor at a time.

A checkpoint is a directory holding ``model.safetensors`` or a sharded set described by
``model.safetensors.index.json`` (``weight_map``: name -> shard file), or a single file.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "I16": np.dtype(np.int16),
    "U16": np.dtype(np.uint16),
    "I32": np.dtype(np.int32),
    "U32": np.dtype(np.uint32),
    "I64": np.dtype(np.int64),
    "U64": np.dtype(np.uint64),
    "BOOL": np.dtype(np.bool_),
}
_DTYPE_NAMES = {dt: name for name, dt in DTYPES.items()}
_MAX_HEADER_BYTES = 100 * 1024 * 1024


class SafetensorsError(ValueError):
    """A safetensors file or index is malformed; ``field`` names the file or tensor."""

    def __init__(self, message: str, field: str | None = None):
        self.field = field
        super().__init__(f"{field}: {message}" if field else message)


@dataclass(frozen=True)
class TensorInfo:
    """Header entry of one tensor: numpy dtype, shape and byte range inside the data buffer."""

    dtype: np.dtype
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def dtype_name(dtype) -> str:
    """The safetensors dtype string of a numpy / ml_dtypes dtype."""
    dt = np.dtype(dtype)
    try:
        return _DTYPE_NAMES[dt]
    except KeyError:
        raise SafetensorsError(f"dtype {dt} has no safetensors equivalent") from None


# --------------------------------------------------------------------------- reading


class SafetensorsFile:
    """One memory-mapped ``.safetensors`` file; ``get(name)`` returns a read-only view."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        with open(self.path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) != 8:
                raise SafetensorsError("file shorter than the 8-byte header length", str(self.path))
            (header_len,) = struct.unpack("<Q", prefix)
            file_size = os.fstat(f.fileno()).st_size
            if header_len > min(_MAX_HEADER_BYTES, file_size - 8):
                raise SafetensorsError(f"implausible header length {header_len}", str(self.path))
            try:
                header = json.loads(f.read(header_len))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise SafetensorsError(f"header is not valid JSON ({e})", str(self.path)) from None
            self._mmap = (
                mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if file_size > 0 else None
            )
        self._data_start = 8 + header_len
        data_len = file_size - self._data_start
        if not isinstance(header, dict):
            raise SafetensorsError("header is not a JSON object", str(self.path))
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        self._infos: dict[str, TensorInfo] = {}
        for name, entry in header.items():
            self._infos[name] = self._parse_entry(name, entry, data_len)

    def _parse_entry(self, name: str, entry, data_len: int) -> TensorInfo:
        where = f"{self.path}:{name}"
        try:
            dtype = DTYPES[entry["dtype"]]
            shape = tuple(int(s) for s in entry["shape"])
            begin, end = (int(o) for o in entry["data_offsets"])
        except KeyError as e:
            raise SafetensorsError(f"unsupported dtype or missing header key {e}", where) from None
        except (TypeError, ValueError):
            raise SafetensorsError(f"malformed header entry {entry!r}", where) from None
        want = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if begin < 0 or end < begin or end > data_len or end - begin != want:
            raise SafetensorsError(
                f"data_offsets [{begin}, {end}] do not hold {shape} {entry['dtype']} ({want} bytes) "
                f"inside a {data_len}-byte buffer",
                where,
            )
        return TensorInfo(dtype, shape, begin, end)

    def keys(self) -> list[str]:
        return list(self._infos)

    def info(self, name: str) -> TensorInfo:
        try:
            return self._infos[name]
        except KeyError:
            raise KeyError(f"{name} not in {self.path}") from None

    def get(self, name: str) -> np.ndarray:
        """A read-only zero-copy view of tensor ``name`` (copy it to keep it writable)."""
        info = self.info(name)
        count = int(np.prod(info.shape, dtype=np.int64))
        if count == 0 or self._mmap is None:
            return np.zeros(info.shape, dtype=info.dtype)
        arr = np.frombuffer(self._mmap, dtype=info.dtype, count=count, offset=self._data_start + info.begin)
        return arr.reshape(info.shape)

    def close(self) -> None:
        """Release the mapping now if no view is alive (otherwise it goes with the last view)."""
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:
                pass
            self._mmap = None


class CheckpointReader(Mapping):
    """Lazy ``Mapping[name, np.ndarray]`` over a safetensors checkpoint (file or directory).

    A directory is read through ``model.safetensors.index.json`` when present, else
    ``model.safetensors``, else every ``*.safetensors`` file in it. Only headers are read up
    front; ``reader[name]`` maps the tensor's bytes on access. ``info(name)`` gives dtype and
    shape without touching the data.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._files: dict[Path, SafetensorsFile] = {}
        self._where: dict[str, Path] = {}
        self.metadata: dict[str, str] = {}
        if self.path.is_file():
            self._add_file(self.path)
        elif (self.path / INDEX_FILE).is_file():
            self._load_index(self.path / INDEX_FILE)
        elif (self.path / SINGLE_FILE).is_file():
            self._add_file(self.path / SINGLE_FILE)
        elif self.path.is_dir() and sorted(self.path.glob("*.safetensors")):
            for f in sorted(self.path.glob("*.safetensors")):
                self._add_file(f)
        else:
            raise SafetensorsError(
                f"no {SINGLE_FILE}, {INDEX_FILE} or *.safetensors found", str(self.path)
            )

    def _file(self, path: Path) -> SafetensorsFile:
        if path not in self._files:
            if not path.is_file():
                raise SafetensorsError("shard file does not exist", str(path))
            self._files[path] = SafetensorsFile(path)
        return self._files[path]

    def _add_file(self, path: Path) -> None:
        f = self._file(path)
        self.metadata.update(f.metadata)
        for name in f.keys():
            if name in self._where:
                raise SafetensorsError(f"tensor also stored in {self._where[name]}", f"{path}:{name}")
            self._where[name] = path

    def _load_index(self, index_path: Path) -> None:
        try:
            index = json.loads(index_path.read_text())
            weight_map = index["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise SafetensorsError(f"malformed index ({e})", str(index_path)) from None
        self.metadata.update(index.get("metadata") or {})
        for name, shard in weight_map.items():
            path = self.path / shard
            if name not in self._file(path)._infos:
                raise SafetensorsError(f"index maps {name} to {shard}, which lacks it", str(index_path))
            self._where[name] = path

    def info(self, name: str) -> TensorInfo:
        return self._files[self._where[name]].info(name)

    def __getitem__(self, name: str) -> np.ndarray:
        return self._files[self._where[name]].get(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, name) -> bool:
        return name in self._where

    def close(self) -> None:
        for f in self._files.values():
            f.close()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_checkpoint(path: str | os.PathLike) -> CheckpointReader:
    """Open a safetensors file or checkpoint directory lazily."""
    return CheckpointReader(path)


# --------------------------------------------------------------------------- writing


def _prepare(arr) -> np.ndarray:
    arr = np.asarray(arr)
    dtype_name(arr.dtype)  # validates
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    return np.ascontiguousarray(arr)


def save_file(
    path: str | os.PathLike, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None
) -> None:
    """Write ``tensors`` to one safetensors file (readable by ``safetensors`` itself).

    Tensors are laid out by decreasing itemsize then name, so every tensor starts aligned.
    """
    arrays = {name: _prepare(arr) for name, arr in tensors.items()}
    order = sorted(arrays, key=lambda n: (-arrays[n].dtype.itemsize, n))
    header: dict = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for name in order:
        arr = arrays[name]
        header[name] = {
            "dtype": dtype_name(arr.dtype),
            "shape": list(arr.shape),
            "data_offsets": [offset, offset + arr.nbytes],
        }
        offset += arr.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    tmp = Path(str(path) + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name in order:
            arr = arrays[name]
            if arr.nbytes:
                f.write(arr.reshape(-1).view(np.uint8).data)
    os.replace(tmp, path)


def save_sharded(
    directory: str | os.PathLike,
    tensors: Mapping[str, np.ndarray],
    max_shard_bytes: int = 5 * 1024**3,
    metadata: Mapping[str, str] | None = None,
) -> list[Path]:
    """Write ``tensors`` as HF-style shards and return the files written.

    One shard -> ``model.safetensors``; more -> ``model-0000i-of-0000N.safetensors`` plus
    ``model.safetensors.index.json``. Tensors are packed in the given order; a shard is closed
    when the next tensor would push it past ``max_shard_bytes`` (a single larger tensor gets
    a shard of its own).
    """
    if max_shard_bytes <= 0:
        raise SafetensorsError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, arr in tensors.items():
        arr = np.asarray(arr)
        if shards[-1] and size + arr.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = arr
        size += arr.nbytes
    if len(shards) == 1:
        path = directory / SINGLE_FILE
        save_file(path, shards[0], metadata)
        return [path]
    n = len(shards)
    weight_map: dict[str, str] = {}
    written = []
    for i, shard in enumerate(shards, start=1):
        fname = f"model-{i:05d}-of-{n:05d}.safetensors"
        save_file(directory / fname, shard, metadata)
        weight_map.update({name: fname for name in shard})
        written.append(directory / fname)
    total = sum(int(np.asarray(a).nbytes) for a in tensors.values())
    index = {
        "metadata": {"total_size": total, **(dict(metadata) if metadata else {})},
        "weight_map": weight_map,
    }
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    written.append(directory / INDEX_FILE)
    return written
