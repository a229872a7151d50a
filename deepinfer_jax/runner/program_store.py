"""Compiled step programs kept on disk, so a warm process neither traces, lowers nor compiles them.

The persistent compilation cache (``compile_cache``) saves XLA's compilation, but a new process
still traces and lowers each step program in Python before that cache can even be asked (about 1-2 s
per program on this machine, most of a warm start). ``stored_jit(fn, ...)`` is ``jax.jit(fn, ...)``
plus a store: the first call of each signature on a machine compiles the step over its flattened
array arguments (``jax.jit(...).lower(...).compile()``, which itself reads and fills the compilation
cache) and writes the XLA executable (``jax.experimental.serialize_executable``) into
``<compilation cache dir>-programs/``; a later process loads that executable (tens of milliseconds)
and calls it directly. Both run the same executable, so cold and warm processes compute
bit-identical results (tested, and against the plain jit).

A signature is the static arguments' ``repr``, the kernel selection and its implementation table,
the matmul precision, the tree structure and the shapes/dtypes/weak types of the array arguments; a
file's name also hashes the source of the whole ``deepinfer_jax`` package, the jax/jaxlib/flax
versions, the backend, device kind and the host CPU's feature flags, the x64 setting and every
``DEEPINFER_*`` / ``XLA_FLAGS`` environment variable, so an edited engine, another version, machine or
kernel switch never reuses a stale program; an unreadable file is compiled again. What the key
cannot see is a function of the package replaced at run time (a monkeypatch): run such experiments
with the store off.

``StoredLowering`` does the same for a public ``jax.jit`` (``generate_ragged``'s ``generate``): it compiles
through that jit with the compilation cache on, so the program and its cache entry are the ones a user's own
``jax.jit`` of the function gets; a compile the cache answered is run but not stored.

**On by default** wherever the compilation cache is on; ``DEEPINFER_PROGRAM_STORE=off`` turns it
off, and it is off for arguments spread over more than one device (those programs take the plain
jit and the compilation cache). ``on_build`` is called when a program is loaded instead of traced,
so the runners' trace counters (incremented inside the traced functions) count the programs a
process built either way. The directory is trusted code, like the compilation cache's: loading an
executable runs native code.

**Prefetch.** Loading a stored step program takes up to 1.5 s on this machine (the shipped model's forward
step ~1 s: its executable is ~5 MB of object code to link), and a warm process used to pay it when its first
step needed the program. An engine that gives each ``StoredJit`` a ``ProgramLog`` records, per engine
configuration, which files it used first (``manifest-<key>.json`` in the store); ``ProgramLog.prefetch``,
called by ``LLM()`` before it loads the checkpoint, starts loading those files on a background thread
(the load releases the GIL), and ``StoredJit`` takes a prefetched program instead of loading the file
itself. The log only saves time: a stale or foreign manifest loads programs nobody asks for, never a wrong
one (a program is still looked up by its full key).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import hashlib
import inspect
import json
import os
import pickle
import tempfile
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import jax

from deepinfer_jax import compile_cache, compile_options

__all__ = ["ENV", "ProgramLog", "StoredJit", "StoredLowering", "stored_jit"]

ENV = "DEEPINFER_PROGRAM_STORE"


@functools.lru_cache(maxsize=1)
def _cpu_flags() -> str:
    """The host CPU's feature flags (an executable compiled for AVX-512 must not run where it is missing)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.machine() + " " + platform.processor()


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
                 str(jax.config.jax_enable_x64), _cpu_flags()):
        h.update(part.encode())
    return h.hexdigest()


def _env_flags() -> str:
    return repr(sorted((k, v) for k, v in os.environ.items() if k.startswith("DEEPINFER_") or k == "XLA_FLAGS"))


def _aval(leaf) -> tuple:
    t = jax.typeof(leaf)
    return tuple(t.shape), str(t.dtype), bool(getattr(t, "weak_type", False))


