"""The training corpus (host side, numpy + tokenizers): the Python standard library's own sources.

Every machine that runs this project has the interpreter's standard library on disk, so the text
is available offline and needs no download. The files are listed in sorted relative-path order
(test suites, codec tables, bundled third-party code and generated files left out), split by
file into training and held-out parts by a hash of the relative path, tokenized with the real
DeepSeek-V4 tokenizer, and concatenated into one token stream per part, each file followed by the
end-of-sentence token.

Training windows are ``[BOS] + stream[o : o + T]`` at offsets drawn from a generator seeded with
``(seed, step)``, so the batch of any step is a pure function of the seed and the step: a resumed
run sees exactly the batches an uninterrupted one would.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["Corpus", "batch_for_step", "eval_windows", "load_stdlib_corpus", "self_unigram_nll", "stdlib_files",
           "unigram_nll"]

#: Directory names skipped anywhere in a path: test suites and their data, codec tables, bundled
#: third-party or installed packages, demos and the generated pydoc topic dump.
SKIP_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "encodings",
                       "lib2to3", "turtledemo", "ensurepip", "pydoc_data"})


@dataclass(frozen=True)
class Corpus:
    """Token streams (int32) of the training and held-out files, and the file lists (relative paths)."""

    train: np.ndarray
    heldout: np.ndarray
    train_files: tuple[str, ...]
    heldout_files: tuple[str, ...]
    root: str

    def summary(self) -> dict:
        return {"root": self.root, "train_files": len(self.train_files), "heldout_files": len(self.heldout_files),
                "train_tokens": int(self.train.size), "heldout_tokens": int(self.heldout.size)}


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: str | Path | None = None) -> list[str]:
    """The corpus files: ``*.py`` under the standard library, relative POSIX paths in sorted order."""
    root = Path(root) if root is not None else stdlib_root()
    out = []
    for p in root.rglob("*.py"):
        rel = p.relative_to(root)
        if set(rel.parts[:-1]) & SKIP_DIRS or rel.name.startswith("_sysconfigdata"):
            continue
        if any(part.startswith("config-") for part in rel.parts[:-1]):
            continue
        out.append(rel.as_posix())
    return sorted(out)


def is_heldout(rel_path: str, every: int) -> bool:
    """One file in about ``every`` is held out, chosen by the SHA-256 of its relative path."""
    return int.from_bytes(hashlib.sha256(rel_path.encode()).digest()[:8], "little") % every == 0


def load_stdlib_corpus(tokenizer=None, heldout_every: int = 20, eos_id: int = 1,
                       root: str | Path | None = None) -> Corpus:
    """Tokenize the standard library (about 2.3M tokens on CPython 3.11; a few seconds)."""
    if tokenizer is None:
        from deepinfer_jax.tokenizer import load_tokenizer

        tokenizer = load_tokenizer()
    root = Path(root) if root is not None else stdlib_root()
    files = stdlib_files(root)
    if not files:
        raise FileNotFoundError(f"no Python sources found under {root}")
    texts = [(root / f).read_text(encoding="utf-8", errors="replace") for f in files]
    encodings = tokenizer.encode_batch(texts, add_special_tokens=False)
    parts: dict[bool, list[np.ndarray]] = {False: [], True: []}
    names: dict[bool, list[str]] = {False: [], True: []}
    for f, enc in zip(files, encodings):
        held = is_heldout(f, heldout_every)
        parts[held].append(np.asarray([*enc.ids, eos_id], np.int32))
        names[held].append(f)
    return Corpus(train=np.concatenate(parts[False]), heldout=np.concatenate(parts[True]),
                  train_files=tuple(names[False]), heldout_files=tuple(names[True]), root=str(root))


def batch_for_step(stream: np.ndarray, seed: int, step: int, batch: int, seq_len: int, bos_id: int) -> np.ndarray:
    """``[batch, seq_len + 1]`` int32 windows ``[BOS] + stream[o : o + seq_len]``, offsets from ``(seed, step)``.

    The model reads ``window[:, :-1]`` and predicts ``window[:, 1:]``.
    """
    if stream.size < seq_len + 1:
        raise ValueError(f"stream of {stream.size} tokens is shorter than seq_len + 1 = {seq_len + 1}")
    rng = np.random.default_rng([seed, step])
    offsets = rng.integers(0, stream.size - seq_len + 1, size=batch)
    windows = np.stack([stream[o:o + seq_len] for o in offsets])
    return np.concatenate([np.full((batch, 1), bos_id, np.int32), windows], axis=1).astype(np.int32)


def eval_windows(stream: np.ndarray, seq_len: int, bos_id: int, max_windows: int | None = None) -> np.ndarray:
    """Consecutive non-overlapping windows ``[BOS] + stream[i T : (i + 1) T]``: ``[N, seq_len + 1]`` int32."""
    n = stream.size // seq_len
    if max_windows is not None:
        n = min(n, max_windows)
    body = stream[: n * seq_len].reshape(n, seq_len)
    return np.concatenate([np.full((n, 1), bos_id, np.int32), body], axis=1).astype(np.int32)


def unigram_nll(train_stream: np.ndarray, targets: np.ndarray, vocab_size: int, alpha: float = 0.5) -> float:
    """Mean negative log-likelihood (nats) of ``targets`` under the add-``alpha`` smoothed unigram of
    ``train_stream``, over the full vocabulary."""
    counts = np.bincount(train_stream.astype(np.int64), minlength=vocab_size).astype(np.float64) + alpha
    logp = np.log(counts) - np.log(counts.sum())
    return float(-logp[np.asarray(targets, np.int64).ravel()].mean())


def self_unigram_nll(targets: np.ndarray) -> float:
    """Entropy (nats) of the targets' own unigram distribution: a lower bound for every unigram model."""
    _, counts = np.unique(np.asarray(targets).ravel(), return_counts=True)
    p = counts / counts.sum()
    return float(-(p * np.log(p)).sum())
