"""How many bytes an array takes in a chip's memory: XLA:TPU stores arrays in tiles, padding the two minor dims of
the layout it picks, where GPUs and CPUs store exactly the elements.

TPU tiles (seen in the TPU compiler's layouts, e.g. `f32[12,96,3,12,64]{1,4,3,2,0:T(8,128)}`): the minor dim is
padded to a multiple of 128 and the second-minor to 8 rows of 32-bit words (16 for 16-bit types, which pack two to
a word; fewer rows where the dim itself is smaller: `T(2,128)`); a vector to 128 elements, or 1024 past 128. The
compiler picks the dims to make minor; taking the pick that pads least reproduces its argument sizes (a gpt-small
shard's `(..., 96)` weights: 96 -> 128 columns, 5% of the state).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

_LANES = 128
_WORD_ROWS = 8  # rows of a tile in 32-bit words


def held_bytes(shape: Sequence[float], itemsize: int, tiled: bool) -> float:
    """Bytes of an array of `shape` (per-device sizes) and `itemsize` in memory; `tiled`: as XLA:TPU stores it."""
    if not tiled:
        return math.prod(shape) * itemsize
    dims = [math.ceil(n) for n in shape]
    if len(dims) <= 1:
        n = dims[0] if dims else 1
        return _round_up(n, _LANES if n <= _LANES else 8 * _LANES) * itemsize
    rows = _WORD_ROWS * max(1, 4 // itemsize)
    best = math.inf
    for minor, second in itertools.permutations(range(len(dims)), 2):
        others = math.prod(n for i, n in enumerate(dims) if i not in (minor, second))
        tile_rows = min(rows, 1 << max(dims[second] - 1, 0).bit_length())
        padded = _round_up(dims[minor], _LANES) * _round_up(dims[second], tile_rows)
        best = min(best, others * padded)
    return best * itemsize


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
