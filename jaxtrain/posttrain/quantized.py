"""A frozen base weight stored quantized (QLoRA, Dettmers et al. 2023), through qwix's `QArray`.

    a float weight W (frozen)   ->  {"qvalue": int8 codes of W's shape (4-bit: two a byte), "scale": W's rank}
    where the model projects x  ->  qwix.einsum(x, QArray(qvalue, scale)): W dequantized in the matmul

`lora.quantize` picks the code: `int8` or `int4` (symmetric, round to nearest: W ≈ qvalue · scale) or `nf4` (the
16 NormalFloat levels of QLoRA's paper, in [-1, 1]: W ≈ level[qvalue] · scale). qwix does the quantizing
(`qwix.quantize`, absmax calibration), the dequantizing and the matmul (`qwix.einsum`, which dequantizes a QArray
multiplied by float activations in front of the dot, for XLA to fuse); this module says which dims get a scale and
what the scale's dims are called.

A scale per output channel: one for every index of the weight's dims its einsum does not contract (the output dims,
an expert's dim, the stacked `layers`), shared along the contracted dims (size 1 there). So every dim of a scale is
either the weight's own dim, logically named as the weight's and split by the same rule, or a size-1 broadcast dim
named None (whole on every device): it shards on every mesh the weight shards on. qwix also offers tiled (block)
scales along a contracted dim (`tiled_axes`, QLoRA's blocks of 64), but a block-count dim of the weight's logical
name would have to divide by the mesh axes that split that dim (gpt-tiny's `embed` of 64 makes one block, which
`fsdp=2` cannot split), so the scale would depend on the mesh; per-channel scales do not.

4-bit codes are stored two to a byte (uint8, halving W's last contracted dim, which must be even): qwix's int4 / uint4
arrays compile and run (TPU memory packs them too), but a checkpoint cannot hold them (orbax's tensorstore:
`Unsupported data type: "uint4"`). The pairs are neighbours along one dim, so the packed dim keeps the weight's
logical name and splits as the weight's does; each layer's codes are unpacked where its matmul reads them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import qwix

QTYPES: dict[str, Any] = {"int8": jnp.int8, "int4": jnp.int4, "nf4": "nf4"}  # lora.quantize's kinds: qwix's qtype


def kept_dims(spec: str, lead: int) -> tuple[int, ...]:
    """The dims of a weight (with `lead` stacked dims before those of einsum `spec`) that get their own scales: the
    stacked ones and every dim the einsum does not contract."""
    inputs, out = spec.replace(" ", "").split("->")
    w = inputs.split(",")[1]
    return tuple(range(lead)) + tuple(lead + i for i, c in enumerate(w) if c in out)


def quantize(weight: jax.Array, kind: str, spec: str, lead: int) -> dict[str, jax.Array]:
    """{"qvalue", "scale"} of `weight`, quantized as `kind` with a scale per output channel (in the weight's
    dtype, which is the dtype it dequantizes to); 4-bit codes packed two to a byte (`pack`)."""
    q = qwix.quantize(weight, QTYPES[kind], channelwise_axes=kept_dims(spec, lead))
    qvalue = q.qvalue if kind == "int8" else pack(q.qvalue, packed_axis(spec))
    return {"qvalue": qvalue, "scale": q.scale}


def packed_axis(spec: str) -> int:
    """The dim (counted from the end, so the same in a layer's slice) along which 4-bit codes pair up: the weight's
    last contracted dim (`embed` of a query weight, `mlp` of the MLP's down weight)."""
    inputs, out = spec.replace(" ", "").split("->")
    w = inputs.split(",")[1]
    return [i - len(w) for i, c in enumerate(w) if c not in out][-1]


def pack(codes: jax.Array, axis: int) -> jax.Array:
    """4-bit `codes` (int4 or uint4) as uint8, neighbours along `axis` in one byte (the first in the low half)."""
    nibbles = codes.astype(jnp.int8).astype(jnp.uint8) & 0xF  # two's complement: int4's -1 is 0xF
    axis %= codes.ndim
    shape = list(codes.shape)
    shape[axis : axis + 1] = [shape[axis] // 2, 2]
    pairs = jnp.moveaxis(nibbles.reshape(shape), axis + 1, -1)  # (..., n / 2, ..., 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack(packed: jax.Array, axis: int, qtype: Any) -> jax.Array:
    """The inverse of `pack`: codes of `qtype` (int4: sign-extended; uint4: nf4's level indices)."""
    nibbles = jnp.stack([packed & 0xF, packed >> 4], axis=-1)  # (..., 2)
    pairs = jnp.moveaxis(nibbles, -1, axis % packed.ndim + 1)  # each pair right after its packed dim
    shape = list(packed.shape)
    shape[axis % packed.ndim] *= 2
    codes = pairs.reshape(shape)
    if qtype is jnp.int4:
        return ((codes.astype(jnp.int8) ^ 8) - 8).astype(jnp.int4)
    return codes.astype(jnp.uint4)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Stored:
    """A base weight as the params hold it, {"qvalue", "scale"}, with how to read it: what `project` meets where
    the model multiplies the weight (inside `Adapted`), a pytree that a layer scan slices like the weight."""

    qvalue: jax.Array
    scale: jax.Array
    kind: str = dataclasses.field(metadata={"static": True})
    axis: int = dataclasses.field(metadata={"static": True})  # the packed dim of 4-bit codes (from the end)

    def qarray(self) -> qwix.QArray:
        """The qwix array the matmul takes (4-bit codes unpacked here, one layer's at a time inside a scan)."""
        qtype = QTYPES[self.kind]
        qvalue = self.qvalue if self.kind == "int8" else unpack(self.qvalue, self.axis, qtype)
        return qwix.QArray(qvalue, self.scale, None, qtype)


def stored(entry: dict[str, jax.Array], kind: str, spec: str) -> Stored:
    """The params' {"qvalue", "scale"} of a weight of einsum `spec`, ready for `project`."""
    return Stored(entry["qvalue"], entry["scale"], kind, 0 if kind == "int8" else packed_axis(spec))


def abstract(weight: jax.ShapeDtypeStruct, kind: str, spec: str, lead: int) -> dict[str, jax.ShapeDtypeStruct]:
    """The shapes and dtypes `quantize` gives `weight` (codes int8, or uint8 holding two 4-bit codes)."""
    return jax.eval_shape(lambda w: quantize(w, kind, spec, lead), weight)


def names(weight_names: Sequence[str | None], spec: str, lead: int) -> dict[str, tuple]:
    """The logical names of `quantize`'s arrays: the codes keep the weight's, the scale the weight's on its kept
    dims and None on the size-1 dims it is broadcast along (a size-1 dim cannot be split)."""
    kept = kept_dims(spec, lead)
    return {
        "qvalue": tuple(weight_names),
        "scale": tuple(n if i in kept else None for i, n in enumerate(weight_names)),
    }


def dequantize(entry: dict[str, Any], kind: str, spec: str) -> Any:
    """The float weight `entry` stands for; for abstract arrays (`jax.ShapeDtypeStruct`, e.g. a restore target)
    the float weight's shape and dtype, with the codes' sharding."""
    qvalue, scale = entry["qvalue"], entry["scale"]
    if isinstance(qvalue, jax.ShapeDtypeStruct):
        shape = list(qvalue.shape)
        if kind != "int8":
            shape[packed_axis(spec)] *= 2
        return jax.ShapeDtypeStruct(tuple(shape), scale.dtype, sharding=qvalue.sharding)
    return qwix.dequantize(stored(entry, kind, spec).qarray())


def is_quantized(entry: Any) -> bool:
    """Whether an adapted weight's "base" is stored quantized."""
    return isinstance(entry, dict) and "qvalue" in entry
