"""Peak FLOP/s of the devices in use, for MFU = model FLOPs/s / peak FLOPs/s.

Accelerators: dense bf16 peak per chip from the vendors' data sheets (the table in `jaxtrain.analysis.chips`). CPU:
measured once with a short matmul benchmark over all devices at once (simulated devices share the same cores, so the
whole machine's rate is the peak, not a per-device figure) and cached in ~/.cache/jaxtrain.
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxtrain.analysis.chips import chip_for_device_kind

CACHE_DIR = Path(os.environ.get("JAXTRAIN_CACHE", Path.home() / ".cache" / "jaxtrain"))


def peak_flops(devices: Sequence[jax.Device], dtype: str = "bfloat16") -> tuple[float, str]:
    """(peak FLOP/s of all `devices` together, where the figure comes from).

    On CPU the peak is measured for the compute `dtype`: CPUs with AMX or AVX512-BF16 multiply bfloat16 several
    times faster than float32, so a float32 peak would overstate the MFU of a bfloat16 run.
    """
    kind = devices[0].device_kind
    if devices[0].platform == "cpu":
        given = os.environ.get("JAXTRAIN_CPU_PEAK_FLOPS")
        source = "JAXTRAIN_CPU_PEAK_FLOPS" if given else f"measured {dtype} matmul peak of this CPU (cached)"
        return cpu_peak_flops(devices, dtype), source
    spec = chip_for_device_kind(kind)
    if spec is None:
        raise ValueError(f"no peak FLOP/s known for device kind '{kind}'; add it to jaxtrain.analysis.chips.CHIPS.")
    return spec.peak_bf16 * len(devices), f"bf16 data-sheet peak of {kind} x {len(devices)}"


def cpu_peak_flops(devices: Sequence[jax.Device], dtype: str = "float32", size: int = 2048, repeats: int = 3) -> float:
    """Best matmul rate of the whole machine: one (size x size) matmul per device, all devices at once.

    Set JAXTRAIN_CPU_PEAK_FLOPS to skip the measurement (e.g. on a machine busy with other work).
    """
    if os.environ.get("JAXTRAIN_CPU_PEAK_FLOPS"):
        return float(os.environ["JAXTRAIN_CPU_PEAK_FLOPS"])
    cpu = platform.processor() or platform.machine()
    key = f"{cpu}-{os.cpu_count()}cpu-{len(devices)}dev-{dtype}-jax{jax.__version__}"
    cache = CACHE_DIR / "cpu_peak_flops.json"
    known = json.loads(cache.read_text()) if cache.is_file() else {}
    if key in known:
        return known[key]
    mesh = Mesh(list(devices), ("d",))
    sharding = NamedSharding(mesh, PartitionSpec("d"))
    a = jax.device_put(jnp.ones((len(devices), size, size), dtype), sharding)
    matmul = jax.jit(lambda x: jnp.einsum("bij,bjk->bik", x, x), out_shardings=sharding)
    matmul(a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(a).block_until_ready()
        best = min(best, time.perf_counter() - start)
    peak = 2.0 * size**3 * len(devices) / best
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps({**known, key: peak}, indent=1))
    return peak
