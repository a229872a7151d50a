"""The NPU operator table the Ascend bridge calls, and the lazy, explained loading of torch_npu.

``NpuOps`` holds the few torch-level functions the bridge needs, with torch_npu's argument
conventions; ``load_npu_ops()`` fills it from ``torch_npu`` (imported on first use, never at package
import), and any stand-in with the same functions (tests use plain CPU torch) can be installed with
``use_ops(...)`` or passed as ``ops=``.

When torch_npu cannot load, ``AscendUnavailableError`` names the missing CANN shared library
(e.g. ``libhccl.so``) parsed from the ImportError / OSError, and says how to fix it.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

_SO = re.compile(r"(lib[\w.+-]*?\.so(?:\.[\d.]+)?)\b")
_FIX = (
    "source the CANN toolkit environment (e.g. `source /usr/local/Ascend/ascend-toolkit/set_env.sh`, which puts "
    "its lib64 on LD_LIBRARY_PATH) and install the extra: pip install 'deepinfer-jax[ascend]'"
)


class AscendUnavailableError(ImportError):
    """torch_npu (or the CANN library it needs) cannot be loaded; ``missing_library`` names the .so if known."""

    def __init__(self, message: str, missing_library: str | None = None):
        super().__init__(message)
        self.missing_library = missing_library


@dataclass(frozen=True)
class NpuOps:
    """The operator table: torch_npu's fused operators and the host <-> device moves.

    - ``fused_infer_attention_score(query, key, value, *, atten_mask, num_heads, num_key_value_heads,
      scale, input_layout, softmax_lse_flag) -> (out, lse)`` as ``torch_npu.npu_fused_infer_attention_score``
      (BNSD layout; ``atten_mask`` True = masked out; lse [B, N, S, 1] fp32).
    - ``grouped_matmul(x, weight, *, group_list, split_item, group_type, group_list_type) -> list`` as
      ``torch_npu.npu_grouped_matmul`` (x [M, K] one tensor, weight one [K, N] tensor per group,
      ``group_list`` cumulative row counts int64 with ``group_list_type=0``, ``split_item=3``:
      one output tensor [M, N]).
    - ``to_device`` / ``to_host``: move a torch tensor onto the NPU and back (identity on CPU).
    - ``attention_dtypes``: torch dtypes the attention operator accepts; others are cast to bfloat16.
    """

    name: str
    fused_infer_attention_score: Callable[..., tuple[Any, Any]]
    grouped_matmul: Callable[..., list]
    to_device: Callable[[Any], Any]
    to_host: Callable[[Any], Any]
    attention_dtypes: tuple[Any, ...]


def missing_library(err: BaseException) -> str | None:
    """The shared library named in an import/load error's message (``libhccl.so``), if any."""
    for e in (err, err.__cause__, err.__context__):
        if e is not None:
            m = _SO.search(str(e))
            if m:
                return m.group(1)
    return None


def import_torch_npu():
    """``import torch_npu`` (with torch's device autoload off), or an ``AscendUnavailableError`` that explains."""
    # An installed torch_npu without CANN breaks a plain `import torch` unless autoload is off.
    os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
    try:
        return importlib.import_module("torch_npu")
    except ModuleNotFoundError as err:
        if err.name not in (None, "torch_npu", "torch"):
            lib = missing_library(err)
            if lib:
                raise AscendUnavailableError(f"torch_npu cannot load: {lib} is missing; {_FIX}", lib) from err
        raise AscendUnavailableError(f"torch_npu is not installed ({err}); {_FIX}") from err
    except (ImportError, OSError) as err:
        lib = missing_library(err)
        what = f"the Ascend CANN library {lib} is missing or not on LD_LIBRARY_PATH" if lib else str(err)
        raise AscendUnavailableError(f"torch_npu cannot load: {what} ({err}); {_FIX}", lib) from err


def _fia_adapter(fia: Callable) -> Callable:
    """torch_npu's fused attention with our ``scale`` keyword (older releases call it ``scale_value``)."""

    def call(query, key, value, *, scale, **kwargs):
        try:
            return fia(query, key, value, scale=scale, **kwargs)
        except TypeError as err:
            if "scale" not in str(err):
                raise
            return fia(query, key, value, scale_value=scale, **kwargs)

    return call


def load_npu_ops() -> NpuOps:
    """The real operator table, from ``torch_npu`` (imported now)."""
    torch_npu = import_torch_npu()
    import torch

    return NpuOps(
        name="torch_npu",
        fused_infer_attention_score=_fia_adapter(torch_npu.npu_fused_infer_attention_score),
        grouped_matmul=torch_npu.npu_grouped_matmul,
        to_device=lambda t: t.to("npu", non_blocking=True),
        to_host=lambda t: t.cpu(),
        attention_dtypes=(torch.float16, torch.bfloat16),
    )


_stack: list[NpuOps] = []
_default: NpuOps | None = None


def get_ops(ops: NpuOps | None = None) -> NpuOps:
    """``ops`` if given, else the innermost ``use_ops`` table, else the torch_npu table (loaded once)."""
    global _default
    if ops is not None:
        return ops
    if _stack:
        return _stack[-1]
    if _default is None:
        _default = load_npu_ops()
    return _default


@contextlib.contextmanager
def use_ops(ops: NpuOps) -> Iterator[NpuOps]:
    """Run the bridge on ``ops`` (e.g. a CPU-torch stand-in) inside the block."""
    if not isinstance(ops, NpuOps):
        raise TypeError(f"ops must be an NpuOps, got {type(ops).__name__}")
    _stack.append(ops)
    try:
        yield ops
    finally:
        _stack.pop()
