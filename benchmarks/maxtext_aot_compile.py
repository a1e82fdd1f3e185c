"""Compile MaxText's train step for a compile-only target and save what `benchmarks/maxtext_aot.py` analyses.

Runs INSIDE MaxText's own venv (benchmarks/maxtext_baseline.sh makes it; MaxText 0.2.5, jax 0.12.0.1), never in
jaxtrain's: it imports nothing of jaxtrain. It runs MaxText's own AOT entry point,
`maxtext.trainers.pre_train.train_compile.main`, unchanged, with `jit_and_compile` wrapped so the compiled object
is kept, and writes into OUT_DIR:

    train_step.hlo.txt   compiled.as_text(): the optimized per-device program of MaxText's train step
    maxtext.json         memory_analysis() and cost_analysis() figures, the compile's seconds, the mesh (axis
                         names, sizes, device ids in mesh order), the program's device assignment, versions, and
                         the sharding of each state leaf (for comparing placements)

    /tmp/maxtext_venv/bin/python benchmarks/maxtext_aot_compile.py OUT_DIR [--gpu-spec FILE --gpu-devices N] \
        [MaxText key=value ...]

TPU targets are MaxText's own (compile_topology=v5p-128 and so on). MaxText makes GPU targets from `jax.devices()`,
which needs a GPU; with --gpu-spec (an XLA GPU target spec, as jaxtrain/aot/gpu_targets/*.txtpb) the mesh is built
instead on compile-only devices of the CUDA plugin (which must be installed in this venv), by MaxText's own
`create_device_mesh`, as jaxtrain does for `h100:8`.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import sys
import time
from pathlib import Path


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--gpu-spec", type=Path, help="XLA GPU target spec (.txtpb) for compile-only GPU devices")
    parser.add_argument("--gpu-devices", type=int, default=8, help="with --gpu-spec: GPUs in the (one) host")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_intermixed_args()  # the overrides come after --gpu-spec
    args.out_dir.mkdir(parents=True, exist_ok=True)

    # As jaxtrain.aot.targets does: libtpu looks for a TPU VM and takes a lock file otherwise.
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    import jax

    jax.config.update("jax_platforms", "cpu")  # compile-only devices live beside the CPU backend

    import maxtext
    from jax.sharding import AxisType, Mesh
    from maxtext.trainers.pre_train import train_compile
    from maxtext.utils import maxtext_utils

    kept: dict = {}
    jit_and_compile = train_compile.jit_and_compile

    def keep(func, args_, kwargs_, mesh, in_shardings, *rest, **kw):
        start = time.perf_counter()
        compiled = jit_and_compile(func, args_, kwargs_, mesh, in_shardings, *rest, **kw)
        kept.update(compiled=compiled, seconds=time.perf_counter() - start, mesh=mesh, state=args_[0])
        kept["in_shardings"] = in_shardings
        return compiled

    train_compile.jit_and_compile = keep

    if args.gpu_spec is not None:
        from jax.experimental import topologies

        devices = topologies.get_topology_desc(
            platform="cuda", target_config=args.gpu_spec.read_text(), topology=f"1x1x{args.gpu_devices}"
        ).devices

        def gpu_mesh(config):
            jax.config.update("jax_remove_size_one_mesh_axis_from_type", config.remove_size_one_mesh_axis_from_type)
            array = maxtext_utils.create_device_mesh(config, devices)
            kind = AxisType.Explicit if config.shard_mode == "explicit" else AxisType.Auto
            return Mesh(array, config.mesh_axes, axis_types=(kind,) * len(config.mesh_axes))

        train_compile.get_topology_mesh = gpu_mesh

    base_yml = Path(maxtext.__file__).parent / "configs" / "base.yml"
    train_compile.main(["train_compile", str(base_yml), *args.overrides])
    if "compiled" not in kept:
        print("MaxText's train_compile finished without compiling a train step", file=sys.stderr)
        return 1

    compiled, mesh = kept["compiled"], kept["mesh"]
    (args.out_dir / "train_step.hlo.txt").write_text(compiled.as_text())
    m = compiled.memory_analysis()
    memory = {
        key: int(getattr(m, f"{key}_size_in_bytes"))
        for key in ("argument", "output", "alias", "temp", "generated_code", "host_argument", "host_temp")
        if hasattr(m, f"{key}_size_in_bytes")
    }
    memory["peak"] = int(getattr(m, "peak_memory_in_bytes", 0) or 0)
    cost = compiled.cost_analysis() or {}
    cost = cost[0] if isinstance(cost, list) else cost
    shardings = jax.tree.leaves((compiled.input_shardings, compiled.output_shardings))
    assignment = max((tuple(s._device_assignment) for s in shardings), key=len, default=())
    leaves = jax.tree_util.tree_leaves_with_path(kept["state"])
    state = [
        {
            "path": jax.tree_util.keystr(path),
            "shape": list(leaf.shape),
            "dtype": str(leaf.dtype),
            "spec": str(getattr(leaf.sharding, "spec", "")),
        }
        for path, leaf in leaves
        if hasattr(leaf, "shape")
    ]
    target = None
    topology = next((o.split("=", 1)[1] for o in args.overrides if o.startswith("compile_topology=")), None)
    if topology and args.gpu_spec is None:
        from maxtext.utils import accelerator_to_spec_map

        spec = accelerator_to_spec_map.get_system_characteristics(topology)
        target = {"topology": spec.topology_name, "wrap": list(spec.wrap) if spec.wrap else None}
    record = {
        "overrides": args.overrides,
        "target": target,
        "gpu_spec": str(args.gpu_spec) if args.gpu_spec else None,
        "compile_s": round(kept["seconds"], 1),
        "written": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "versions": {p: _version(p) for p in ("maxtext", "jax", "jaxlib", "libtpu", "jax-cuda12-plugin", "flax")},
        "memory": memory,
        "cost_analysis": {k: float(v) for k, v in cost.items() if k in ("flops", "bytes accessed", "transcendentals")},
        "mesh": {
            "axes": list(mesh.axis_names),
            "shape": [int(n) for n in mesh.devices.shape],
            "device_ids": [int(d.id) for d in mesh.devices.flat],
            "coords": [list(getattr(d, "coords", ())) for d in mesh.devices.flat],
        },
        "program_device_ids": [int(d.id) for d in assignment],
        "device_kind": mesh.devices.flat[0].device_kind,
        "state": state,
    }
    (args.out_dir / "maxtext.json").write_text(json.dumps(record, indent=1))
    print(f"wrote {args.out_dir}/train_step.hlo.txt and maxtext.json ({kept['seconds']:.1f} s to compile)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