def _signature(leaf) -> tuple:
    """What selects a program for one argument, as ``_aval`` but cheaper (run on every call over a step's
    ~500 leaves): the dtype object instead of its formatted name, and for a placed array its own shape,
    dtype and weak type without building an aval (about 8x faster). A host array and a placed one of the
    same aval give the same signature (a given mask and the cached all-ones one share a program)."""
    if isinstance(leaf, jax.Array):
        return leaf.shape, leaf.dtype, leaf.weak_type
    t = jax.typeof(leaf)
    return tuple(t.shape), t.dtype, bool(getattr(t, "weak_type", False))


def _impl_name(impl) -> str:
    if not callable(impl):
        return repr(impl)  # a lazy reference names its module and attribute
    return f"{getattr(impl, '__module__', '')}.{getattr(impl, '__qualname__', impl)}"


def _context() -> tuple:
    """What else selects a traced program: the kernel selection (``ops.dispatch.use_kernels``, a jit
    key context), the implementations registered for each kernel (``dispatch.register`` can swap one
    at run time) and the default matmul precision."""
    from deepinfer_jax.ops import dispatch

    table = tuple(sorted((k, tuple(sorted((p, _impl_name(v)) for p, v in impls.items())))
                         for k, impls in dispatch.TABLE.items()))
    return dispatch.setting(), table, str(jax.config.jax_default_matmul_precision)


def _program_file(where: Path, name: str, statics: str, in_tree, leaves) -> Path:
    """The file of program ``name`` for these arguments (see the module docstring for what its name hashes)."""
    text = "\n".join([name, statics, repr(_context()), str(in_tree), repr([_aval(x) for x in leaves]),
                      f"device {_device(leaves).id}", _env_flags(), _environment_digest()])
    return where / f"{name}-{hashlib.sha256(text.encode()).hexdigest()[:32]}.bin"


def _store_dir() -> Path | None:
    if os.environ.get(ENV, "on").strip().lower() in compile_cache.OFF_VALUES:
        return None
    xla = compile_cache.cache_dir()
    return None if xla is None else xla.with_name(xla.name + "-programs")


def _multi_device(leaves) -> bool:
    return any(isinstance(x, jax.Array) and len(x.sharding.device_set) > 1 for x in leaves)


def _device(leaves):
    """The one device the step's arrays live on (the default device when none is placed yet)."""
    for x in leaves:
        if isinstance(x, jax.Array):
            return next(iter(x.sharding.device_set))
    return jax.devices()[0]


#: Compilation-cache hits on this thread. An XLA:CPU executable that came from the compilation cache
#: does not serialize again faithfully (the loaded copy then misses functions), so only a program this
#: process really compiled is stored.
_hits = threading.local()


def _count_cache_hit(event: str, **_) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        _hits.n = getattr(_hits, "n", 0) + 1


jax.monitoring.register_event_listener(_count_cache_hit)


#: Background loads ``ProgramLog.prefetch`` started and not yet taken: file path -> Future of ``_load``'s result,
#: oldest first; at most ``_PREFETCH_KEPT`` (an engine that never runs what it prefetched does not pile them up).
_prefetched: collections.OrderedDict[Path, Future] = collections.OrderedDict()
_PREFETCH_KEPT = 8
_prefetch_lock = threading.Lock()
_loader: list[ThreadPoolExecutor] = []


def _take_prefetched(path: Path):
    """The program a prefetch loaded from ``path`` (waiting for it if still loading), or None."""
    with _prefetch_lock:
        future = _prefetched.pop(path, None)
    return None if future is None else future.result()


