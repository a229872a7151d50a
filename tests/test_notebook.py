"""The example notebook runs top to bottom (nbclient) and shows what it claims: the ragged jitted
``generate`` equals its own pure-function form and the engine's greedy tokens."""

from __future__ import annotations

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOK = Path(__file__).resolve().parent.parent / "examples" / "notebooks" / "generate.ipynb"

pytestmark = pytest.mark.slow


def _text(cell) -> str:
    """The cell's standard output and results (progress bars go to stderr)."""
    return "".join(o.get("text", "") if o.get("output_type") == "stream" and o.get("name") == "stdout"
                   else o.get("data", {}).get("text/plain", "") for o in cell.get("outputs", [])
                   if o.get("output_type") in ("stream", "execute_result"))


def test_the_generate_notebook_runs_and_agrees_with_the_engine():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbclient.NotebookClient(nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOK.parent)}}
                            ).execute()
    code = [c for c in nb.cells if c.cell_type == "code"]
    errors = [o for c in code for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, errors
    assert _text(code[-2]).strip().splitlines()[-1] == "True"  # the pure function under jax.jit, ragged rows
    assert _text(code[-1]).strip().splitlines()[-1] == "[True, True]"  # the engine's greedy tokens
