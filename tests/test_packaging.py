"""A non-editable install works: build the wheel, install it into a fresh venv, run ``LLM()`` outside the checkout.

The wheel is built offline from a copy of the files it is made of (``--no-build-isolation --no-index``, the
running interpreter's setuptools) and installed with ``--no-deps`` into a temporary venv. The venv finds
the dependencies through a ``.pth`` file listing this interpreter's site-packages (``site.getsitepackages()``:
wherever ``make test`` installed them), never the source tree: a ``.pth`` inside those directories (the
editable install's finder) is not processed. The generation runs with the working directory outside the
checkout and no ``PYTHONPATH``; it must import the package, the default checkpoint and the presets from the
venv. Cold ~35 s on 2 cores (wheel ~5 s, install ~2 s, ``LLM()`` + 4 tokens ~25 s; ~10 s with the step
programs in the persistent compilation cache).
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 300
#: What the wheel is built from (the rest of the checkout is not needed and not copied).
SOURCES = ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "deepinfer_jax", "sharding",
           "checkpoints/small-trained")

RUN = r"""
import json, sys
import deepinfer_jax
from deepinfer_jax import LLM, SamplingParams
from deepinfer_jax.llm import DEFAULT_CHECKPOINT
from deepinfer_jax.sharding import PRESET_DIR, resolve_preset
llm = LLM(max_num_seqs=1, speculation="none")
out = llm.generate(["def add(a, b):"], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)[0].outputs[0]
print(json.dumps({"module": deepinfer_jax.__file__, "checkpoint": str(DEFAULT_CHECKPOINT), "presets": str(PRESET_DIR),
                  "preset": resolve_preset("cpu-dp2-ep4").name, "tokens": list(out.token_ids), "text": out.text,
                  "sys_path": sys.path}))
"""


def _run(cmd, **kw) -> str:
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, check=False, **kw)
    assert res.returncode == 0, f"{cmd[:4]} failed ({res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-5000:]}"
    return res.stdout


def test_setup_py_ships_what_config_shipped_expects():
    from deepinfer_jax.config import shipped

    tree = ast.parse((ROOT / "setup.py").read_text())
    (value,) = [ast.literal_eval(n.value) for n in tree.body
                if isinstance(n, ast.Assign) and [t.id for t in n.targets if isinstance(t, ast.Name)] == ["SHIPPED_DATA"]]
    assert value == shipped.SHIPPED_DATA
    assert all((ROOT / rel).is_dir() for rel in shipped.SHIPPED_DATA)


@pytest.mark.slow
def test_wheel_installs_into_a_fresh_venv_and_generates(tmp_path):
    pytest.importorskip("setuptools", minversion="70.1")  # builds wheels without the `wheel` package
    src = tmp_path / "src"
    for rel in SOURCES:
        if (ROOT / rel).is_dir():
            shutil.copytree(ROOT / rel, src / rel, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "_shipped"))
        else:
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, src / rel)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
          "-w", str(tmp_path / "dist"), str(src)], env=env, cwd=tmp_path)
    (wheel,) = (tmp_path / "dist").glob("deepinfer_jax-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for rel in ("deepinfer_jax/model/deepseek_v41.py", "deepinfer_jax/config/sharding.py",
                "deepinfer_jax/_shipped/sharding/cpu-dp2-ep4.toml",
                "deepinfer_jax/_shipped/checkpoints/small-trained/model.safetensors",
                "deepinfer_jax/_shipped/checkpoints/small-trained/drafter.safetensors"):
        assert rel in names, f"the wheel lacks {rel}"

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], env=env)
    py = venv / "bin" / "python"
    purelib = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], env=env).strip())
    deps = [p for p in site.getsitepackages() if Path(p).is_dir()]
    assert not any(Path(p).resolve() == ROOT for p in deps)
    (purelib / "_deepinfer_test_deps.pth").write_text("\n".join(deps) + "\n")
    _run([str(py), "-m", "pip", "install", "--no-deps", "--no-index", "--ignore-installed", "-q", str(wheel)],
         env=env, cwd=tmp_path)

    run_dir = tmp_path / "elsewhere"
    run_dir.mkdir()
    out = json.loads(_run([str(py), "-c", RUN], env=env, cwd=run_dir).strip().splitlines()[-1])
    venv_root = venv.resolve()
    for key in ("module", "checkpoint", "presets"):
        path = Path(out[key]).resolve()
        assert path.is_relative_to(venv_root), f"{key} comes from {path}, not the venv"
        assert not path.is_relative_to(ROOT)
    assert out["checkpoint"].endswith("_shipped/checkpoints/small-trained") and out["preset"] == "cpu-dp2-ep4"
    assert not any(Path(p).resolve() == ROOT for p in out["sys_path"] if p)
    assert len(out["tokens"]) == 4 and out["text"]
