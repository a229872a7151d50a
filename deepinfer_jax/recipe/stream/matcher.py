"""The incremental label matcher: KMP automata over a character stream, never rescanning.

A *stage* of the output grammar is a list of match branches (a label pattern, the stage it leads
to and the action its text gets) plus one action for text that matches nothing. The
:class:`Machine` feeds characters to every branch of the current stage; the first branch to
complete wins, the text before it gets the stage's unmatched action, and the next stage starts
from fresh branch states. At the end of a feed, the longest live partial match stays in the stash;
everything before it is resolved. Three pattern kinds (recipe.md §11):

* ``STRING``: a plain label (a KMP automaton);
* ``NEWLINES_STRING``: a label preceded by any run of ``\\n``, which the match swallows; the run
  is forgotten whenever the label match falls back (the official parser's exact rule, so
  ``"\\n\\n<\\n</think>"`` keeps the last newline);
* ``LEADING_NEWLINE``: one ``\\n`` as the very first character of the stage.

Characters that can move an idle automaton (label first characters, ``\\n`` before a
``NEWLINES_STRING``) form a regex class; while every branch is idle the machine jumps to the next
such character with one ``re`` search, so plain text costs no Python-level loop.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Hashable
from dataclasses import dataclass

STRING, NEWLINES_STRING, LEADING_NEWLINE = 0, 1, 2

Action = tuple  # (kind, payload...): compared by equality when adjacent pieces merge


def kmp_table(pattern: str) -> tuple[int, ...]:
    """Failure function: for each prefix, the length of its longest proper border."""
    table = [0] * len(pattern)
    k = 0
    for i in range(1, len(pattern)):
        while k and pattern[i] != pattern[k]:
            k = table[k - 1]
        if pattern[i] == pattern[k]:
            k += 1
        table[i] = k
    return tuple(table)


@dataclass(frozen=True)
class Branch:
    """One way out of a stage."""

    kind: int
    pattern: str
    next_stage: Hashable
    action: Action
    bpe_only: bool = False  # never matches in, nor across, an added token's text (stop sequences)

    @property
    def table(self) -> tuple[int, ...]:
        return kmp_table(self.pattern)


class StageSpec:
    """A compiled stage: its branches, their KMP tables and the trigger-character regex."""

    __slots__ = ("branches", "key", "kinds", "kinds_special", "leading", "patterns", "plens", "tables", "trigger",
                 "unmatched")

    def __init__(self, key: Hashable, branches: list[Branch], unmatched: Action) -> None:
        self.key = key
        self.branches = branches
        self.unmatched = unmatched
        self.kinds = [b.kind for b in branches]
        self.kinds_special = [-1 if b.bpe_only else b.kind for b in branches]  # while feeding added-token text
        self.patterns = [b.pattern for b in branches]
        self.tables = [b.table for b in branches]
        self.plens = [len(b.pattern) for b in branches]
        self.leading = any(b.kind == LEADING_NEWLINE for b in branches)
        first = {b.pattern[0] for b in branches if b.kind != LEADING_NEWLINE and b.pattern}
        if any(b.kind == NEWLINES_STRING for b in branches):
            first.add("\n")
        self.trigger = re.compile("[" + "".join(re.escape(c) for c in sorted(first)) + "]") if first else None


Segment = tuple[Action, str]


class Machine:
    """Runs the stages of a grammar over pushed text; see the module docstring.

    ``stage_of(key)`` returns the compiled :class:`StageSpec` of a stage key. ``feed`` returns the
    resolved segments ``(action, text)`` in order; ``finish`` flushes the stash with the current
    stage's unmatched action.
    """

    __slots__ = ("lead_pending", "lens", "nls", "spec", "stage_of", "stash")

    def __init__(self, stage_of: Callable[[Hashable], StageSpec], initial: Hashable) -> None:
        self.stage_of = stage_of
        self.stash = ""
        self._enter(stage_of(initial))

    def _enter(self, spec: StageSpec) -> None:
        self.spec = spec
        self.lens = [0] * len(spec.kinds)
        self.nls = [0] * len(spec.kinds)
        self.lead_pending = spec.leading

    @property
    def stage(self) -> Hashable:
        return self.spec.key

    def feed(self, text: str, special: bool = False) -> list[Segment]:
        """Advance over ``text``; return the segments resolved by it. ``special``: the text is an
        added token's, which ``bpe_only`` branches skip (their partial matches are dropped)."""
        if special:
            for b, kind in enumerate(self.spec.kinds_special):
                if kind < 0:
                    self.lens[b] = self.nls[b] = 0
        if not self.stash and not self.lead_pending:  # idle automata and no trigger: all of it is plain
            trig = self.spec.trigger
            if trig is None or trig.search(text) is None:
                return [(self.spec.unmatched, text)] if text else []
        out: list[Segment] = []
        buf = self.stash + text if self.stash else text
        n = len(buf)
        start = 0  # first unresolved character of buf
        i = len(self.stash)
        spec = self.spec
        lens, nls = self.lens, self.nls
        busy = bool(self.stash)  # a live partial match always leaves its characters in the stash
        while i < n:
            if not busy and not self.lead_pending:
                trig = spec.trigger
                if trig is None:
                    break
                m = trig.search(buf, i)
                if m is None:
                    break
                i = m.start()
            c = buf[i]
            matched = -1
            mlen = 0
            kinds = spec.kinds_special if special else spec.kinds
            patterns, tables, plens = spec.patterns, spec.tables, spec.plens
            for b in range(len(kinds)):
                kind = kinds[b]
                if kind == STRING:
                    pat = patterns[b]
                    k = lens[b]
                    while k and pat[k] != c:
                        k = tables[b][k - 1]
                    if pat[k] == c:
                        k += 1
                    if k == plens[b]:
                        matched, mlen = b, k
                        break
                    lens[b] = k
                elif kind == NEWLINES_STRING:
                    k = lens[b]
                    if k == 0 and c == "\n":
                        nls[b] += 1
                    else:
                        pat = patterns[b]
                        j = k
                        while j and pat[j] != c:
                            j = tables[b][j - 1]
                        if pat[j] == c:
                            j += 1
                        if j <= k:
                            nls[b] = 0
                        if j == plens[b]:
                            matched, mlen = b, j + nls[b]
                            break
                        lens[b] = j
                elif kind == LEADING_NEWLINE and self.lead_pending:
                    self.lead_pending = False
                    if c == "\n":
                        matched, mlen = b, 1
                        break
            self.lead_pending = False
            i += 1
            if matched >= 0:
                branch = spec.branches[matched]
                cut = i - mlen
                if cut > start:
                    out.append((spec.unmatched, buf[start:cut]))
                out.append((branch.action, buf[cut:i]))
                start = i
                self._enter(self.stage_of(branch.next_stage))
                spec = self.spec
                lens, nls = self.lens, self.nls
                busy = False
            else:
                busy = any(lens) or any(nls)
        keep = 0
        for b in range(len(lens)):
            k = lens[b] + nls[b]
            keep = max(keep, k)
        cut = n - keep
        if cut > start:
            out.append((spec.unmatched, buf[start:cut]))
            start = cut
        self.stash = buf[start:]
        return out

    def finish(self) -> list[Segment]:
        """Flush the stash with the stage's unmatched action (end of stream)."""
        out = [(self.spec.unmatched, self.stash)] if self.stash else []
        self.stash = ""
        return out
