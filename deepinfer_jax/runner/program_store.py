"""Traced step programs kept on disk, so a warm process skips Python tracing as well as XLA.

The persistent compilation cache (``compile_cache``) saves XLA's compilation, but a new process
still traces and lowers each step program in Python before the cache can even be asked (~2 s per
speculative program on this machine, most of a warm start). ``stored_jit(fn, ...)`` is
``jax.jit(fn, ...)`` plus a store: the first call of each signature in any process exports the
traced program (``jax.export``: StableHLO, over the flattened array arguments) into
``<compilation cache dir>-programs/``; later processes deserialize it (milliseconds) and run it
under ``jax.jit(exported.call)``, whose XLA program the compilation cache then supplies. Every call
in every process goes through the exported form, so cold and warm processes run the same program
(bit-identical results; tested).

A signature is the static arguments' ``repr``, the kernel selection and matmul precision, the tree structure and the shapes/dtypes/weak types
of the array arguments; a file's name also hashes the source of the whole ``deepinfer_jax`` package,
the jax/jaxlib/flax versions, the backend and device kind, the x64 setting and every ``DEEPINFER_*``
/ ``XLA_FLAGS`` environment variable, so an edited engine, another version, machine or kernel switch
never reuses a stale program; an unreadable file is rebuilt.

**Opt-in** (``DEEPINFER_PROGRAM_STORE=on``): measured on this machine (demo, process start to
tokens, fresh caches, same minute), the store made the cold start 57.1 s instead of 34.7 s (the
export lowers each program once more and the exported call compiles as its own module) and the
warm start 16.4 s instead of 17.0 s, so it is off by default. It is also off when the compilation
cache is off and for arguments spread over more than one device. ``on_build`` is called when a
program is loaded instead of traced, so the runners' trace counters (incremented inside the traced
functions) count the programs a process built either way. Off (plain ``jax.jit``) when the compilation cache is off, for arguments spread over
more than one device, and with ``DEEPINFER_PROGRAM_STORE=off``. The directory is trusted code, like
the compilation cache's.
"""

from __future__ import annotations

import functools
import hashlib
import os
import pickle
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import jax

from deepinfer_jax import compile_cache

__all__ = ["ENV", "StoredJit", "stored_jit"]

ENV = "DEEPINFER_PROGRAM_STORE"


@functools.lru_cache(maxsize=1)
def _environment_digest() -> str:
    import flax
    import jaxlib

    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(path.relative_to(root).as_posix().encode())
        h.update(path.read_bytes())
    dev = jax.devices()[0]
    for part in (jax.__version__, jaxlib.__version__, flax.__version__, dev.platform, dev.device_kind,
                 str(jax.config.jax_enable_x64)):
        h.update(part.encode())
    return h.hexdigest()


def _env_flags() -> str:
    return repr(sorted((k, v) for k, v in os.environ.items() if k.startswith("DEEPINFER_") or k == "XLA_FLAGS"))


def _aval(leaf) -> tuple:
    t = jax.typeof(leaf)
    return tuple(t.shape), str(t.dtype), bool(getattr(t, "weak_type", False))


def _context() -> tuple:
    """What else selects a traced program: the kernel selection (``ops.dispatch.use_kernels``, a jit
    key context) and the default matmul precision."""
    from deepinfer_jax.ops import dispatch

    return dispatch.setting(), str(jax.config.jax_default_matmul_precision)


def _store_dir() -> Path | None:
    if os.environ.get(ENV, "off").strip().lower() not in ("on", "1", "true"):
        return None  # opt-in: measured, it costs a cold start more than it saves a warm one
    xla = compile_cache.cache_dir()
    return None if xla is None else xla.with_name(xla.name + "-programs")


def _multi_device(leaves) -> bool:
    return any(isinstance(x, jax.Array) and len(x.sharding.device_set) > 1 for x in leaves)


