"""How weights stay resident: the ``weights`` setting and the host-side stored tensor (numpy only).

``weights="quantized"`` keeps every tensor that the checkpoint stores with a UE8M0 scale partner in
its storage format (FP8 E4M3 32x32 blocks, packed FP4 experts, FP8 Engram rows) and the plain
BF16 ``embed``/``head`` in BF16; the model decodes them inside its matmuls and lookups
(``model.qweight``, ``ops.quantized_matmul``). ``"float32"`` / ``"bfloat16"`` decode everything at
load, as before (the oracle parity tests use ``"float32"``). ``"auto"``: ``"quantized"`` for a
checkpoint with quantized tensors, else ``"float32"``.

Small tensors (norms, mHC mixers, biases, router and compressor matrices) are float32 in every mode.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

WEIGHTS = ("auto", "quantized", "float32", "bfloat16")
#: Plain (unscaled) tensors kept in their BF16 storage under ``weights="quantized"``: the big ones.
BF16_RESIDENT = ("embed.weight", "head.weight")


class WeightsError(ValueError):
    """A bad ``weights`` setting, or one the checkpoint / engine cannot honour. ``field`` is ``"weights"``."""

    field = "weights"

    def __init__(self, message: str):
        super().__init__(f"weights: {message}")


def check_weights(value) -> str:
    """``value`` if it is one of :data:`WEIGHTS`, else :class:`WeightsError` naming the field."""
    if not isinstance(value, str) or value not in WEIGHTS:
        raise WeightsError(f"must be one of {WEIGHTS}, got {value!r}")
    return value


def resolve_weights(value, quantized_checkpoint: bool) -> str:
    """``"quantized"``, ``"float32"`` or ``"bfloat16"`` for a setting and whether the checkpoint has scales."""
    value = check_weights(value)
    if value == "auto":
        return "quantized" if quantized_checkpoint else "float32"
    return value


@dataclass
class StoredTensor:
    """A tensor as the checkpoint stores it: ``data`` (E4M3, packed FP4 as uint8, or BF16), ``scale``
    (UE8M0 bytes as uint8, or None), ``kind`` (``"fp8"``, ``"fp4"``, ``"bf16"``), ``block`` (rows,
    cols per scale entry) and the decoded ``shape``; leading axes (stacked experts) carry no blocks."""

    data: np.ndarray
    scale: np.ndarray | None
    kind: str
    block: tuple[int, int]
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes + (0 if self.scale is None else self.scale.nbytes))
