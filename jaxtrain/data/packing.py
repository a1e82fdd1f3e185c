"""How a split's token stream becomes rows of `seq_len + 1` tokens: Grain random-access sources, row k by index.

- `concat` (GPT-2's way): documents end with the end-of-text token and follow each other; row k is the window of
  tokens [k * T, k * T + T + 1), T = seq_len, so consecutive rows share one token and every token is a target once.
- `segments`: whole documents packed into rows, in their stored order, a row taking documents while they fit;
  a document longer than a row is cut into row-sized pieces. Each row carries `segment_ids` (1, 2, ... per piece, 0
  for padding): the model attends within a piece only, restarts positions at each, and counts no target across a
  join or on padding, so a document's loss does not depend on what shares its row.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

PACKINGS = ("concat", "segments")


class TokenStream(Protocol):
    documents: np.ndarray  # each document's first token in the stream
    document_ends: np.ndarray  # ... and its end (exclusive)

    def __len__(self) -> int: ...

    def read(self, start: int, stop: int) -> np.ndarray: ...


class ConcatWindows:
    """Row k: tokens [k * seq_len, (k + 1) * seq_len + 1) of the stream."""

    def __init__(self, stream: TokenStream, seq_len: int):
        self.stream, self.seq_len = stream, seq_len

    def __len__(self) -> int:
        return max(0, (len(self.stream) - 1) // self.seq_len)

    def __getitem__(self, k: int) -> dict[str, np.ndarray]:
        start = int(k) * self.seq_len
        return {"tokens": self.stream.read(start, start + self.seq_len + 1)}


def pack(documents: np.ndarray, document_ends: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pieces of at most `width` tokens (each document cut where longer) and greedy rows of them, in order: returns
    the pieces' starts and stops, and each row's first piece (rows + 1 entries)."""
    lengths = document_ends - documents
    counts = -(-lengths // width)  # pieces per document
    owner = np.repeat(np.arange(len(lengths)), counts)
    first_piece = np.concatenate([[0], np.cumsum(counts)])[:-1]
    starts = documents[owner] + (np.arange(len(owner)) - first_piece[owner]) * width
    stops = np.minimum(starts + width, document_ends[owner])
    row_starts, filled = [0], 0
    for piece, size in enumerate((stops - starts).tolist()):  # greedy: O(pieces), about 1 s per 3 million
        if filled + size > width:
            row_starts.append(piece)
            filled = 0
        filled += size
    return starts, stops, np.array([*row_starts, len(starts)])


class PackedRows:
    """Row k: the documents (or pieces) of packed row k, then padding; with their segment ids."""

    def __init__(self, stream: TokenStream, seq_len: int):
        self.stream, self.width = stream, seq_len + 1
        self.starts, self.stops, self.row_starts = pack(stream.documents, stream.document_ends, self.width)

    def __len__(self) -> int:
        return len(self.row_starts) - 1

    def __getitem__(self, k: int) -> dict[str, np.ndarray]:
        tokens, segments = np.zeros(self.width, np.int32), np.zeros(self.width, np.int32)
        at = 0
        for segment, piece in enumerate(range(self.row_starts[k], self.row_starts[k + 1]), 1):
            start, stop = int(self.starts[piece]), int(self.stops[piece])
            tokens[at : at + stop - start] = self.stream.read(start, stop)
            segments[at : at + stop - start] = segment
            at += stop - start
        return {"tokens": tokens, "segment_ids": segments}
