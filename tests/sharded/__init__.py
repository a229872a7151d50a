"""Scripts that tests run in subprocesses with fake CPU devices (XLA_FLAGS) or as several jax.distributed processes."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent


#: XLA:CPU flags of every subprocess besides the device count: LLVM's optimisation level 0 compiles these tiny
#: models' programs ~40% faster, and compiling, not running, is what these checks spend their time on.
XLA_FLAGS = "--xla_backend_optimization_level=0"


def _env(devices: int, **extra: str) -> dict:
    """This process's environment for a subprocess with ``devices`` fake CPU devices, no multi-host settings
    unless given in ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEEPINFER_")}
    env.update(XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} {XLA_FLAGS}", JAX_PLATFORMS="cpu")
    return {**env, **extra}


def run_checks(script: str, *args: str, devices: int = 8, timeout: int = 300) -> dict[str, dict]:
    """Run ``tests/sharded/<script>`` with ``devices`` fake CPU devices; returns its printed JSON rows by
    their ``check`` name. The script must exit 0 and print a final ``{"check": "done"}`` row."""
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "sharded" / script), *args], cwd=ROOT,
                          env=_env(devices), check=False, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{script} failed (rc {proc.returncode}):\n{proc.stdout}\n{proc.stderr[-4000:]}"
    out = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            out[row.pop("check")] = row
    assert "done" in out, proc.stdout
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_processes(script: str, *args: str, processes: int = 2, devices: int = 4) -> list[subprocess.Popen]:
    """Start ``processes`` copies of ``tests/sharded/<script>`` as one jax.distributed run on localhost (the
    ``DEEPINFER_*`` settings), ``devices`` fake CPU devices each; output (stdout and stderr) is piped."""
    port = free_port()
    return [subprocess.Popen([sys.executable, str(ROOT / "tests" / "sharded" / script), *args], cwd=ROOT,
                             env=_env(devices, DEEPINFER_COORDINATOR=f"127.0.0.1:{port}",
                                      DEEPINFER_NUM_PROCESSES=str(processes), DEEPINFER_PROCESS_ID=str(i)),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for i in range(processes)]


def finish_processes(procs: list[subprocess.Popen], timeout: int) -> list[tuple[int | None, str]]:
    """(exit code, output) of each process, waiting at most ``timeout`` seconds in all; on overrun every process is
    killed and its exit code reported as None."""
    try:
        outs = [p.communicate(timeout=timeout)[0] for p in procs]
        return [(p.returncode, out) for p, out in zip(procs, outs)]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        return [(None, p.communicate()[0]) for p in procs]
