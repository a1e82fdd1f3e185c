"""Accelerator specs for planning and MFU: one table, one row per chip.

Figures are per chip, from the vendors' data sheets:
- TPU: cloud.google.com/tpu/docs/v4, /v5e, /v5p, /v6e ("System architecture" tables: peak bf16 compute, HBM
  capacity and bandwidth, inter-chip interconnect (ICI) bandwidth per chip). DCN bandwidth per chip is the host's
  network share: v4 and v5p hosts have 4 chips behind 200 Gbit/s; v5e and v6e hosts 8 chips behind 4x200 Gbit/s
  (cloud.google.com/tpu/docs/system-architecture-tpu-vm). These are approximate: they depend on the VM shape.
- NVIDIA: H100 SXM and H200 SXM data sheets (dense bf16 Tensor Core peak, i.e. without 2:4 sparsity; NVLink 4 at
  900 GB/s per GPU), A100 80GB SXM data sheet (NVLink 3 at 600 GB/s). Slow links are one 400 Gbit/s (NDR) or, for
  A100, 200 Gbit/s (HDR) InfiniBand adapter per GPU, as in DGX H100/H200 and DGX A100.

Bandwidths are bytes/s each chip can send (the ICI and NVLink figures are the vendors' totals over all links).
"""

from __future__ import annotations

import dataclasses

from jaxtrain.errors import UserInputError

GB = 1e9
GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Chip:
    """One accelerator: dense bf16 FLOP/s, HBM bytes and bytes/s, and the bytes/s it sends over its fast links
    (`ici_bw`: ICI, NVLink: axes inside a slice or host) and its slow links (`dcn_bw`: DCN, InfiniBand: `dcn_axes`)."""

    name: str
    device_kinds: tuple[str, ...]  # substrings of jax.Device.device_kind that name this chip
    peak_bf16: float
    hbm_bytes: float
    hbm_bw: float
    ici_bw: float
    dcn_bw: float


CHIPS: dict[str, Chip] = {
    c.name: c
    for c in (
        Chip("v4", ("TPU v4",), 275e12, 32 * GIB, 1228 * GB, 300 * GB, 6.25 * GB),
        Chip("v5e", ("TPU v5 lite", "TPU v5e"), 197e12, 16 * GIB, 819 * GB, 200 * GB, 12.5 * GB),
        Chip("v5p", ("TPU v5p", "TPU v5"), 459e12, 95 * GIB, 2765 * GB, 600 * GB, 6.25 * GB),
        Chip("v6e", ("TPU v6 lite", "TPU v6e"), 918e12, 32 * GIB, 1640 * GB, 448 * GB, 12.5 * GB),
        Chip("h100", ("H100",), 989e12, 80 * GIB, 3350 * GB, 900 * GB, 50 * GB),
        Chip("h200", ("H200",), 989e12, 140 * GIB, 4800 * GB, 900 * GB, 50 * GB),
        Chip("a100", ("A100",), 312e12, 80 * GIB, 2039 * GB, 600 * GB, 25 * GB),
    )
}


class ChipError(UserInputError):
    """A chip name that is not in the table."""


def chip(name: str) -> Chip:
    """The chip called `name` (case-insensitive: v5p, H100, ...)."""
    key = name.lower().removeprefix("tpu-").removeprefix("tpu")
    if key not in CHIPS:
        raise ChipError(f"unknown chip '{name}'. Known chips: {', '.join(CHIPS)}.")
    return CHIPS[key]


def chip_for_device_kind(device_kind: str) -> Chip | None:
    """The chip whose `device_kinds` occur in a `jax.Device.device_kind`, the more specific names first (so
    'TPU v5 lite' is a v5e, not a v5p); None for kinds not in the table (e.g. CPU)."""
    matches = [(len(k), c) for c in CHIPS.values() for k in c.device_kinds if k.lower() in device_kind.lower()]
    return max(matches, key=lambda m: m[0])[1] if matches else None
