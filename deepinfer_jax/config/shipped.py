"""Where the shipped data lives: the sharding presets (``sharding/``) and the default checkpoint
(``checkpoints/small-trained``), in an installed wheel and in the source tree.

The data sits at the top of the repository (``sharding/``, ``checkpoints/``: data, not code, as the
layout in docs/layout.md says). A wheel (``pip install .``) carries copies inside the package, under
``deepinfer_jax/_shipped/<same relative path>`` (``setup.py`` copies them at build time). ``shipped(rel)``
returns the packaged copy when there is one, else the source tree's (an editable install or a
checkout on ``PYTHONPATH``), else the packaged path, so an error names where the file was expected.
Plain Python, no JAX.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["PACKAGED", "SHIPPED_DATA", "SOURCE_ROOT", "shipped"]

#: Inside an installed package: ``deepinfer_jax/_shipped``.
PACKAGED = Path(__file__).resolve().parent.parent / "_shipped"
#: The repository root when this module runs from a checkout (the directory holding ``pyproject.toml``).
SOURCE_ROOT = Path(__file__).resolve().parents[2]
#: The data a wheel ships: paths relative to the repository root (``setup.py`` reads this tuple).
SHIPPED_DATA = ("sharding", "checkpoints/small-trained")


def shipped(rel: str) -> Path:
    """The directory or file ``rel`` (relative to the repository root, e.g. ``"sharding"``): the wheel's copy,
    else the checkout's."""
    packaged = PACKAGED / rel
    if packaged.exists():
        return packaged
    source = SOURCE_ROOT / rel
    if (SOURCE_ROOT / "pyproject.toml").is_file() and source.exists():
        return source
    return packaged
