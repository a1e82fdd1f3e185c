"""How a split's token stream becomes rows of `seq_len + 1` tokens: Grain random-access sources, row k by index.

- `concat` (GPT-2's way): documents end with the end-of-text token and follow each other; row k is the window of
  tokens [k * T, k * T + T + 1), T = seq_len, so consecutive rows share one token and every token is a target once.
- `segments`: whole documents packed into rows, in their stored order, a row taking documents while they fit;
  a document longer than a row is cut into row-sized pieces. Each row carries `segment_ids` (1, 2, ... per piece, 0
  for padding): the model attends within a piece only, restarts positions at each, and counts no target across a
  join or on padding, so a document's loss does not depend on what shares its row.

With `loss_weights` (chat data), a row also carries each of its tokens' loss weight as a target, `loss_weights`
(float32, laid out as `tokens`; 0 on padding), read from the same positions of the stream as its tokens.
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

    def read_weights(self, start: int, stop: int) -> np.ndarray: ...


class ConcatWindows:
    """Row k: tokens [k * seq_len, (k + 1) * seq_len + 1) of the stream (and their loss weights, with
    `loss_weights`)."""

    def __init__(self, stream: TokenStream, seq_len: int, loss_weights: bool = False):
        self.stream, self.seq_len, self.loss_weights = stream, seq_len, loss_weights

    def __len__(self) -> int:
        return max(0, (len(self.stream) - 1) // self.seq_len)

    def __getitem__(self, k: int) -> dict[str, np.ndarray]:
        start = int(k) * self.seq_len
        stop = start + self.seq_len + 1
        row = {"tokens": self.stream.read(start, stop)}
        return {**row, "loss_weights": self.stream.read_weights(start, stop)} if self.loss_weights else row


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
    """Row k: the documents (or pieces) of packed row k, then padding; with their segment ids (and loss weights,
    with `loss_weights`)."""

    def __init__(self, stream: TokenStream, seq_len: int, loss_weights: bool = False):
        self.stream, self.width, self.loss_weights = stream, seq_len + 1, loss_weights
        self.starts, self.stops, self.row_starts = pack(stream.documents, stream.document_ends, self.width)

    def __len__(self) -> int:
        return len(self.row_starts) - 1

    def __getitem__(self, k: int) -> dict[str, np.ndarray]:
        tokens, segments = np.zeros(self.width, np.int32), np.zeros(self.width, np.int32)
        weights = np.zeros(self.width, np.float32)
        at = 0
        for segment, piece in enumerate(range(self.row_starts[k], self.row_starts[k + 1]), 1):
            start, stop = int(self.starts[piece]), int(self.stops[piece])
            tokens[at : at + stop - start] = self.stream.read(start, stop)
            segments[at : at + stop - start] = segment
            if self.loss_weights:
                weights[at : at + stop - start] = self.stream.read_weights(start, stop)
            at += stop - start
        row = {"tokens": tokens, "segment_ids": segments}
        return {**row, "loss_weights": weights} if self.loss_weights else row
