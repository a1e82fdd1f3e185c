"""JSON-lines files read in byte ranges: the lines of a range (how `jaxtrain tokenize` cuts a big file into chunks
for its workers), and the number of the line an error is on."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

READ_BLOCK = 2**22  # bytes read at a time to count lines


def lines(path: Path, start: int, stop: int) -> Iterator[tuple[int, bytes]]:
    """Each non-blank line that starts in bytes [start, stop) of `path`, with the byte offset it starts at. A line
    that began before `start` belongs to the range before, so consecutive ranges read every line once."""
    with path.open("rb") as f:
        if start:
            f.seek(start - 1)
            f.readline()
        while f.tell() < stop and (line := f.readline()):
            if line.strip():
                yield f.tell() - len(line), line


def line_number(path: Path, offset: int) -> int:
    """The line (from 1) of `path` that byte `offset` is on. Counted for an error message only: a range starts
    mid-file, and counting every good file's lines would cost a pass over it."""
    number = 1
    with path.open("rb") as f:
        while offset > 0 and (block := f.read(min(offset, READ_BLOCK))):
            number += block.count(b"\n")
            offset -= len(block)
    return number
