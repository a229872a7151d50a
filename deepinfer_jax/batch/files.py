"""The job's files: the input read as a stream, results appended one whole line at a time, part files, merging.

- Input: read line by line (never whole); blank lines are not records (they keep their number).
- Results: ``ResultWriter`` appends each finished record with one ``write`` on an ``O_APPEND``
  descriptor, so a killed process (even ``kill -9``) leaves only whole lines; a line torn by a
  crash of the machine itself (no final newline) is cut off when the file is opened again
  (``repair``). ``answered`` reads back which input lines a results file already answers.
- Sharded jobs: shard ``I`` of ``N`` writes ``<output>.part-0000I-of-0000N`` and, once its slice is
  done, a ``.done`` marker; ``merge`` joins the parts into ``<output>`` in input order (written to a
  temporary file and renamed, so readers never see half of it).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

from deepinfer_jax.batch.records import line_of

__all__ = ["BatchError", "ResultWriter", "answered", "done_marker", "input_lines", "merge", "part_path", "repair"]


class BatchError(ValueError):
    """A job that cannot run as asked (bad option, foreign results file); ``param`` names the culprit."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


def input_lines(path: str | os.PathLike, max_records: int | None = None) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, raw line) of every non-blank line, the first ``max_records`` of them if given."""
    seen = 0
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            if max_records is not None and seen >= max_records:
                return
            seen += 1
            yield number, raw


def repair(path: str | os.PathLike) -> int:
    """Cut a torn last line (no final newline) off a results file; returns the bytes dropped."""
    path = Path(path)
    if not path.is_file():
        return 0
    with open(path, "rb+") as f:
        size = f.seek(0, os.SEEK_END)
        if size == 0:
            return 0
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return 0
        keep, pos = 0, size  # scan back for the last newline, 64 KiB at a time
        while pos > 0:
            start = max(0, pos - 65536)
            f.seek(start)
            chunk = f.read(pos - start)
            i = chunk.rfind(b"\n")
            if i >= 0:
                keep = start + i + 1
                break
            pos = start
        f.truncate(keep)
        return size - keep


def answered(path: str | os.PathLike) -> dict[int, str | None]:
    """Input line number -> ``custom_id`` of every record a results file holds (empty if it does not exist)."""
    path = Path(path)
    done: dict[int, str | None] = {}
    if not path.is_file():
        return done
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                obj = json.loads(raw)
                done[line_of(obj)] = obj.get("custom_id")
            except ValueError as e:
                raise BatchError("--output", f"{path} line {number} is not a batch result ({e}); is it the output "
                                             "of another program?") from None
    return done


class ResultWriter:
    """Appends result lines to a file, each with one write (see the module docstring)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.dropped = repair(self.path)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, line: str) -> None:
        data = line.encode()
        while data:  # a regular file takes it whole; loop only for a short write (e.g. a full disk)
            data = data[os.write(self._fd, data):]

    def close(self) -> None:
        if self._fd is not None:
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> ResultWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def part_path(output: str | os.PathLike, index: int, count: int) -> Path:
    """Shard ``index``'s results file for ``count`` shards."""
    return Path(f"{output}.part-{index:05d}-of-{count:05d}")


def done_marker(output: str | os.PathLike, index: int, count: int) -> Path:
    """The file that says shard ``index`` answered every record of its slice."""
    return Path(f"{part_path(output, index, count)}.done")


def merge(output: str | os.PathLike, count: int) -> int:
    """Join the ``count`` part files of ``output`` into ``output`` in input order; returns the records.

    Reads the parts twice (an index of line -> offset first, so memory holds offsets, not results).
    A line answered by two parts is a ``BatchError``."""
    where: dict[int, tuple[int, int, int]] = {}  # input line -> (part, offset, length)
    parts = [part_path(output, i, count) for i in range(count)]
    for i, part in enumerate(parts):
        if not part.is_file():
            raise BatchError("--num-shards", f"{part} is missing: shard {i} of {count} has not run")
        repair(part)
        offset = 0
        with open(part, "rb") as f:
            for raw in f:
                try:
                    line = line_of(json.loads(raw))
                except ValueError as e:
                    raise BatchError("--output", f"{part} holds a line that is not a batch result ({e})") from None
                if line in where:
                    raise BatchError("--output", f"input line {line} is answered twice ({parts[where[line][0]]} "
                                                 f"and {part})")
                where[line] = (i, offset, len(raw))
                offset += len(raw)
    tmp = Path(f"{output}.merge-{os.getpid()}.tmp")
    handles = [open(p, "rb") for p in parts]
    try:
        with open(tmp, "wb") as out:
            for line in sorted(where):
                i, offset, length = where[line]
                handles[i].seek(offset)
                out.write(handles[i].read(length))
            out.flush()
            os.fsync(out.fileno())
    finally:
        for h in handles:
            h.close()
    os.replace(tmp, output)
    return len(where)
