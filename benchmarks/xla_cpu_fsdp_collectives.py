"""A minimal reproduction of how XLA:CPU runs FSDP's collectives: the gradient of a bfloat16 MLP whose float32
weights are split along their first dim over 8 devices (each device also holds an eighth of the batch).

The program asks for bfloat16 weights (each float32 shard is cast, then used). The TPU compiler gathers the cast
shards, in bfloat16, and sums the bfloat16 weight gradients in bfloat16. XLA:CPU casts each shard back to float32,
gathers that, and casts again after; it sums the gradients in float32: every collective moves twice the bytes the
program's dtypes say. Both sum each weight's whole gradient on every device (an all-reduce, then each keeps its
slice). MaxText 0.2.5's compiled program for a GPT on 8 CPU devices has the same float32 gathers and all-reduces as
jaxtrain's (issue 21), so on simulated CPU devices neither framework sends less.

Prints JSON: per platform, how many tensors each kind of collective in the compiled program moves in each dtype,
and the bytes one device receives per step through them; TPU (v5e, 2x4) only where libtpu, the TPU compiler, is
installed (`pip install 'jaxtrain[tpu-aot]'`; no TPU needed).

    python benchmarks/xla_cpu_fsdp_collectives.py [--layers 2] [--d-model 512] [--d-ff 2048] [--tokens 1024]
"""

from __future__ import annotations

import argparse
import collections
import functools
import importlib.util
import json
import math
import os
import re

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

DEVICES = 8
# "%name = RESULT op(": RESULT is one shape, or a tuple of them for a combined collective.
COLLECTIVE = re.compile(r"= (\(.*?\)|\S+) (all-gather|all-reduce|reduce-scatter)(?:-start)?\(")
DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4}


def loss(weights, x, rows: NamedSharding):
    """The MLP's loss with its activations split by rows (tokens), as FSDP keeps them: the weights move, not the
    activations."""
    for up, down in weights:
        hidden = jax.lax.with_sharding_constraint(jax.nn.gelu(x @ up.astype(jnp.bfloat16)), rows)
        x = jax.lax.with_sharding_constraint(x + hidden @ down.astype(jnp.bfloat16), rows)
    return jnp.mean(x.astype(jnp.float32) ** 2)


def collectives(devices, args) -> dict:
    """The collectives of the compiled gradient on `devices` (8, one `fsdp` axis): {"op dtype": tensors moved} and
    the bytes of their results per device."""
    mesh = Mesh(devices, ("fsdp",))
    split = NamedSharding(mesh, PartitionSpec("fsdp"))
    weights = [
        (jax.ShapeDtypeStruct((args.d_model, args.d_ff), jnp.float32, sharding=split),
         jax.ShapeDtypeStruct((args.d_ff, args.d_model), jnp.float32, sharding=split))
        for _ in range(args.layers)
    ]  # fmt: skip
    x = jax.ShapeDtypeStruct((args.tokens, args.d_model), jnp.bfloat16, sharding=split)
    gradient = jax.jit(jax.grad(functools.partial(loss, rows=split)), out_shardings=split)
    hlo = gradient.lower(weights, x).compile().as_text()
    counts, received = collections.Counter(), 0
    for result, op in COLLECTIVE.findall(hlo):
        for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", result):
            counts[f"{op} {dtype}"] += 1
            received += DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
    return {"collectives": dict(sorted(counts.items())), "mb_received_per_device": round(received / 1e6, 2)}


def tpu_devices():
    if importlib.util.find_spec("libtpu") is None:
        return None
    from jax.experimental import topologies

    # No TPU VM to ask about itself: only the compiler is used (as jaxtrain.aot.targets does).
    for key, value in (("TPU_SKIP_MDS_QUERY", "1"), ("TPU_WORKER_HOSTNAMES", "localhost"),
                       ("TPU_ACCELERATOR_TYPE", "v5e-8"), ("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")):  # fmt: skip
        os.environ.setdefault(key, value)
    return topologies.get_topology_desc(topology_name="v5e:2x4", platform="tpu").devices


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--d-ff", type=int, default=2048)
    parser.add_argument("--tokens", type=int, default=1024)
    args = parser.parse_args()
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", DEVICES)
    weight_mb = args.layers * 2 * args.d_model * args.d_ff * 4 / 1e6
    out = {"jax": jax.__version__, "weights_mb_float32": round(weight_mb, 2), "cpu": collectives(jax.devices(), args)}
    tpu = tpu_devices()
    out["tpu_v5e_2x4"] = collectives(tpu, args) if tpu is not None else "libtpu not installed"
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
