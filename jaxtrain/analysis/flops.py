"""Peak FLOP/s of the devices in use, for MFU = model FLOPs/s / peak FLOPs/s.

Accelerators: dense bf16 peak per chip from the vendors' data sheets (the table in `jaxtrain.analysis.chips`).

CPU: measured, as a plain jitted matmul reaches it. Simulated CPU devices share the machine's cores, so the peak is
the machine's, whatever the number of devices: a 2-D matmul on one device, which XLA runs on every core, at a few
sizes (the best size differs between CPUs and dtypes), each warmed up, then timed several times. Two signs say the
machine was busy: repeats that differ by more than `STEADY_SPREAD`, and a share of the cores below `QUIET_SHARE` (the
process's CPU seconds over the wall seconds times the cores: a matmul that had the machine keeps every core busy,
while steady work elsewhere slows every repeat alike and leaves the spread small). A busy measurement is retried and,
if it stays busy, used for this run but not cached. A quiet one is cached in ~/.cache/jaxtrain with its spread,
share, size and date. A run that computes faster than the peak proves it too low: `peak_too_low` drops it from the
cache. Set JAXTRAIN_CPU_PEAK_FLOPS to give the figure instead.

>>> measurement = measure_cpu_peak("float32")                                           # doctest: +SKIP
>>> measurement.flops / 1e9, measurement.size, measurement.spread                      # doctest: +SKIP
(209.3, 2048, 0.018)
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import time
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxtrain.analysis.chips import chip_for_device_kind

CACHE_DIR = Path(os.environ.get("JAXTRAIN_CACHE", Path.home() / ".cache" / "jaxtrain"))
CACHE_FILE = "cpu_matmul_peak.json"
SIZES = (1024, 2048, 4096)
REPEATS = 5
STEADY_SPREAD = 0.10  # (median - best) / best of a size's repeats: above it, other work took the cores
QUIET_SHARE = 0.75  # of the cores the matmul kept busy: below, other work held some (0.43-0.61 seen under load)
ATTEMPTS = 3
_UNSTEADY: dict[str, CpuPeak] = {}


@dataclasses.dataclass(frozen=True)
class CpuPeak:
    """A measured CPU matmul peak: `flops` per second at its best `size`, with the `spread` of that size's repeats
    ((median - best) / best) and the share of the cores they kept busy; `steady` when both say the machine was
    quiet."""

    flops: float
    dtype: str
    size: int
    spread: float
    measured: str  # ISO date
    cpu_share: float = 1.0  # entries cached before the share was measured have none

    @property
    def steady(self) -> bool:
        return self.spread <= STEADY_SPREAD and self.cpu_share >= QUIET_SHARE

    def describe(self) -> str:
        how = f"{self.dtype} {self.size}x{self.size} matmul, best of {REPEATS}, spread {self.spread:.0%}, "
        how += f"{self.cpu_share:.0%} of the cores"
        return f"measured peak of this CPU ({how}, {self.measured})"


def peak_flops(devices: Sequence[jax.Device], dtype: str = "bfloat16") -> tuple[float, str]:
    """(peak FLOP/s of all `devices` together, where the figure comes from).

    On CPU the peak is measured for the compute `dtype`: CPUs with AMX or AVX512-BF16 multiply bfloat16 several
    times faster than float32, so a float32 peak would overstate the MFU of a bfloat16 run.
    """
    kind = devices[0].device_kind
    if devices[0].platform == "cpu":
        if os.environ.get("JAXTRAIN_CPU_PEAK_FLOPS"):
            return float(os.environ["JAXTRAIN_CPU_PEAK_FLOPS"]), "JAXTRAIN_CPU_PEAK_FLOPS"
        peak, cached = cpu_peak(dtype)
        note = "cached" if cached else ("not cached: the machine was busy" if not peak.steady else "now")
        return peak.flops, f"{peak.describe()}, {note}"
    spec = chip_for_device_kind(kind)
    if spec is None:
        raise ValueError(f"no peak FLOP/s known for device kind '{kind}'; add it to jaxtrain.analysis.chips.CHIPS.")
    return spec.peak_bf16 * len(devices), f"bf16 data-sheet peak of {kind} x {len(devices)}"


def cpu_peak(dtype: str = "float32") -> tuple[CpuPeak, bool]:
    """This CPU's matmul peak for `dtype` and whether it came from the cache: a steady measurement is cached; an
    unsteady one (still so after `ATTEMPTS` tries) is returned for this run only, so a busy moment is not kept."""
    key, cache = _cache_key(dtype), CACHE_DIR / CACHE_FILE
    known = json.loads(cache.read_text()) if cache.is_file() else {}
    if key in known:
        return CpuPeak(**known[key]), True
    if key in _UNSTEADY:  # measured busy earlier in this process: not measured again for every run
        return _UNSTEADY[key], False
    best = None
    for attempt in range(ATTEMPTS):
        if attempt:
            time.sleep(2.0)  # let whatever took the cores finish
        peak = measure_cpu_peak(dtype)
        best = peak if best is None or peak.flops > best.flops else best  # other work only slows a matmul
        if peak.steady:
            _write_cache({**known, key: dataclasses.asdict(peak)})
            return peak, False
    _UNSTEADY[key] = best
    return best, False


def peak_too_low(devices: Sequence[jax.Device], dtype: str, observed: float) -> str:
    """A run on `devices` computed `observed` model FLOP/s, above what `peak_flops(devices, dtype)` gave: say why that
    peak is too low, for the log. A measured CPU peak is forgotten (cache and this process), so the next run measures
    again: a busy machine can only slow a matmul down, so a low figure is a measurement spoiled by other work."""
    if devices[0].platform != "cpu":
        return (
            "the data-sheet peak cannot be exceeded, so the model FLOPs per step are overcounted: check the model "
            "config's train_flops"
        )
    if os.environ.get("JAXTRAIN_CPU_PEAK_FLOPS"):
        return f"JAXTRAIN_CPU_PEAK_FLOPS={os.environ['JAXTRAIN_CPU_PEAK_FLOPS']} is below what this CPU does: raise it"
    forget_cpu_peak(dtype)
    return (
        "the CPU peak was measured while other work held the cores; it is dropped from the cache and measured again "
        f"by the next run (or set JAXTRAIN_CPU_PEAK_FLOPS above {observed:.3g})"
    )


def forget_cpu_peak(dtype: str) -> None:
    """Drop this CPU's measured `dtype` peak from the cache and from this process: the next `cpu_peak` measures."""
    key, cache = _cache_key(dtype), CACHE_DIR / CACHE_FILE
    _UNSTEADY.pop(key, None)
    known = json.loads(cache.read_text()) if cache.is_file() else {}
    if known.pop(key, None) is not None:
        _write_cache(known)


