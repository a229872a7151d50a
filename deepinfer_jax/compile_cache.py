"""The persistent XLA compilation cache: compiled step programs survive the process.

Every ``LLM()`` and the jitted ``generate`` call ``enable()`` before they compile anything, so a
second process with the same model, cache layout and buckets loads its programs from disk instead
of compiling them again. The directory is, in order: the ``compilation_cache`` engine setting, the
``DEEPINFER_COMPILATION_CACHE`` environment variable, a directory the user already gave JAX
(``jax_compilation_cache_dir``), else ``~/.cache/deepinfer_jax/xla``. The value ``"off"`` (setting
``False`` or ``"off"``, or the variable set to ``off``/``0``/empty) turns it off, and so does a user's
own ``jax_enable_compilation_cache=False`` when neither the setting nor the variable is given.

Entries are JAX's own: the key hashes the lowered program (so every shape, dtype and static
setting of the model), the compile options and XLA flags, the backend and device kind, and the
jax/jaxlib versions, so another version, backend or model shape never reuses a program. Tracing
still happens on a cache hit (the engine's trace counters stay meaningful); only XLA's compilation
is skipped.

The cache is trusted code: do not point it at a directory others can write.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import jax

__all__ = ["ENV", "OFF_VALUES", "cache_dir", "enable", "reset_jax_cache", "resolve"]

ENV = "DEEPINFER_COMPILATION_CACHE"
OFF_VALUES = ("off", "0", "false", "")
#: Programs that compile faster than this are not worth a file (seconds). Lower than JAX's 1 s: a random-weight
#: model's ~30 initialisation programs take 0.02-0.2 s each, ~1.5 s of every new process's start (docs/startup.md §1).
MIN_COMPILE_S = 0.02

_lock = threading.Lock()
_enabled_dir: list[str | None] = [None]


def _default_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "deepinfer_jax" / "xla"


def resolve(setting: str | os.PathLike | bool | None = None) -> Path | None:
    """The cache directory the setting asks for, or None when it is off (see the module docstring).

    ``ValueError`` naming ``compilation_cache`` for a value that is neither a path, a bool nor None.
    """
    if setting is False or (isinstance(setting, str) and setting.strip().lower() in OFF_VALUES):
        return None
    if setting is not None and setting is not True:
        if not isinstance(setting, (str, os.PathLike)):
            raise ValueError(f"compilation_cache must be a directory path, True, False, 'off' or None, "
                             f"got {setting!r}")
        return Path(setting).expanduser()
    raw = os.environ.get(ENV)
    if raw is not None:
        return None if raw.strip().lower() in OFF_VALUES else Path(raw).expanduser()
    if setting is None and not jax.config.jax_enable_compilation_cache:
        return None  # the user turned JAX's cache off
    own = jax.config.jax_compilation_cache_dir
    return Path(own) if own else _default_dir()


def enable(setting: str | os.PathLike | bool | None = None) -> Path | None:
    """Point JAX's persistent compilation cache at ``resolve(setting)`` (idempotent); returns the
    directory in use, or None when the cache is off. A directory that cannot be created turns the
    cache off for this process with a warning instead of failing the engine."""
    path = resolve(setting)
    with _lock:
        if path is None:
            if _enabled_dir[0] is not None:
                jax.config.update("jax_enable_compilation_cache", False)
                _enabled_dir[0] = None
            return None
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            import logging

            logging.getLogger(__name__).warning("compilation cache %s is not usable (%s); compiling without it",
                                                path, e)
            return None
        key = str(path.resolve())
        if _enabled_dir[0] == key:
            return path
        if jax.config.jax_compilation_cache_dir != key:
            jax.config.update("jax_compilation_cache_dir", key)
            reset_jax_cache()  # JAX fixes its directory at the first compilation; move it
        jax.config.update("jax_enable_compilation_cache", True)
        if jax.config.jax_persistent_cache_min_compile_time_secs > MIN_COMPILE_S:
            jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_S)
        _enabled_dir[0] = key
        return path


def cache_dir() -> Path | None:
    """The directory ``enable`` last switched on in this process, or None."""
    return None if _enabled_dir[0] is None else Path(_enabled_dir[0])


def reset_jax_cache() -> None:
    """Make JAX look at its cache settings again at the next compile.

    JAX reads the directory, and whether the cache is on at all, at the first compile after start-up or
    after a reset, and keeps both until the next reset: ``jax_enable_compilation_cache`` changed in
    between has no effect. Whoever changes either setting resets (``runner/program_store.py`` does, around
    the compiles it keeps out of the cache)."""
    try:  # public API; resetting a cache that never initialised is a no-op
        from jax.experimental.compilation_cache import compilation_cache as cc

        cc.reset_cache()
    except (ImportError, AttributeError):  # another jax layout: the directory applies from the next process
        pass
