"""The chunked output loss (`jaxtrain.ops.cross_entropy`) as the compilers hold it: an analytic model. The trace
reads the loss with plain kernels (`jaxtrain.ops.plain`), as one matmul's whole logits and a softmax over them,
which at a real vocabulary is most of the traced step's memory and none of the compiled one's.

The chunked loss runs the head's matmul, the softmax and both gradients a chunk of C positions of every row at a
time, in the forward pass, under a custom VJP. Per device, with b rows of T positions, D the model width, V the
vocabulary entries the device holds (the vocabulary over the axes its activation rule names) and s the compute
dtype's bytes:
- kept for the backward pass, in place of the logits and what the softmax keeps of them: d(hidden), b x T x D
  in s bytes, the losses, b x T float32, and the head's gradient. XLA:GPU keeps the batch shard's sum of the whole
  head's gradient in the compute dtype, V x D x s, until the end of the backward pass, where it reduces it with the
  embedding's (the buffer live across the layers' backward loop in the compiled llama-1b on h100:8); XLA:TPU
  reduces it in the forward pass and keeps its share, which the gradients count.
- while it runs: that float32 sum (V x D x 4; on GPU the buffer it keeps), and a chunk's logits in float32 and
  their gradient in s bytes (b x C x V each); on TPU also the sum cast to s bytes for its all-reduce (V x D x s),
  made while the float32 one is live (llama-1b at fsdp=64 on v5p:4x4x4: a quarter of the vocabulary lowered the
  compiled temporaries by 8.2 bytes a table element, the float32 sum, this cast and the gathered head).
The head gathered whole in the compute dtype is one of the gathered weights (`jaxtrain.planner.weights`). Its
gradient, the batch shards' sums added up into the head's layout, goes over the FSDP axes as an all-reduce in the
compute dtype on TPU (the whole head's gradient, twice a reduce-scatter's bytes: llama-1b's tied table and llama-8b's
head at fsdp=32), and on GPU as a reduce-scatter in the compute dtype (llama-1b on h100:8).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import jax.numpy as jnp

from jaxtrain.ops.cross_entropy import default_chunk_len
from jaxtrain.planner.tiling import held_bytes


@dataclasses.dataclass(frozen=True)
class ChunkedLoss:
    """Bytes one device holds of the chunked loss: `kept` for the backward pass, `working` while it runs."""

    vocab: int  # the whole vocabulary: the trace's values with a dim of this size are the plain loss's logits
    kept: float
    working: float
    head_reduction: tuple[str, int] | None  # the collective and bytes per element the head's gradient is reduced in


def chunked_loss(
    model: object,
    rows: float,
    seq_len: int,
    mesh_shape: Mapping[str, int],
    vocab_axes: Sequence[str],
    compiler: str,
) -> ChunkedLoss | None:
    """The chunked loss of a model config whose loss computes in chunks (`chunked_loss` with fused kernels), for
    `rows` rows of `seq_len` positions on a device, the vocabulary split over `vocab_axes`; None where the model
    has no such loss or its sequence fits one chunk (then it computes as the plain program the trace reads)."""
    if not (getattr(model, "chunked_loss", False) and getattr(model, "kernels", "") == "fused"):
        return None
    vocab = model.vocab_size / math.prod(mesh_shape[a] for a in vocab_axes)
    chunk = default_chunk_len(max(1, int(rows)), max(1, int(vocab)))
    if chunk >= seq_len:
        return None
    itemsize, tiled = jnp.dtype(model.dtype).itemsize, compiler == "tpu"
    head_grad = held_bytes((vocab, model.d_model), 4, tiled)
    kept = held_bytes((rows, seq_len, model.d_model), itemsize, tiled) + held_bytes((rows, seq_len), 4, tiled)
    logits = held_bytes((rows, chunk, vocab), 4, tiled) + held_bytes((rows, chunk, vocab), itemsize, tiled)
    if compiler == "gpu":
        summed = held_bytes((vocab, model.d_model), itemsize, tiled)
        return ChunkedLoss(model.vocab_size, kept + summed, logits, ("reduce-scatter", itemsize))
    # XLA:TPU casts the float32 sum to the compute dtype for the all-reduce while the sum is still live.
    summed = held_bytes((vocab, model.d_model), itemsize, tiled) if tiled else 0.0
    return ChunkedLoss(model.vocab_size, kept, head_grad + summed + logits, ("all-reduce", itemsize) if tiled else None)