class StoredJit:
    """``jax.jit(fn, static_argnums, donate_argnums)`` with its traced programs stored (see the
    module docstring). ``name`` names the files."""

    def __init__(self, fn: Callable, name: str, static_argnums: Sequence[int] = (), donate_argnums: Sequence[int] = (),
                 on_build: Callable[[], None] | None = None) -> None:
        self.fn, self.name = fn, name
        self.static = tuple(sorted(static_argnums))
        self.donate = tuple(sorted(donate_argnums))
        self.on_build = on_build
        self._plain = jax.jit(fn, static_argnums=self.static, donate_argnums=self.donate)
        self._programs: dict[tuple, tuple[Callable, object]] = {}

    def __call__(self, *args):
        where = _store_dir()
        if where is None:
            return self._plain(*args)
        dyn = [a for i, a in enumerate(args) if i not in self.static]
        leaves, in_tree = jax.tree.flatten(dyn)
        if _multi_device(leaves):
            return self._plain(*args)
        statics = tuple(args[i] for i in self.static)
        key = (statics, _context(), in_tree, tuple(map(_aval, leaves)))
        entry = self._programs.get(key)
        if entry is None:
            entry = self._programs[key] = self._program(where, args, statics, in_tree, leaves)
        call, out_tree = entry
        return jax.tree.unflatten(out_tree, call(*leaves))

    def lower(self, *args):
        """The plain jit's lowering (for HLO inspection; the stored form runs the same program)."""
        return self._plain.lower(*args)

    # -- building ----------------------------------------------------------------------------
    def _donated_leaves(self, args) -> tuple[int, ...]:
        out, at = [], 0
        for i, a in enumerate(args):
            if i in self.static:
                continue
            n = len(jax.tree.leaves(a))
            if i in self.donate:
                out += range(at, at + n)
            at += n
        return tuple(out)

    def _program(self, where: Path, args, statics, in_tree, leaves):
        from jax import export

        text = "\n".join([self.name, repr(statics), repr(_context()), str(in_tree), repr([_aval(x) for x in leaves]), _env_flags(),
                          _environment_digest()])
        path = where / f"{self.name}-{hashlib.sha256(text.encode()).hexdigest()[:32]}.bin"
        exported = out_tree = None
        if path.exists():
            try:
                with open(path, "rb") as f:
                    blob, out_tree = pickle.load(f)
                exported = export.deserialize(blob)
            except Exception:  # noqa: BLE001 - a damaged or foreign file: trace again
                exported = None
        if exported is None:
            exported, out_tree = self._export(args, in_tree, leaves)  # traces fn (its own counters count it)
            self._save(path, exported, out_tree)
        elif self.on_build is not None:
            self.on_build()
        return jax.jit(exported.call, donate_argnums=self._donated_leaves(args)), out_tree

    def _export(self, args, in_tree, leaves):
        from jax import export

        static = self.static
        box = []

        def flat(*flat_leaves):
            dyn = iter(jax.tree.unflatten(in_tree, flat_leaves))
            full = [args[i] if i in static else next(dyn) for i in range(len(args))]
            out_leaves, out_tree = jax.tree.flatten(self.fn(*full))
            box.append(out_tree)
            return out_leaves

        specs = [jax.ShapeDtypeStruct(shape, dtype, weak_type=weak) for shape, dtype, weak in map(_aval, leaves)]
        exported = export.export(jax.jit(flat))(*specs)
        return exported, box[0]

    @staticmethod
    def _save(path: Path, exported, out_tree) -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                pickle.dump((exported.serialize(), out_tree), f, protocol=pickle.HIGHEST_PROTOCOL)
            os.replace(tmp, path)
        except (OSError, ImportError, TypeError, pickle.PicklingError):
            pass  # an unwritable store (or no flatbuffers) only costs the next process a trace


def stored_jit(fn: Callable, name: str, static_argnums: Sequence[int] = (), donate_argnums: Sequence[int] = (),
               on_build: Callable[[], None] | None = None) -> StoredJit:
    """``StoredJit(...)``: see the module docstring."""
    return StoredJit(fn, name, static_argnums, donate_argnums, on_build)