class ProgramLog:
    """The stored programs one engine configuration used, in the order it first needed them (see the module
    docstring: Prefetch). ``identity``: a string that names the configuration (``LLM`` uses its arguments);
    the manifest's name hashes it with the environment digest of the program files."""

    #: Files a manifest lists at most (the first ones an engine needs are what prefetch is for).
    MAX_ENTRIES = 8

    def __init__(self, identity: str) -> None:
        self.identity = identity
        self._entries: list[list] | None = None  # [file name, device id] in order of first use

    def path(self) -> Path | None:
        """The manifest's file, or None when the program store is off."""
        where = _store_dir()
        if where is None:
            return None
        key = hashlib.sha256(f"{self.identity}\n{_environment_digest()}".encode()).hexdigest()[:32]
        return where / f"manifest-{key}.json"

    def entries(self) -> list[list]:
        """[file name, device id] of the programs used, first used first; [] for a missing or damaged manifest."""
        if self._entries is None:
            path, self._entries = self.path(), []
            try:
                raw = json.loads(path.read_text()) if path is not None and path.exists() else []
                self._entries = [[str(n), int(d)] for n, d in raw][: self.MAX_ENTRIES]
            except (OSError, ValueError, TypeError):
                pass  # damaged: rewritten by the next record
        return self._entries

    def prefetch(self, limit: int = 2) -> int:
        """Start loading the first ``limit`` programs the manifest lists on a background thread; returns how many
        loads it started (files that no longer exist, or for a device this process lacks, are skipped)."""
        path = self.path()
        if path is None:
            return 0
        devices = {d.id: d for d in jax.local_devices()}
        started = 0
        for name, device_id in self.entries()[:limit]:
            file = path.parent / name
            if device_id not in devices or not file.exists():
                continue
            with _prefetch_lock:
                if file in _prefetched:
                    continue
                if not _loader:
                    _loader.append(ThreadPoolExecutor(max_workers=1, thread_name_prefix="deepinfer-prefetch"))
                _prefetched[file] = _loader[0].submit(_load, file, devices[device_id])
                while len(_prefetched) > _PREFETCH_KEPT:
                    _prefetched.popitem(last=False)
            started += 1
        return started

    def record(self, file: Path, device) -> None:
        """Note that this configuration used ``file`` (on ``device``); rewrites the manifest when it is new."""
        entries, entry = self.entries(), [file.name, device.id]
        if entry in entries or len(entries) >= self.MAX_ENTRIES:
            return
        entries.append(entry)
        path, tmp = self.path(), None
        try:
            fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump(entries, f)
            os.replace(tmp, path)
        except (OSError, AttributeError):  # an unwritable store: nothing to prefetch next time
            if tmp is not None and os.path.exists(tmp):
                os.unlink(tmp)