def _cache_key(dtype: str) -> str:
    return f"{platform.processor() or platform.machine()}-{os.cpu_count()}cpu-{dtype}-jax{jax.__version__}"


def _write_cache(known: dict) -> None:
    """Replace the cache file whole (a temporary file renamed over it): a run killed mid-write, or another run
    reading it, never sees half a file."""
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    partial = CACHE_DIR / f".{CACHE_FILE}.{os.getpid()}"
    partial.write_text(json.dumps(known, indent=1))
    os.replace(partial, CACHE_DIR / CACHE_FILE)


def measure_cpu_peak(dtype: str = "float32", sizes: Sequence[int] = SIZES, repeats: int = REPEATS) -> CpuPeak:
    """The best rate of a plain jitted (n x n) @ (n x n) matmul in `dtype` over `sizes`, on the first CPU device."""
    device = jax.devices("cpu")[0]
    matmul = jax.jit(lambda a, b: a @ b)
    found = None
    for size in sizes:
        a = jax.device_put(jnp.asarray(np.random.default_rng(0).standard_normal((size, size)), dtype), device)
        times, cpu_share = matmul_times(matmul, a, repeats)
        best = min(times)
        measured = CpuPeak(
            flops=2.0 * size**3 / best,
            dtype=dtype,
            size=size,
            spread=float(np.median(times)) / best - 1.0,
            measured=datetime.date.today().isoformat(),
            cpu_share=cpu_share,
        )
        if found is None or measured.flops > found.flops:
            found = measured
    return found


def matmul_times(matmul, a: jax.Array, repeats: int) -> tuple[list[float], float]:
    """Seconds of each of `repeats` calls of `matmul(a, a)`, after two warm-up calls (compile, then first touch), and
    the share of this machine's cores the process kept busy over them."""
    for _ in range(2):
        matmul(a, a).block_until_ready()
    times, cpu = [], time.process_time()
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(a, a).block_until_ready()
        times.append(time.perf_counter() - start)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return times, (time.process_time() - cpu) / sum(times) / cores
