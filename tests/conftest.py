import gc
import os
import sys
import time
from pathlib import Path

import pytest

# Persistent XLA compilation cache: the model's jitted forward compiles once per machine.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(Path(__file__).resolve().parent.parent / ".jax_cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.02")

#: Seconds of test time per file in fresh-clone runs (2 workers; the mean of three runs on 2026-12-07, and for
#: the files moved to the 5-layer cut that day, their run after the move), for the files over ~25 s. ``make test``
#: hands pytest-xdist whole files (``--dist loadfile --no-loadscope-reorder``) in collection order, so they are
#: collected longest first: each worker then ends on short files instead of one waiting ~40 s for the other to
#: finish a long one (longest-processing-time-first). Stale figures only cost balance, never correctness.
_EXPECTED_FILE_S = {
    "test_dp_engine.py": 217, "test_quantized_residency.py": 142, "test_cluster_pd.py": 139, "test_spec_decode.py": 137,
    "test_batch_processes.py": 76, "test_oracle_parity.py": 73, "test_paged_step.py": 72, "test_sharding.py": 66,
    "test_engine.py": 62, "test_context_parallel.py": 61, "test_structured_model.py": 56, "test_decoder_replay.py": 55,
    "test_startup.py": 51, "test_spec_shipped.py": 50, "test_notebook.py": 50, "test_train.py": 48,
    "test_dspark.py": 48, "test_model_components.py": 31, "test_ops_kernels.py": 30, "test_serve.py": 29,
    "test_moe_strategy.py": 26, "test_replay_research.py": 25, "test_index_tiles.py": 25,
}


def pytest_collection_modifyitems(config, items):
    """Longest files first (``_EXPECTED_FILE_S``); a stable sort, so every file keeps its own order."""
    items.sort(key=lambda item: -_EXPECTED_FILE_S.get(Path(str(item.fspath)).name, 0))


# DEEPINFER_TEST_TIMES=F: one "seconds phase nodeid time compile_s compiles" line per test phase in F, and one
# "nodeid program seconds shapes-digest hit|miss" line per compiled program in F.programs
_TIMES = os.environ.get("DEEPINFER_TEST_TIMES")
_COMPILED = [0.0, 0]  # XLA backend compile seconds and programs in this process since the last logged phase
_PROGRAMS: list[str] = []  # "name seconds shapes-digest hit|miss" per program compiled since the last logged phase
_SHAPES: dict[str, str] = {}  # program name -> digest of the argument shapes it was last lowered with

if _TIMES:
    import jax.monitoring

    def _count_compile(event: str, duration: float, fun_name: str = "?", **_) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            _COMPILED[0] += duration
            _COMPILED[1] += 1
            outcome = _OUTCOME.pop(_module(fun_name), "-")
            _PROGRAMS.append(f"{fun_name} {duration:.2f} {_SHAPES.get(fun_name, '-')} {outcome}")

    jax.monitoring.register_event_duration_secs_listener(_count_compile)

    import hashlib
    import logging

    _OUTCOME: dict[str, str] = {}  # program name -> "hit" or "miss" in the persistent compilation cache

    def _module(name: str) -> str:
        """``jit(f)`` (the compile event's name) and ``jit_f`` (the cache's module name) as one key."""
        return name.replace("(", "_").rstrip(")")

    class _ProgramLog(logging.Handler):
        """JAX's debug records: the argument shapes of each lowered program and its persistent-cache outcome."""

        def emit(self, record: logging.LogRecord) -> None:
            msg = record.getMessage()
            if msg.startswith("Compiling "):
                name = msg.split(" ", 2)[1]
                _SHAPES[name] = hashlib.sha1(msg.split(". Argument mapping")[0].encode()).hexdigest()[:10]
            elif msg.upper().startswith("PERSISTENT COMPILATION CACHE "):
                _OUTCOME[_module(msg.split("'")[1])] = "miss" if "MISS" in msg else "hit"

    for _name in ("jax._src.interpreters.pxla", "jax._src.compiler"):
        logging.getLogger(_name).setLevel(logging.DEBUG)
        logging.getLogger(_name).addHandler(_ProgramLog())


@pytest.fixture(scope="module")
def xla_cpu_level0():
    """For one module: the engine's programs, and the test's own compiled through ``compile_options.jit``, at
    XLA:CPU's LLVM level 0 (``DEEPINFER_XLA_CPU_OPT_LEVEL``). For files that compile many programs and run each
    a few steps; measured per file in docs/startup.md §7. Modules use it with
    ``pytestmark = pytest.mark.usefixtures("xla_cpu_level0")``."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DEEPINFER_XLA_CPU_OPT_LEVEL", "0")
        yield


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop every jitted program's in-memory executables after each test module (the persistent cache
    keeps them on disk), so that one pytest process does not accumulate every module's engines."""
    yield
    jax = sys.modules.get("jax")
    if jax is not None:
        jax.clear_caches()
    gc.collect()


def pytest_runtest_logreport(report):
    if _TIMES:
        with open(_TIMES, "a") as f:
            f.write(f"{report.duration:.2f} {report.when} {report.nodeid} {time.strftime('%H:%M:%S')} "
                    f"{_COMPILED[0]:.2f} {_COMPILED[1]}\n")
        _COMPILED[:] = [0.0, 0]
        if _PROGRAMS:
            with open(_TIMES + ".programs", "a") as f:
                f.writelines(f"{report.nodeid} {line}\n" for line in _PROGRAMS)
            _PROGRAMS.clear()
