"""The Ascend bridge: JAX kernels served by torch_npu's fused operators (optional extra ``ascend``).

``sparse_attention`` and ``grouped_matmul`` take the same JAX inputs as their jnp references and
return JAX arrays; arrays reach torch through DLPack. ``torch_npu`` is imported on first use only
(``backend.load_npu_ops``); when it cannot load, ``AscendUnavailableError`` names the missing CANN
library. ``use_ops`` / ``ops=`` install another operator table (tests: plain CPU torch).
Sources and notes: ``custom_calls/ascend/``.
"""

from deepinfer_jax.ops.ascend.backend import AscendUnavailableError, NpuOps, get_ops, load_npu_ops, use_ops
from deepinfer_jax.ops.ascend.bridge import grouped_matmul, sparse_attention

__all__ = ["AscendUnavailableError", "NpuOps", "get_ops", "grouped_matmul", "load_npu_ops", "sparse_attention",
           "use_ops"]