class StoredJit:
    """``jax.jit(fn, static_argnums, donate_argnums)`` with its compiled programs stored (see the
    module docstring). ``name`` names the files; ``log``: the ``ProgramLog`` that records the files used."""

    def __init__(self, fn: Callable, name: str, static_argnums: Sequence[int] = (), donate_argnums: Sequence[int] = (),
                 on_build: Callable[[], None] | None = None, log: ProgramLog | None = None) -> None:
        self.fn, self.name = fn, name
        self.static = tuple(sorted(static_argnums))
        self.donate = tuple(sorted(donate_argnums))
        self.on_build = on_build
        self.log = log
        self._plain = compile_options.jit(fn, static_argnums=self.static, donate_argnums=self.donate)
        self._programs: dict[tuple, tuple[Callable, object]] = {}
        self._absent: set[tuple] = set()  # keys ``available`` found neither in memory nor in the store

    def __call__(self, *args):
        where = _store_dir()
        if where is None:
            return self._plain(*args)
        dyn = [a for i, a in enumerate(args) if i not in self.static]
        leaves, in_tree = jax.tree.flatten(dyn)
        if _multi_device(leaves):
            return self._plain(*args)
        statics = tuple(args[i] for i in self.static)
        key = (statics, _context(), in_tree, tuple(map(_signature, leaves)))
        entry = self._programs.get(key)
        if entry is None:
            entry = self._programs[key] = self._program(where, args, statics, in_tree, leaves)
        call, out_tree = entry
        return jax.tree.unflatten(out_tree, call(*leaves))

    def available(self, *args) -> bool:
        """Whether a call with ``args`` would find its program built in this process or in the store (nothing is
        traced, loaded or compiled here). False with the store off or for multi-device arguments."""
        where = _store_dir()
        dyn = [a for i, a in enumerate(args) if i not in self.static]
        leaves, in_tree = jax.tree.flatten(dyn)
        if where is None or _multi_device(leaves):
            return False
        statics = tuple(args[i] for i in self.static)
        key = (statics, _context(), in_tree, tuple(map(_signature, leaves)))
        if key in self._programs:
            return True
        if key in self._absent:  # a file this process did not write does not appear in the meantime
            return False
        if self._path(where, statics, in_tree, leaves).exists():
            return True
        self._absent.add(key)
        return False

    def lower(self, *args):
        """The plain jit's lowering (for HLO inspection; the stored form compiles the same computation)."""
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

    def _path(self, where: Path, statics, in_tree, leaves) -> Path:
        return _program_file(where, self.name, repr(statics), in_tree, leaves)

    def _program(self, where: Path, args, statics, in_tree, leaves):
        device = _device(leaves)
        path = self._path(where, statics, in_tree, leaves)
        if path.exists():
            loaded = _take_prefetched(path) or _load(path, device)
            if loaded is not None:
                if self.on_build is not None:
                    self.on_build()
                if self.log is not None:
                    self.log.record(path, device)
                return loaded
        hits = getattr(_hits, "n", 0)
        compiled, out_tree = self._compile(args, in_tree, leaves)  # traces fn (its own counters count it)
        if getattr(_hits, "n", 0) == hits:  # compiled here, not loaded from the compilation cache
            _save(path, compiled, out_tree)
            if self.log is not None and path.exists():
                self.log.record(path, device)
        return compiled, out_tree

    def _compile(self, args, in_tree, leaves):
        static = self.static
        box = []

        def flat(*flat_leaves):
            dyn = iter(jax.tree.unflatten(in_tree, flat_leaves))
            full = [args[i] if i in static else next(dyn) for i in range(len(args))]
            out_leaves, out_tree = jax.tree.flatten(self.fn(*full))
            box.append(out_tree)
            return out_leaves

        with _compilation_cache_off():
            compiled = compile_options.jit(flat, donate_argnums=self._donated_leaves(args)).lower(*leaves).compile()
        return compiled, box[0]


#: Store compiles in flight (``_compilation_cache_off``), and the compilation-cache setting they found.
_cache_off = {"depth": 0, "saved": None}
_cache_off_lock = threading.Lock()


@contextlib.contextmanager
def _compilation_cache_off():
    """While a store miss compiles, the persistent compilation cache neither answers nor keeps a compile.

    A program the store lacks but the compilation cache holds (the same computation after an upgrade of this
    package, whose source is in the store's key) would otherwise come from that cache on every start: an
    executable loaded from it cannot be stored (``_hits``), so each warm process would trace and lower it again.
    Compiling it for real once stores it, and later processes load it from the store. JAX's public switch
    (``jax_enable_compilation_cache``) is process-wide and read at the first compile after a reset of JAX's
    cache, so it is reset on the way in and again on the way out (else the first answer would hold for the
    whole process: the cache off for every later program, or never off for ours). A compile on another
    thread meanwhile only misses the cache (and if one of ours hits it after all, ``_hits`` still keeps it out
    of the store)."""
    with _cache_off_lock:
        if _cache_off["depth"] == 0:
            _cache_off["saved"] = jax.config.jax_enable_compilation_cache
            jax.config.update("jax_enable_compilation_cache", False)
            compile_cache.reset_jax_cache()  # without it JAX keeps the answer it gave at its first compile
        _cache_off["depth"] += 1
    try:
        yield
    finally:
        with _cache_off_lock:
            _cache_off["depth"] -= 1
            if _cache_off["depth"] == 0:
                jax.config.update("jax_enable_compilation_cache", _cache_off["saved"])
                compile_cache.reset_jax_cache()


