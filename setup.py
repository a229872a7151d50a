"""Build hook: the wheel carries the shipped data (``sharding/``, ``checkpoints/small-trained``) as package data.

The data lives at the top of the repository (data, not code: docs/layout.md). ``build_py`` copies each
path of ``deepinfer_jax.config.shipped.SHIPPED_DATA`` to ``deepinfer_jax/_shipped/<path>`` in the build,
where ``config.shipped.shipped()`` looks first; an editable install reads the checkout instead.
Everything else is in pyproject.toml.
"""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
SHIPPED_DATA = ("sharding", "checkpoints/small-trained")  # = deepinfer_jax.config.shipped.SHIPPED_DATA (a test checks)


class BuildPyWithData(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return  # the checkout is on the path: config.shipped finds the data there
        for rel in SHIPPED_DATA:
            src, dst = ROOT / rel, Path(self.build_lib) / "deepinfer_jax" / "_shipped" / rel
            if not src.is_dir():
                raise FileNotFoundError(f"shipped data {src} is missing (see deepinfer_jax/config/shipped.py)")
            shutil.copytree(src, dst, dirs_exist_ok=True)


setup(cmdclass={"build_py": BuildPyWithData})
