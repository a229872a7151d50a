"""The handoff between engines (issue 23): what a prefill instance gives a decode instance.

A request's cache state after ``L = len(prompt) + len(output) - 1`` tokens (the newest sampled token's
KV is computed by whoever continues) is split in two:

- its **complete blocks** go to the shared block store (``cache.block_store.FileBlockStore``, one
  checksummed file per block, keyed by the chained block digest every engine computes alike); the
  handoff names them by digest;
- the rest travels **in the handoff itself**: the partial last block's rows (``L % block_size`` of
  them; content-addressing needs a full block) and the slot's whole state at ``L``
  (``ModelRunner.snapshot_slot``: every layer's SWA ring, the compressor's pending group, the Engram
  look-back), so the receiver continues at exactly ``L`` with nothing recomputed.

Wire format (one ``bytes`` object; it rides Ray's object store, see docs/cluster.md)::

    magic "DIJXHOF1" | u32 header length | header JSON | array bytes | sha256 of everything before it

The header holds ``version``, ``model`` (the model fingerprint, hex), ``block_size``, the request's
``request_id`` / ``prompt_ids`` / ``output_ids`` / ``logprobs``, ``digests`` (hex, one per complete
block), ``written`` (the sender stored every complete block without an error), ``source``
("prefill" or "forward") and ``arrays`` (name, dtype, shape, offset, nbytes; names ``tail/<leaf>``
and ``slot/<leaf>``). ``decode_handoff`` checks all of it and raises ``HandoffError`` whose
``field`` names what is wrong; a receiver then recomputes instead (never wrong tokens).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

import numpy as np

from deepinfer_jax.cache.block_store import _dtype
from deepinfer_jax.engine.outputs import TokenLogprobs

__all__ = ["HANDOFF_VERSION", "Handoff", "HandoffError", "decode_handoff", "encode_handoff"]

HANDOFF_VERSION = 1
_MAGIC = b"DIJXHOF1"


class HandoffError(ValueError):
    """A handoff that cannot be used; ``field`` names the part at fault (also the message's first word)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass
class Handoff:
    """One request's state after ``length`` tokens (see the module docstring)."""

    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    block_size: int
    model: str  # the model fingerprint, hex
    digests: list[str]  # complete blocks, in the store
    slot_state: dict[str, np.ndarray]
    tail: dict[str, np.ndarray] | None = None  # the partial last block's rows (None when length % block_size == 0)
    logprobs: list[TokenLogprobs] | None = None
    written: bool = True
    source: str = "prefill"
    version: int = HANDOFF_VERSION
    nbytes: int = field(default=0, compare=False)  # the encoded size, set by encode / decode

    @property
    def length(self) -> int:
        """Tokens whose KV the handoff holds: everything before the newest generated token."""
        return len(self.prompt_ids) + len(self.output_ids) - 1


def _logprobs_json(lps: list[TokenLogprobs] | None):
    if lps is None:
        return None
    return [[lp.token_id, lp.logprob, [[int(k), float(v)] for k, v in lp.top.items()]] for lp in lps]


def encode_handoff(h: Handoff) -> bytes:
    """The wire form of ``h`` (sets ``h.nbytes``)."""
    arrays, chunks, offset = [], [], 0
    parts = [("slot", h.slot_state)] + ([("tail", h.tail)] if h.tail is not None else [])
    for prefix, group in parts:
        for name in sorted(group):
            a = np.ascontiguousarray(np.asarray(group[name]))
            arrays.append({"name": f"{prefix}/{name}", "dtype": str(a.dtype), "shape": list(a.shape),
                           "offset": offset, "nbytes": a.nbytes})
            chunks.append(a.tobytes())
            offset += a.nbytes
    header = {"version": h.version, "model": h.model, "block_size": h.block_size, "request_id": h.request_id,
              "prompt_ids": [int(t) for t in h.prompt_ids], "output_ids": [int(t) for t in h.output_ids],
              "logprobs": _logprobs_json(h.logprobs), "digests": list(h.digests), "written": bool(h.written),
              "source": h.source, "arrays": arrays}
    raw = json.dumps(header).encode()
    body = _MAGIC + len(raw).to_bytes(4, "little") + raw + b"".join(chunks)
    data = body + hashlib.sha256(body).digest()
    h.nbytes = len(data)
    return data


def _need(header: dict, name: str, kind, check=None):
    value = header.get(name)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is int:
        raise HandoffError(name, f"missing or not a {getattr(kind, '__name__', kind)}: {value!r}")
    if check is not None and not check(value):
        raise HandoffError(name, f"invalid value {value!r}")
    return value


def decode_handoff(data: bytes, model: str | None = None, block_size: int | None = None) -> Handoff:
    """Parse and verify a handoff; ``model`` / ``block_size``: what the receiving engine runs (checked).

    Raises ``HandoffError`` naming the field: ``magic`` (not a handoff, or truncated), ``checksum``,
    ``header``, ``version``, ``model``, ``block_size``, ``prompt_ids``, ``output_ids``, ``digests``,
    ``arrays``, ``tail``.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise HandoffError("magic", f"a handoff is bytes, got {type(data).__name__}")
    data = bytes(data)
    if len(data) < len(_MAGIC) + 4 + 32 or not data.startswith(_MAGIC):
        raise HandoffError("magic", "not a handoff (bad magic) or truncated")
    body, check = data[:-32], data[-32:]
    if hashlib.sha256(body).digest() != check:
        raise HandoffError("checksum", "sha256 mismatch: the handoff was corrupted or truncated")
    n = int.from_bytes(body[8:12], "little")
    try:
        header = json.loads(body[12 : 12 + n])
    except ValueError as e:
        raise HandoffError("header", f"not JSON: {e}") from None
    if not isinstance(header, dict):
        raise HandoffError("header", "not a JSON object")
    version = header.get("version")
    if version != HANDOFF_VERSION:
        raise HandoffError("version", f"handoff version {version!r}, this engine reads {HANDOFF_VERSION}")
    fp = _need(header, "model", str)
    if model is not None and fp != model:
        raise HandoffError("model", f"from model {fp[:16]}..., this engine runs {model[:16]}...")
    bs = _need(header, "block_size", int, lambda v: v > 0)
    if block_size is not None and bs != block_size:
        raise HandoffError("block_size", f"{bs}, this engine's blocks hold {block_size} tokens")
    prompt = _need(header, "prompt_ids", list, lambda v: v and all(isinstance(t, int) and t >= 0 for t in v))
    output = _need(header, "output_ids", list, lambda v: v and all(isinstance(t, int) and t >= 0 for t in v))
    digests = _need(header, "digests", list)
    length = len(prompt) + len(output) - 1
    if len(digests) != length // bs:
        raise HandoffError("digests", f"{len(digests)} complete blocks for {length} tokens of {bs}")
    base = 12 + n
    groups: dict[str, dict[str, np.ndarray]] = {"slot": {}, "tail": {}}
    for a in _need(header, "arrays", list):
        try:
            group, name = a["name"].split("/", 1)
            start, size = base + int(a["offset"]), int(a["nbytes"])
            if group not in groups or start + size > len(body) or size < 0:
                raise ValueError("out of bounds or unknown group")
            arr = np.frombuffer(body[start : start + size], dtype=_dtype(a["dtype"])).reshape(a["shape"])
        except (KeyError, ValueError, TypeError, AttributeError) as e:
            raise HandoffError("arrays", f"bad array entry {a!r}: {e}") from None
        groups[group][name] = arr
    has_tail = bool(groups["tail"])
    if has_tail != bool(length % bs):
        raise HandoffError("tail", f"{'a' if has_tail else 'no'} partial block for {length} tokens of {bs}")
    lps = header.get("logprobs")
    logprobs = None if lps is None else [TokenLogprobs(int(t), float(lp), {int(k): float(v) for k, v in top})
                                         for t, lp, top in lps]
    return Handoff(str(header.get("request_id")), prompt, output, bs, fp, [str(d) for d in digests], groups["slot"],
                   groups["tail"] if has_tail else None, logprobs, bool(header.get("written", True)),
                   str(header.get("source", "prefill")), version, len(data))