def _load(path: Path, device):
    """(the loaded executable on ``device``, the step's output tree) from a file, or None for a damaged or
    foreign one."""
    from jax.experimental import serialize_executable

    try:
        with open(path, "rb") as f:
            blob, in_tree, out_tree, fn_out_tree = pickle.load(f)
        return (serialize_executable.deserialize_and_load(blob, in_tree, out_tree, execution_devices=[device]),
                fn_out_tree)
    except Exception:  # noqa: BLE001 - a damaged or foreign file: compile again
        return None


def _save(path: Path, compiled, fn_out_tree) -> None:
    from jax.experimental import serialize_executable

    tmp = None
    try:
        blob, in_tree, out_tree = serialize_executable.serialize(compiled)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            pickle.dump((blob, in_tree, out_tree, fn_out_tree), f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, path)
    except Exception:  # noqa: BLE001 - not serializable here, or an unwritable store: the next process compiles
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)


def stored_jit(fn: Callable, name: str, static_argnums: Sequence[int] = (), donate_argnums: Sequence[int] = (),
               on_build: Callable[[], None] | None = None, log: ProgramLog | None = None) -> StoredJit:
    """``StoredJit(...)``: see the module docstring."""
    return StoredJit(fn, name, static_argnums, donate_argnums, on_build, log)


class StoredLowering:
    """A public ``jax.jit`` of ``fn`` (``jitted``, static arguments named ``static``) with its programs stored like
    ``StoredJit``'s, but built through that jit itself: a store miss runs ``jitted.lower(...).compile()`` with the
    compilation cache on, so the program is the very one a user's own ``jax.jit`` of ``fn`` with the same
    arguments gets, and the cache entry it leaves serves that user's jit (``generate_ragged`` and the notebook's
    ``jax.jit(generate)``). A program that came from the compilation cache instead cannot be stored (``_hits``):
    that process, and later ones, trace it and load it from the cache as a plain jit would (after an upgrade of
    this package until the cache entry goes). ``programs``: how many this object has built or loaded."""

    def __init__(self, jitted, fn: Callable, name: str, static: Sequence[str]) -> None:
        self.jitted, self.name, self.static = jitted, name, frozenset(static)
        self._params = list(inspect.signature(fn).parameters)
        self._programs: dict[tuple, Callable] = {}

    @property
    def programs(self) -> int:
        return len(self._programs)

    def __call__(self, *args, **kwargs):
        where = _store_dir()
        dyn_args = tuple(a for i, a in enumerate(args) if self._params[i] not in self.static)
        dyn_kwargs = {k: v for k, v in kwargs.items() if k not in self.static}
        leaves, in_tree = jax.tree.flatten((dyn_args, dyn_kwargs))
        if where is None or _multi_device(leaves):
            return self.jitted(*args, **kwargs)
        statics = sorted((self._params[i], a) for i, a in enumerate(args) if self._params[i] in self.static)
        statics = repr(statics + sorted((k, v) for k, v in kwargs.items() if k in self.static))
        key = (statics, _context(), in_tree, tuple(map(_aval, leaves)))  # _aval: PRNG key arrays have no weak_type
        call = self._programs.get(key)
        if call is None:
            call = self._programs[key] = self._program(where, args, kwargs, statics, in_tree, leaves)
        return call(*dyn_args, **dyn_kwargs)

    def _program(self, where: Path, args, kwargs, statics: str, in_tree, leaves) -> Callable:
        device = _device(leaves)
        path = _program_file(where, self.name, statics, in_tree, leaves)
        if path.exists():
            loaded = _load(path, device)
            if loaded is not None:
                return loaded[0]
        hits = getattr(_hits, "n", 0)
        compiled = self.jitted.lower(*args, **kwargs).compile()
        if getattr(_hits, "n", 0) == hits:  # compiled here, not loaded from the compilation cache
            _save(path, compiled, None)
        return compiled
