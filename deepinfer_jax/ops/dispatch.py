"""One dispatch table: kernel name -> {platform -> implementation}, and the selection rule.

Platforms: ``"cpu"`` (the jnp reference), ``"pallas"`` / ``"gpu"`` / ``"tpu"`` (the Pallas kernels),
``"cuda_ffi"`` (``deepinfer_jax.ops.ffi``: XLA FFI custom calls) and ``"ascend"``
(``deepinfer_jax.ops.ascend``: the torch_npu bridge). The last two are registered as lazy imports:
nothing is imported until a kernel is looked up with that platform selected.

Selection (read at *trace* time, each time a kernel is looked up):

1. the innermost ``use_kernels(setting)`` context, else
2. the environment variable ``DEEPINFER_KERNELS`` (read here and nowhere else), else
3. ``jax.default_backend()`` (``auto``): a backend in ``VALIDATED_BACKENDS`` gets its kernels
   (``"gpu"``/``"cuda"``/``"rocm"`` -> ``"gpu"``, ``"tpu"`` -> ``"tpu"``), anything else the
   reference. No accelerator run has validated the Pallas kernels yet (they pass interpret-mode
   tests on CPU only), so ``VALIDATED_BACKENDS`` is empty and ``auto`` means the reference
   everywhere: select ``pallas`` / ``gpu`` explicitly to run them. A GPU run that passes
   ``benchmarks/kernels.py`` is what adds ``"gpu"`` here.

Settings: ``reference`` (= ``cpu``), ``pallas``, ``pallas_interpret`` (Pallas kernels run by the
interpreter: CPU tests), ``gpu``, ``tpu``, ``cuda_ffi``, ``ascend``, ``auto`` (rule 3). A kernel
that has no implementation for the selected platform falls back along ``FALLBACK`` (e.g. ``cuda_ffi``
-> ``gpu`` -> ``cpu``), so selecting ``cuda_ffi`` keeps the Pallas kernels for the ops it lacks.

The choice is baked into whatever is traced while it holds. ``use_kernels`` sets a JAX user
context (``jax.make_user_context``, public API) that is part of the jit cache key and the trace
context, so a jitted function called inside ``use_kernels`` retraces instead of reusing a trace
made under another selection. ``$DEEPINFER_KERNELS`` is not part of the key: set it before
anything is traced.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
from collections.abc import Callable, Iterator

import jax

ENV_VAR = "DEEPINFER_KERNELS"
#: Backends whose kernels ``auto`` selects (see the module docstring: none validated yet).
VALIDATED_BACKENDS: tuple[str, ...] = ()
PLATFORMS = ("cpu", "pallas", "gpu", "tpu", "cuda_ffi", "ascend")
SETTINGS = ("auto", "reference", "pallas_interpret", *PLATFORMS)
# where a platform without its own implementation of a kernel looks next
FALLBACK = {"gpu": "pallas", "tpu": "pallas", "pallas": "cpu", "cuda_ffi": "gpu", "ascend": "cpu", "cpu": None}


class _Lazy:
    """An implementation in an optional module, imported on first use (``module:attr``)."""

    def __init__(self, module: str, attr: str):
        self.module, self.attr = module, attr

    def resolve(self) -> Callable:
        try:
            mod = importlib.import_module(self.module)
        except ImportError as e:
            raise ImportError(f"kernel implementation {self.module}.{self.attr} is not available: {e}") from e
        return getattr(mod, self.attr)

    def __repr__(self) -> str:
        return f"<lazy {self.module}.{self.attr}>"


def _ref(kernel: str, attr: str) -> _Lazy:
    return _Lazy(f"deepinfer_jax.ops.{kernel}.reference", attr)


def _pallas(kernel: str, attr: str) -> _Lazy:
    return _Lazy(f"deepinfer_jax.ops.{kernel}.pallas", attr)


def _both(kernel: str, attr: str) -> dict[str, _Lazy]:
    return {"cpu": _ref(kernel, attr), "pallas": _pallas(kernel, attr)}


TABLE: dict[str, dict[str, object]] = {
    "sparse_attention": {**_both("sparse_attention", "sparse_attention"),
                         "cuda_ffi": _Lazy("deepinfer_jax.ops.ffi", "sparse_attention_decode"),
                         "ascend": _Lazy("deepinfer_jax.ops.ascend", "sparse_attention")},
    "indexer_scores": _both("indexer_topk", "indexer_scores"),
    "indexer_topk": _both("indexer_topk", "indexer_topk"),
    "grouped_matmul": {**_both("grouped_matmul", "grouped_matmul"),
                       "ascend": _Lazy("deepinfer_jax.ops.ascend", "grouped_matmul")},
    "mhc_mix": _both("mhc", "mhc_mix"),
    "mhc_mix_collapse": _both("mhc", "mhc_mix_collapse"),
    "mhc_collapse": _both("mhc", "mhc_collapse"),
    "mhc_expand": _both("mhc", "mhc_expand"),
    "fp8_block_gemm": {"cpu": _Lazy("deepinfer_jax.ops.ffi", "fp8_block_gemm_reference"),
                       "cuda_ffi": _Lazy("deepinfer_jax.ops.ffi", "fp8_block_gemm")},
    # weights resident in their storage formats (model.qweight.QWeight), decoded inside the matmul
    "quantized_matmul": {"cpu": _ref("quantized_matmul", "quantized_matmul"),
                         "cuda_ffi": _Lazy("deepinfer_jax.ops.quantized_matmul.cuda", "quantized_matmul")},
    "quantized_grouped_matmul": _both("quantized_matmul", "quantized_grouped_matmul"),
}

#: The ``use_kernels`` selection: a JAX user context (``jax.make_user_context``, public API), so it is part of
#: the jit cache key and the trace context; None outside every ``use_kernels`` block.
_STATE = jax.make_user_context(None)


def register(kernel: str, platform: str, impl: Callable | _Lazy) -> None:
    """Add or replace one implementation (e.g. a custom call built later)."""
    if platform not in PLATFORMS:
        raise ValueError(f"platform must be one of {PLATFORMS}, got {platform!r}")
    TABLE.setdefault(kernel, {})[platform] = impl


def _check_setting(setting: str, source: str) -> str:
    if not isinstance(setting, str) or setting.strip().lower() not in SETTINGS:
        raise ValueError(f"{source} must be one of {SETTINGS}, got {setting!r}")
    return setting.strip().lower()


def setting() -> str:
    """The active setting (context, then ``$DEEPINFER_KERNELS``, then ``auto``)."""
    if _STATE.value is not None:
        return _STATE.value
    env = os.environ.get(ENV_VAR)
    return _check_setting(env, f"${ENV_VAR}") if env else "auto"


def platform() -> tuple[str, bool]:
    """(selected platform, interpret flag for Pallas kernels)."""
    s = setting()
    if s == "auto":
        backend = jax.default_backend()
        s = {"gpu": "gpu", "cuda": "gpu", "rocm": "gpu", "tpu": "tpu"}.get(backend, "cpu")
        if s not in VALIDATED_BACKENDS:
            s = "cpu"
    if s == "reference":
        return "cpu", False
    if s == "pallas_interpret":
        return "pallas", True
    return s, False


def uses_reference() -> bool:
    """True when the selection resolves to the jnp references (the model keeps its dense paths)."""
    return platform()[0] == "cpu"


def get(kernel: str) -> Callable:
    """The implementation of ``kernel`` for the selected platform (Pallas ones with ``interpret`` bound)."""
    if kernel not in TABLE:
        raise ValueError(f"kernel must be one of {sorted(TABLE)}, got {kernel!r}")
    plat, interpret = platform()
    impls, p = TABLE[kernel], plat
    while p is not None and p not in impls:
        p = FALLBACK[p]
    if p is None:
        raise ValueError(f"kernel {kernel!r} has no implementation for platform {plat!r} "
                         f"(set by {ENV_VAR} / use_kernels); it has {sorted(impls)}")
    impl = impls[p]
    impl = impl.resolve() if isinstance(impl, _Lazy) else impl
    if p == "pallas":
        return functools.partial(impl, interpret=interpret)
    return impl


@contextlib.contextmanager
def use_kernels(setting_: str) -> Iterator[None]:
    """Select kernels for whatever is traced inside the block, e.g. ``use_kernels("pallas_interpret")``."""
    value = _check_setting(setting_, "use_kernels(setting)")
    with _STATE(value):
        yield
