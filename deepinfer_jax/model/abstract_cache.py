"""The abstract model (graph definition + parameter shapes) of a config, built once and kept on disk.

``nnx.eval_shape`` of a model's constructor traces every initializer (~1 s for the shipped model on
this machine), and the engine needs the backbone's and the drafter's graph definitions and abstract
parameter states at start-up. ``abstract_model(ctor, cfg)`` builds both with one ``eval_shape``,
keeps them for the process, and pickles them next to the XLA compilation cache
(``<cache dir>-graphs/``; none when the compilation cache is off), so a later process unpickles them
in ~0.1 s. The file's key hashes the constructor's name, the config's ``repr``, the jax and flax
versions and the source of ``deepinfer_jax/model/`` and ``deepinfer_jax/config/``, so an edited
model or another version never reuses a stale graph; an unreadable file is rebuilt. Like the
compilation cache, the directory is trusted (pickles load code): keep it private.

Callers get a fresh copy of the abstract state each call (loaders fill it in place).
"""

from __future__ import annotations

import functools
import hashlib
import os
import pickle
import tempfile
from pathlib import Path

import jax
from flax import nnx

from deepinfer_jax import compile_cache

__all__ = ["abstract_model"]

_SOURCES = ("model", "config")


@functools.lru_cache(maxsize=1)
def _source_digest() -> str:
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for sub in _SOURCES:
        for path in sorted((root / sub).rglob("*.py")):
            h.update(path.relative_to(root).as_posix().encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def _key(ctor, cfg) -> str:
    import flax

    text = "\n".join([ctor.__module__, ctor.__qualname__, repr(cfg), jax.__version__, flax.__version__,
                      _source_digest()])
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _file(ctor, cfg) -> Path | None:
    xla = compile_cache.cache_dir()
    if xla is None:
        return None
    return xla.with_name(xla.name + "-graphs") / f"{ctor.__name__}-{_key(ctor, cfg)}.pkl"


def _build(ctor, cfg):
    return nnx.split(nnx.eval_shape(lambda: ctor(cfg, rngs=nnx.Rngs(0))))


def _load_or_build(ctor, cfg):
    path = _file(ctor, cfg)
    if path is not None and path.exists():
        try:
            with open(path, "rb") as f:
                return pickle.load(f)
        except Exception:  # noqa: BLE001 - a truncated or foreign file: rebuild it
            pass
    built = _build(ctor, cfg)
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                pickle.dump(built, f, protocol=pickle.HIGHEST_PROTOCOL)
            os.replace(tmp, path)
        except (OSError, pickle.PicklingError, TypeError, AttributeError):
            pass  # an unwritable cache only costs the next process the build
    return built


@functools.lru_cache(maxsize=64)
def _cached(ctor, cfg):
    return _load_or_build(ctor, cfg)


def abstract_model(ctor, cfg) -> tuple[nnx.GraphDef, nnx.State]:
    """``(graphdef, abstract_state)`` of ``ctor(cfg, rngs=...)``: the state's leaves are
    ``jax.ShapeDtypeStruct`` (a new state object per call; the graphdef is shared)."""
    graphdef, state = _cached(ctor, cfg)
    return graphdef, jax.tree.map(lambda x: x, state)
