"""The planner's estimate beside the TPU or GPU compiler's own figures, one JSON line per model x layout pair: the
step compiled for compile-only devices of the target (`jaxtrain.aot.targets`), estimated for the same chip.

    python benchmarks/planner_vs_compiler.py v5p:2x2x2/gpt-small/fsdp=8/batch_size=32,seq_len=1024
    python benchmarks/planner_vs_compiler.py h100:8/moe-small/data=2,expert=4/batch_size=32,seq_len=1024 ...

A pair is `target/model/mesh[/override,override,...]`. Each line: arguments and peak bytes per device and bytes each
device sends per set of mesh axes, estimate, compiled and their ratio, and the compile's seconds. Needs the
tpu-aot or gpu-aot extra for the target. For a pipeline mesh the compiled count takes every branch of the tick loop
to run at every tick (see `jaxtrain.planner.stages`), so its collectives off the pipeline axis are an upper bound.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile-only devices live beside the CPU backend

from jaxtrain.aot.targets import compile_target  # noqa: E402
from jaxtrain.planner import comm_by_axes, estimate, measure  # noqa: E402
from jaxtrain.run_config import apply_overrides, default_config  # noqa: E402


def compare(pair: str) -> dict:
    """One pair's figures (see the module docstring)."""
    target_name, model, mesh, *rest = pair.split("/")
    target = _target(target_name)
    overrides = [o for o in (rest[0].split(",") if rest else []) if o]
    cfg = apply_overrides(default_config(model), [*overrides, f"mesh={mesh}", "data.source=synthetic"])
    est = estimate(cfg, target.chip, len(target.devices))
    start = time.perf_counter()
    got = measure(cfg, target.devices)
    seconds = time.perf_counter() - start
    expected = comm_by_axes(est.transfers)
    comm = {
        " ".join(axes) or "-": _row(expected.get(axes, 0.0), got.comm.get(axes, 0.0))
        for axes in sorted(set(expected) | set(got.comm), key=lambda a: -got.comm.get(a, 0.0))
    }
    return {
        "pair": pair,
        "compile_s": round(seconds, 1),
        "arguments": _row(est.memory.arguments, got.arguments),
        "peak": _row(est.memory.peak, got.peak),
        "comm": comm,
    }


@functools.cache
def _target(name: str):
    return compile_target(name)


def _row(estimated: float, compiled: float) -> dict:
    ratio = round(estimated / compiled, 3) if compiled else None
    return {"estimate": round(estimated), "compiled": round(compiled), "ratio": ratio}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("pairs", nargs="+", help="target/model/mesh[/override,...]")
    for pair in parser.parse_args().pairs:
        print(json.dumps(compare(pair)), flush=True)


if __name__ == "__main__":
    sys.exit(main())
