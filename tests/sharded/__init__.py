"""Scripts that tests run in subprocesses with fake CPU devices (XLA_FLAGS) or as several jax.distributed processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent


def run_checks(script: str, *args: str, devices: int = 8, timeout: int = 300) -> dict[str, dict]:
    """Run ``tests/sharded/<script>`` with ``devices`` fake CPU devices; returns its printed JSON rows by
    their ``check`` name. The script must exit 0 and print a final ``{"check": "done"}`` row."""
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "sharded" / script), *args], cwd=ROOT, env=env,
                          check=False, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{script} failed (rc {proc.returncode}):\n{proc.stdout}\n{proc.stderr[-4000:]}"
    out = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            out[row.pop("check")] = row
    assert "done" in out, proc.stdout
    return out
