"""Block KV tiers below the device (engine.md §1.1): host memory and a file-system store.

Both hold *payloads*: a dict ``name -> numpy array`` with one block's stored rows for every
KV-source layer, keyed by the block's content digest. ``BlockStore`` is the small protocol; the
registry ``STORES`` maps a name to a factory.

``FileBlockStore`` keeps one file per block under ``<root>/v1/<2 hex>/<digest hex>.blk``, on a
local disk or a shared mount (a 3FS FUSE mount is plain files):

    magic "DIJXBLK1" | u32 header length | header JSON (version, model fingerprint, digest,
    arrays: name, dtype, shape, offset, nbytes) | array bytes | sha256 of everything before it

Writes go to a temporary file in the same directory and are renamed into place (atomic), so
several engines writing one store never leave a torn file; the same digest always carries the
same contents, so concurrent writers of one block are harmless. A file that is truncated,
corrupted, from another model, or of another version is a miss (logged), never wrong output, and
is moved to ``<root>/v1/quarantine/`` at once, so the next write of that block (the engine
recomputes and writes it back) heals the store. ``put`` skips a block whose file exists.
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import os
import tempfile
import threading
from pathlib import Path
from typing import Protocol

import numpy as np

__all__ = ["STORES", "BlockStore", "FileBlockStore", "HostBlockStore", "StoreError"]

log = logging.getLogger(__name__)
_MAGIC = b"DIJXBLK1"
_VERSION = 1


class StoreError(RuntimeError):
    """The store cannot be used (e.g. its directory is not writable)."""


class BlockStore(Protocol):
    def get(self, digest: bytes) -> dict[str, np.ndarray] | None: ...

    def put(self, digest: bytes, payload: dict[str, np.ndarray]) -> None: ...

    def __contains__(self, digest: bytes) -> bool: ...


class HostBlockStore:
    """Host memory, LRU-bounded by ``max_bytes``."""

    def __init__(self, max_bytes: int = 1 << 30) -> None:
        self.max_bytes, self.nbytes = max_bytes, 0
        self._items: collections.OrderedDict[bytes, dict] = collections.OrderedDict()
        self._lock = threading.Lock()  # the prefetch thread puts while the scheduler gets

    def __contains__(self, digest: bytes) -> bool:
        return digest in self._items

    def __len__(self) -> int:
        return len(self._items)

    def get(self, digest: bytes) -> dict[str, np.ndarray] | None:
        with self._lock:
            payload = self._items.get(digest)
            if payload is not None:
                self._items.move_to_end(digest)
            return payload

    def put(self, digest: bytes, payload: dict[str, np.ndarray]) -> None:
        size = sum(a.nbytes for a in payload.values())
        with self._lock:
            if digest in self._items:
                self._items.move_to_end(digest)
                return
            if size > self.max_bytes:
                return
            self._items[digest] = payload
            self.nbytes += size
            while self.nbytes > self.max_bytes:
                _, old = self._items.popitem(last=False)
                self.nbytes -= sum(a.nbytes for a in old.values())


class FileBlockStore:
    """One checksummed file per block in ``root`` (see the module docstring)."""

    def __init__(self, root: str | os.PathLike, fingerprint: bytes) -> None:
        self.root = Path(root) / f"v{_VERSION}"
        self.fingerprint = fingerprint.hex()
        self.misses_corrupt = 0  # reads that failed verification
        self.quarantined = 0  # of those, files moved out of the way (the next put rewrites them)
        self._failed: set[bytes] = set()  # digests whose file failed verification and was not rewritten since
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            probe = tempfile.NamedTemporaryFile(dir=self.root, prefix=".probe-", delete=True)
            probe.close()
        except OSError as e:
            raise StoreError(f"block store directory {self.root} is not writable: {e}") from None

    def _path(self, digest: bytes) -> Path:
        h = digest.hex()
        return self.root / h[:2] / f"{h}.blk"

    def __contains__(self, digest: bytes) -> bool:
        return self._path(digest).is_file()

    def failed(self, digest: bytes) -> bool:
        """Whether this block's file failed verification here and has not been rewritten since."""
        return digest in self._failed

    def put(self, digest: bytes, payload: dict[str, np.ndarray]) -> None:
        self._failed.discard(digest)
        path = self._path(digest)
        if path.is_file():
            return
        arrays, offset = [], 0
        for name in sorted(payload):
            a = np.ascontiguousarray(payload[name])
            arrays.append({"name": name, "dtype": str(a.dtype), "shape": list(a.shape), "offset": offset,
                           "nbytes": a.nbytes})
            offset += a.nbytes
        header = json.dumps({"version": _VERSION, "model": self.fingerprint, "digest": digest.hex(),
                             "arrays": arrays}).encode()
        body = _MAGIC + len(header).to_bytes(4, "little") + header + b"".join(
            np.ascontiguousarray(payload[a["name"]]).tobytes() for a in arrays)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(body + hashlib.sha256(body).digest())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def get(self, digest: bytes) -> dict[str, np.ndarray] | None:
        path = self._path(digest)
        try:
            data = path.read_bytes()
        except OSError:
            return None
        try:
            return self._decode(data, digest)
        except (ValueError, KeyError, TypeError) as e:
            self.misses_corrupt += 1
            if len(self._failed) < 1 << 16:
                self._failed.add(digest)
            log.warning("block store: %s is unusable (%s); treated as a miss and quarantined", path, e)
            self._quarantine(path)
            return None

    def _quarantine(self, path: Path) -> None:
        """Move a file that failed verification to ``quarantine/`` (a unique name; another engine may
        quarantine or rewrite the same block meanwhile, which is harmless)."""
        qdir = self.root / "quarantine"
        try:
            qdir.mkdir(exist_ok=True)
            fd, dest = tempfile.mkstemp(dir=qdir, prefix=path.stem + ".")
            os.close(fd)
            os.replace(path, dest)
            self.quarantined += 1
        except OSError as e:  # gone already, or a read-only mount: the miss stands
            log.warning("block store: could not quarantine %s: %s", path, e)

    def _decode(self, data: bytes, digest: bytes) -> dict[str, np.ndarray]:
        if len(data) < len(_MAGIC) + 4 + 32 or not data.startswith(_MAGIC):
            raise ValueError("bad magic or truncated")
        body, check = data[:-32], data[-32:]
        if hashlib.sha256(body).digest() != check:
            raise ValueError("checksum mismatch")
        n = int.from_bytes(body[8:12], "little")
        header = json.loads(body[12 : 12 + n])
        if header["version"] != _VERSION or header["model"] != self.fingerprint or header["digest"] != digest.hex():
            raise ValueError("another version, model or block")
        base = 12 + n
        out = {}
        for a in header["arrays"]:
            raw = body[base + a["offset"] : base + a["offset"] + a["nbytes"]]
            out[a["name"]] = np.frombuffer(raw, dtype=_dtype(a["dtype"])).reshape(a["shape"])
        return out


def _dtype(name: str) -> np.dtype:
    try:
        return np.dtype(name)
    except TypeError:
        import ml_dtypes  # FP8 / FP4 storage dtypes (a jax dependency)

        return np.dtype(getattr(ml_dtypes, name))


STORES = {"host": HostBlockStore, "file": FileBlockStore}
