"""The draft vocabulary shipped next to a drafter (``draft_vocab.json``): frequency-ranked token ids.

Speculative decoding spends most of the drafter's time scoring the whole vocabulary with the target's
head. Frequency-ranked drafting (FR-Spec: Zhao et al., 2025, "FR-Spec: Accelerating Large-Vocabulary
Language Models via Frequency-Ranked Speculative Sampling") lets the drafter score only the most
frequent tokens; verification stays lossless because the draft distribution is simply zero elsewhere.

File format (JSON): ``{"token_ids": [...], "default_size": n, "source": "..."}`` with ``token_ids``
distinct and ranked most frequent first; an engine uses the first ``default_size`` (or its own
``draft_vocab_size``). Host only (numpy).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

__all__ = ["DRAFT_VOCAB_FILE", "load_draft_vocab", "ranked_vocab", "save_draft_vocab"]

DRAFT_VOCAB_FILE = "draft_vocab.json"


def ranked_vocab(stream: np.ndarray, vocab_size: int) -> np.ndarray:
    """Token ids that occur in ``stream``, most frequent first (ties: lower id first)."""
    counts = np.bincount(np.asarray(stream, np.int64).ravel(), minlength=vocab_size)[:vocab_size]
    order = np.argsort(-counts, kind="stable")
    return order[counts[order] > 0].astype(np.int32)


def save_draft_vocab(path: str | Path, token_ids, default_size: int, source: str) -> None:
    ids = [int(i) for i in token_ids]
    if len(set(ids)) != len(ids) or not 1 <= default_size <= len(ids):
        raise ValueError("token_ids must be distinct and default_size in [1, len(token_ids)]")
    Path(path).write_text(json.dumps({"token_ids": ids, "default_size": int(default_size), "source": source}))


def load_draft_vocab(checkpoint_dir: str | Path | None, vocab_size: int, size: int | None = None) -> np.ndarray | None:
    """The first ``size`` (None = the file's ``default_size``) ids of a checkpoint's draft vocabulary,
    or None when it ships none (and ``size`` is None). ``ValueError`` naming ``draft_vocab_size`` or the
    file for a size it cannot give or a malformed file."""
    path = None if checkpoint_dir is None else Path(checkpoint_dir) / DRAFT_VOCAB_FILE
    if path is None or not path.is_file():
        if size is not None:
            raise ValueError(f"draft_vocab_size={size} needs a {DRAFT_VOCAB_FILE} next to the checkpoint")
        return None
    try:
        data = json.loads(path.read_text())
        ids = np.asarray(data["token_ids"], np.int64)
        default = int(data["default_size"])
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a draft vocabulary ({e})") from None
    if ids.ndim != 1 or not len(ids) or ids.min() < 0 or ids.max() >= vocab_size or len(np.unique(ids)) != len(ids):
        raise ValueError(f"{path}: token_ids must be distinct ids in [0, {vocab_size})")
    n = default if size is None else size
    if not 1 <= n <= len(ids):
        raise ValueError(f"draft_vocab_size must lie in [1, {len(ids)}] (the ids in {path.name}), got {n}")
    return ids[:n].astype(np.int32)
