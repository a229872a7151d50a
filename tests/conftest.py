import gc
import os
import sys
import time
from pathlib import Path

import pytest

# Persistent XLA compilation cache: the model's jitted forward compiles once per machine.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(Path(__file__).resolve().parent.parent / ".jax_cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")

_TIMES = os.environ.get("DEEPINFER_TEST_TIMES")  # a file: one "seconds phase nodeid time compile_s compiles" line
_COMPILED = [0.0, 0]  # XLA backend compile seconds and programs in this process since the last logged phase

if _TIMES:
    import jax.monitoring

    def _count_compile(event: str, duration: float, **_) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            _COMPILED[0] += duration
            _COMPILED[1] += 1

    jax.monitoring.register_event_duration_secs_listener(_count_compile)


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
