"""Self-attention, causal (a decoder's) or bidirectional (an encoder's), one function with several implementations:
what a model's attention layer calls.

    >>> out = attention(q, k, v, implementation="auto", segment_ids=doc_ids, sliding_window=4096)  # doctest: +SKIP
    >>> out = attention(q, k, v, segment_ids=doc_ids, causal=False)  # an encoder's              # doctest: +SKIP

q is (B, T, H, K); k and v are (B, T, G, K) with G dividing H (grouped-query attention: query head h reads kv head
h // (H // G); G == 1 is multi-query). Scores are scaled by 1/sqrt(K), softmax statistics are float32, the output
is (B, T, H, K) in q's dtype. `segment_ids` (B, T) marks packed documents (contiguous runs of one id; id 0, padding,
is one more run): a token attends only to tokens of its own run, and with `causal` (the default) only to earlier
ones. `sliding_window` W (causal only): query t attends keys s with t - W < s <= t.

Implementations (`IMPLEMENTATIONS`):
- `reference`: einsum scores with an explicit boolean mask; memory grows with T².
- `xla`, `cudnn`: `jax.nn.dot_product_attention`; cuDNN's fused flash attention (GPU, bf16/fp16), with packed
  documents through its segment offsets.
- `splash`: the Pallas TPU kernel (jax.experimental.pallas.ops.tpu.splash_attention).
- `chunked`: blockwise online-softmax attention in plain JAX with a FlashAttention-2 style backward; memory grows
  linearly in T, on any backend.
- `auto`: cuDNN on GPU, splash on TPU, on CPU reference or chunked by sequence length (`resolve_implementation`).

The kernels that need per-device shapes (cudnn, splash) run inside `shard_map` over the active mesh
(`jaxtrain.sharding.constraints.per_device`): batch on the batch axes, heads on `tensor`, the sequence whole.
"""

from __future__ import annotations

import functools
import math
import warnings

import jax
import jax.numpy as jnp

from jaxtrain.errors import UserInputError
from jaxtrain.ops.blockwise import (
    CHUNK,
    MASKED,
    Visibility,
    attends,
    block_gradients,
    block_positions,
    einsum32,
    empty_softmax_state,
    finish_softmax,
    from_blocks,
    kv_split_like_q,
    online_softmax_step,
    output_dot,
    pad_seq,
    to_blocks,
)
from jaxtrain.ops.context_attention import CONTEXT_PARALLEL as CONTEXT_PARALLEL  # the model's choices, from here
from jaxtrain.ops.context_attention import context_attention, sequence_axes
from jaxtrain.ops.plain import KERNELS
from jaxtrain.sharding.constraints import active_platform, per_device

IMPLEMENTATIONS = ("auto", "reference", "xla", "cudnn", "splash", "chunked")
# From this sequence length on, `auto` picks `chunked` over `reference` on CPU: below it the faster of the two
# depends on the head shape and the margins are small; from it on chunked wins or nearly ties, and its memory stays
# linear (docs/attention.md has the timings and how they were taken).
CPU_CHUNKED_FROM_SEQ = 512
_SPLASH_BLOCK = 128  # the splash kernel's blocks are multiples of the TPU's 128 lanes
_Q = ("batch", None, "heads", None)  # q and the output on each device: the sequence and head dim stay whole
_SEGMENTS = ("batch", None)
_KERNEL_PLATFORM = {"cudnn": "gpu", "splash": "tpu"}  # the kernels that run on one platform only


class AttentionError(UserInputError):
    """An attention implementation, shape or option that cannot work here."""


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    implementation: str = "auto",
    segment_ids: jax.Array | None = None,
    causal: bool = True,
    sliding_window: int | None = None,
    interpret: bool = False,
    context_parallel: str = "ring",
    kernels: str = "fused",
) -> jax.Array:
    """Self-attention of q (B, T, H, K) over k, v (B, T, G, K) -> (B, T, H, K) in q's dtype.

    `implementation`: one of IMPLEMENTATIONS. `segment_ids` (B, T) int: packed documents. `causal`: query t sees
    keys s <= t of its document (a decoder's); False: every key of its document (an encoder's). `sliding_window` W
    (causal only): query t sees keys t - W < s <= t. `interpret`: run the splash kernel in the Pallas interpreter on
    any backend (tests).
    `context_parallel`: one of CONTEXT_PARALLEL, the algorithm where the active rules split the sequence over
    devices; q, k, v and segment_ids are then in the layout of `jaxtrain.ops.sequence`. `kernels="plain"`: a fused
    implementation computes as the reference under `jax.checkpoint` (`jaxtrain.ops.plain`).
    """
    visibility = Visibility(causal, sliding_window)
    _check_inputs(q, k, v, segment_ids, visibility)
    if kernels not in KERNELS:
        raise AttentionError(f"kernels='{kernels}': use one of {', '.join(KERNELS)}.")
    if sequence_axes(q.shape[1]):
        return context_attention(
            q, k, v, segment_ids, visibility, algorithm=context_parallel, implementation=implementation
        )
    platform = "tpu" if interpret else active_platform()
    chosen = resolve_implementation(implementation, platform, q.shape[1], q.dtype, packed=segment_ids is not None)
    needs = _KERNEL_PLATFORM.get(chosen, platform)
    if needs != platform:
        raise AttentionError(
            f"attention implementation '{chosen}' needs a {needs.upper()}, but this program runs on {platform}. Use "
            f"'auto' (picks per backend), 'chunked', 'xla' or 'reference'."
        )
    if kernels == "plain" and chosen in _FUSED:
        # The reference's numbers with a fused kernel's memory, which keeps q, k and v for the backward pass and
        # computes the scores again there.
        return jax.checkpoint(_reference, static_argnums=(4,))(q, k, v, segment_ids, visibility)
    run = {
        "reference": _reference,
        "xla": _xla,
        "cudnn": _cudnn,
        "splash": functools.partial(_splash, interpret=interpret),
        "chunked": _chunked,
    }[chosen]
    return run(q, k, v, segment_ids, visibility)


_FUSED = ("chunked", "cudnn", "splash")  # never hold a (T, T) score matrix


def resolve_implementation(
    implementation: str, platform: str, seq_len: int, dtype: object = None, packed: bool = False
) -> str:
    """The implementation `attention` runs for `implementation` on `platform` ("cpu", "gpu", "tpu") at `seq_len`,
    for inputs of `dtype` with segment ids or not (`packed`).

    `auto`: on GPU cuDNN, or XLA's where cuDNN cannot take the inputs (float32; packed documents before Hopper, or
    compiling ahead of time, where JAX sees no GPU to check) or is not installed, with a warning; splash on TPU; on
    CPU `reference` below CPU_CHUNKED_FROM_SEQ and `chunked` from there.

        >>> resolve_implementation("auto", "cpu", 4096)
        'chunked'
    """
    if implementation not in IMPLEMENTATIONS:
        raise AttentionError(
            f"attention implementation '{implementation}' is unknown; choose one of {', '.join(IMPLEMENTATIONS)}."
        )
    if implementation != "auto":
        return implementation
    if platform == "gpu":
        takes = dtype is None or jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)
        return "cudnn" if takes and _cudnn_loadable() and (not packed or _cudnn_packs()) else "xla"
    if platform == "tpu":
        return "splash"
    return "reference" if seq_len < CPU_CHUNKED_FROM_SEQ else "chunked"


def masked_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Attention of q (B, Tq, H, K) over k, v (B, Tk, G, K) where mask (B or 1, Tq, Tk) is True -> (B, Tq, H, K).

    For decoding with a KV cache (Tq new tokens against Tk cache slots). A query whose mask row is all False gets
    the mean of the values (never NaN); give every query at least one key.
    """
    batch, q_len, heads, head_dim = q.shape
    groups = k.shape[2]
    _check_heads(heads, groups)
    if mask.shape not in ((batch, q_len, k.shape[1]), (1, q_len, k.shape[1])):
        raise AttentionError(
            f"mask {mask.shape} must be (batch or 1, queries, keys) = ({batch} or 1, {q_len}, {k.shape[1]})."
        )
    per_group = heads // groups
    # Each key/value head's H/G query heads become H/G times as many query rows (row j * Tq + t: query head j of the
    # group at position t): 4-D products, "brgk,bsgk->bgrs", for any grouping. With a group dim in the scores
    # XLA:GPU saves a scanned layer stack's scores transposed and copies the whole stack between the forward and
    # backward loops (6 GiB more for gpt-medium at 4 x 1024 tokens a device).
    rows = q.reshape(batch, q_len, groups, per_group, head_dim).transpose(0, 3, 1, 2, 4)
    rows = rows.reshape(batch, per_group * q_len, groups, head_dim)  # (B, H/G x Tq, G, K)
    scores = _query_key_scores(rows, k) / math.sqrt(head_dim)  # (B, G, H/G x Tq, Tk)
    scores = jnp.where(jnp.tile(mask, (1, per_group, 1))[:, None], scores, MASKED)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bgrs,bsgk->brgk", probs, v).reshape(batch, per_group, q_len, groups, head_dim)
    return out.transpose(0, 2, 3, 1, 4).reshape(batch, q_len, heads, head_dim).astype(q.dtype)


@jax.custom_vjp
def _query_key_scores(q: jax.Array, k: jax.Array) -> jax.Array:
    """q (B, R, G, K) . k (B, S, G, K) -> scores (B, G, R, S) float32, whatever q's dtype."""
    return einsum32("brgk,bsgk->bgrs", q, k)


def _query_key_scores_fwd(q, k):
    return _query_key_scores(q, k), (q, k)


def _query_key_scores_bwd(residuals, d_scores):
    # The scores' gradient is float32; autodiff would run both products in float32. Cast it to the inputs' dtype
    # first (as FlashAttention does), so that in bfloat16 they run at bfloat16's rate; in float32 nothing changes.
    q, k = residuals
    d_scores = d_scores.astype(q.dtype)
    dq = einsum32("bgrs,bsgk->brgk", d_scores, k).astype(q.dtype)
    dk = einsum32("bgrs,brgk->bsgk", d_scores, q).astype(k.dtype)
    return dq, dk


_query_key_scores.defvjp(_query_key_scores_fwd, _query_key_scores_bwd)


def causal_mask(
    seq_len: int, segment_ids: jax.Array | None = None, sliding_window: int | None = None, *, causal: bool = True
) -> jax.Array:
    """(B or 1, T, T) bool: query t may attend key s: within its segment, and with `causal` (the default) s <= t
    and inside the window."""
    positions = jnp.arange(seq_len)
    same_segment = None if segment_ids is None else segment_ids[:, :, None] == segment_ids[:, None, :]
    mask = attends(positions, positions, same_segment, Visibility(causal, sliding_window))
    return mask if mask.ndim == 3 else mask[None]


def _check_inputs(q, k, v, segment_ids, visibility: Visibility) -> None:
    if q.ndim != 4 or k.ndim != 4 or k.shape != v.shape:
        raise AttentionError(
            f"attention takes q (B, T, H, K) and k, v (B, T, G, K) of equal shapes; got q {q.shape}, k {k.shape}, "
            f"v {v.shape}."
        )
    (batch, seq_len, heads, head_dim), groups = q.shape, k.shape[2]
    if k.shape[:2] != (batch, seq_len) or k.shape[3] != head_dim:
        raise AttentionError(f"k/v {k.shape} do not match q {q.shape} in batch, sequence or head dim.")
    _check_heads(heads, groups)
    if segment_ids is not None and segment_ids.shape != (batch, seq_len):
        raise AttentionError(f"segment_ids {segment_ids.shape} must be (batch, seq) = {(batch, seq_len)}.")
    window = visibility.window
    if window is not None and (not isinstance(window, int) or window < 1):
        raise AttentionError(f"sliding_window {window!r} must be a positive int (tokens seen) or None.")
    if window is not None and not visibility.causal:
        raise AttentionError(
            f"sliding_window needs causal attention: got sliding_window={window} with causal=False; use "
            f"sliding_window=None for bidirectional attention, or causal=True."
        )


def _check_heads(heads: int, groups: int) -> None:
    if heads % groups:
        raise AttentionError(
            f"{groups} kv heads do not divide {heads} query heads: grouped-query attention needs n_kv_heads to "
            f"divide n_heads (e.g. {', '.join(str(g) for g in range(1, heads + 1) if heads % g == 0)})."
        )


def _reference(q, k, v, segment_ids, visibility: Visibility) -> jax.Array:
    mask = causal_mask(q.shape[1], segment_ids, visibility.window, causal=visibility.causal)
    return masked_attention(q, k, v, mask)


def _xla(q, k, v, segment_ids, visibility: Visibility) -> jax.Array:
    mask = None if segment_ids is None else (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]
    window = _left_window(visibility.window)
    return jax.nn.dot_product_attention(
        q, k, v, mask=mask, is_causal=visibility.causal, local_window_size=window, implementation="xla"
    )


def _left_window(window: int | None) -> tuple[int, int] | None:
    """jax.nn.dot_product_attention's (left, right) window: t attends t - left ..., so left = W - 1."""
    return None if window is None else (window - 1, 0)


def _cudnn(q, k, v, segment_ids, visibility: Visibility) -> jax.Array:
    if q.dtype not in (jnp.bfloat16, jnp.float16):
        raise AttentionError(
            f"attention implementation 'cudnn' takes bfloat16 or float16 q/k/v, got {q.dtype}: compute in bf16, or "
            f"use 'xla' (or 'auto', which picks it for float32 on GPU)."
        )
    k, v, kv_names = kv_split_like_q(q, k, v)
    if segment_ids is None:
        kernel = functools.partial(_cudnn_unpacked, visibility=visibility)
        return per_device(kernel, [_Q, kv_names, kv_names], _Q)(q, k, v)
    kernel = functools.partial(_cudnn_packed, visibility=visibility)
    return per_device(kernel, [_Q, kv_names, kv_names, _SEGMENTS], _Q)(q, k, v, segment_ids)


def _cudnn_unpacked(q, k, v, *, visibility: Visibility) -> jax.Array:
    # Per device: q (b, T, h, K), k and v (b, T, g, K).
    window = _left_window(visibility.window)
    return _cudnn_call(
        jax.nn.dot_product_attention,
        q, k, v, is_causal=visibility.causal, local_window_size=window, implementation="cudnn",
    )  # fmt: skip


def _cudnn_packed(q, k, v, segment_ids, *, visibility: Visibility) -> jax.Array:
    """Packed documents through cuDNN's segment offsets (its THD layout): jax.nn.dot_product_attention has no
    segment ids, and a (B, 1, T, T) mask would cost the T² memory the kernel exists to avoid."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    offsets, lengths = _segment_offsets(segment_ids)  # per device: (b, T + 1), (b, T)
    # PADDING: each packed document attends within itself, as its offsets and lengths delimit it.
    mask_type = cudnn.MaskType.PADDING_CAUSAL if visibility.causal else cudnn.MaskType.PADDING
    return _cudnn_call(
        cudnn.dot_product_attention,
        q, k, v, q_seqlen=lengths, kv_seqlen=lengths, q_offsets=offsets, kv_offsets=offsets,
        scale=1 / math.sqrt(q.shape[-1]), mask_type=mask_type, sliding_window_length=visibility.window,
    )  # fmt: skip


def _cudnn_call(fn, *args, **kwargs) -> jax.Array:
    try:
        return fn(*args, **kwargs)
    except RuntimeError as error:
        if "cudnn" not in str(error).lower():
            raise
        raise AttentionError(f"attention implementation 'cudnn': {error} {_CUDNN_INSTALL} Or use 'xla'.") from error
    except NotImplementedError as error:  # JAX's checks of the shape and the GPU against cuDNN's flash attention
        raise AttentionError(
            f"attention implementation 'cudnn' cannot run this: {error} Use 'xla' or 'chunked'."
        ) from error


_CUDNN_INSTALL = "The CUDA plugin loads cuDNN from the nvidia-cudnn-cu12 package (jax[cuda12] brings it)."


@functools.cache
def _cudnn_loadable() -> bool:
    """Whether JAX finds cuDNN; warns once where it does not, since `auto` then runs XLA's slower attention."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    try:
        cudnn.check_cudnn_version()
        return True
    except RuntimeError as error:
        warnings.warn(f"attention 'auto' on GPU uses 'xla': {error} {_CUDNN_INSTALL}", stacklevel=3)
        return False


@functools.cache
def _cudnn_packs() -> bool:
    """Whether cuDNN takes packed documents here: JAX asks the live GPU for Hopper or later (compiling ahead of
    time from a CPU-only process it finds none). Warns once where not, since `auto` then runs XLA's attention."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    if cudnn.check_compute_capability("9.0"):
        return True
    warnings.warn(
        "attention 'auto' on GPU uses 'xla' for packed documents: cuDNN's packed layout needs a Hopper or later GPU "
        "(and JAX sees none in this process)",
        stacklevel=3,
    )
    return False


def _segment_offsets(segment_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cuDNN's packed layout of each row's runs of equal ids, as JAX's own packed-layout test writes it: offsets
    (B, T + 1), each run's first token, then -1; lengths (B, T), each run's length, then -1."""
    batch, seq_len = segment_ids.shape
    starts = jnp.concatenate([jnp.ones((batch, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    runs = starts.sum(axis=1, keepdims=True)  # (B, 1)
    offsets = jax.vmap(lambda row: jnp.nonzero(row, size=seq_len + 1, fill_value=seq_len)[0])(starts)
    lengths = jnp.diff(offsets, axis=1)
    slot = jnp.arange(seq_len + 1)[None]
    offsets = jnp.where(slot < runs, offsets, -1)
    lengths = jnp.where(slot[:, :seq_len] < runs, lengths, -1)
    return offsets.astype(jnp.int32), lengths.astype(jnp.int32)


def _splash(q, k, v, segment_ids, visibility: Visibility, *, interpret: bool) -> jax.Array:
    k, v, kv_names = kv_split_like_q(q, k, v)
    kernel = functools.partial(_splash_per_device, visibility=visibility, interpret=interpret)
    if segment_ids is None:
        return per_device(kernel, [_Q, kv_names, kv_names], _Q)(q, k, v)
    return per_device(kernel, [_Q, kv_names, kv_names, _SEGMENTS], _Q)(q, k, v, segment_ids)


def _splash_per_device(q, k, v, segment_ids=None, *, visibility: Visibility, interpret) -> jax.Array:
    """Per device: q (b, T, h, K), k and v (b, T, g, K), segment_ids (b, T) -> (b, T, h, K)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash

    seq_len, heads, head_dim = q.shape[1:]
    padded = -(-seq_len // _SPLASH_BLOCK) * _SPLASH_BLOCK
    # The kernel takes one example's (heads, T, K), T a multiple of its blocks, and leaves scaling to the caller.
    q, k, v = (pad_seq(x, padded).transpose(0, 2, 1, 3) for x in (q * (1 / math.sqrt(head_dim)), k, v))
    segments = _splash_segments(segment_ids, q.shape[0], seq_len, padded, visibility.causal)
    kernel = _splash_kernel(heads, padded, visibility, interpret)

    def one_example(q, k, v, segments):
        ids = None if segments is None else splash.SegmentIds(q=segments, kv=segments)
        return kernel(q, k, v, segment_ids=ids)

    out = jax.vmap(one_example)(q, k, v, segments)  # (b, h, T', K)
    return out.transpose(0, 2, 1, 3)[:, :seq_len].astype(q.dtype)


def _splash_segments(segment_ids, batch: int, seq_len: int, padded: int, causal: bool) -> jax.Array | None:
    """The kernel's segment ids (b, T') for a sequence padded at its end from T to T', or None: causality hides
    the padding from every real query; without it an id no real token has (-1) does."""
    if causal or padded == seq_len:
        return None if segment_ids is None else pad_seq(segment_ids, padded)
    ids = jnp.zeros((batch, seq_len), jnp.int32) if segment_ids is None else segment_ids
    return pad_seq(ids, padded, -1)


def _splash_kernel(heads: int, seq_len: int, visibility: Visibility, interpret: bool):
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    shape, window = (seq_len, seq_len), visibility.window
    if not visibility.causal:
        one_head = masks.FullMask(shape)
    elif window is None:
        one_head = masks.CausalMask(shape)
    else:
        one_head = masks.LocalMask(shape, (window - 1, 0), offset=0)
    block = max(b for b in (512, 256, 128) if seq_len % b == 0)
    sizes = splash.BlockSizes(
        block_q=block, block_kv=block, block_kv_compute=block,
        block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block,
    )  # fmt: skip
    return splash.make_splash_mha(
        masks.MultiHeadMask([one_head] * heads), block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret
    )


def chunked_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    segment_ids: jax.Array | None = None,
    causal: bool = True,
    sliding_window: int | None = None,
    block_size: int = CHUNK,
) -> jax.Array:
    """`attention(..., implementation="chunked")` with its block length: blockwise online-softmax attention.

    Query block i visits only the key blocks its queries see: causal, those at or below the diagonal and inside the
    window; else all. The backward recomputes each block's probabilities from the saved output and log-sum-exp
    (FlashAttention-2), so memory grows linearly in T. T need not divide by `block_size`: the sequence is padded at
    its end, with a segment id (-1) no real token has.
    """
    visibility = Visibility(causal, sliding_window)
    _check_inputs(q, k, v, segment_ids, visibility)
    return _chunked(q, k, v, segment_ids, visibility, block_size)


def _chunked(q, k, v, segment_ids, visibility: Visibility, block_size: int = CHUNK) -> jax.Array:
    batch, seq_len, heads, head_dim = q.shape
    groups = k.shape[2]
    block = min(block_size, seq_len)
    count = -(-seq_len // block)
    padded = count * block
    if segment_ids is None:
        segment_ids = jnp.zeros((batch, seq_len), jnp.int32)

    q_blocks = to_blocks(q.reshape(batch, seq_len, groups, heads // groups, head_dim), block, padded)
    kv_blocks = (to_blocks(x, block, padded) for x in (k, v))  # (n, B, G, b, K)
    out = _flash(visibility, q_blocks, *kv_blocks, to_blocks(segment_ids, block, padded, -1))
    return from_blocks(out)[:, :seq_len]


# Inside the blockwise kernel: q (n, B, G, J, b, K) with J = H/G query heads per kv head, k and v (n, B, G, b, K),
# segments (n, B, b), the output like q, lse (n, B, G, J, b) float32; n blocks of b tokens.
@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(visibility, q, k, v, segments) -> jax.Array:
    return _flash_forward(visibility, q, k, v, segments)[0]


def _flash_forward(visibility, q, k, v, segments) -> tuple[jax.Array, jax.Array]:
    """(output, log-sum-exp) by the online softmax over each query block's visible key blocks."""
    block = q.shape[-2]
    positions = block_positions(q.shape[0], block)

    def query_block(i):
        def visit(j, carry):
            return online_softmax_step(
                visibility, carry, q[i], k[j], v[j], (segments[i], segments[j]), (positions[i], positions[j])
            )

        init = _varying_like(empty_softmax_state(q.shape[1:]), q, k, v, segments)
        keys = _key_block_range(i, visibility, block, q.shape[0])
        return finish_softmax(jax.lax.fori_loop(*keys, visit, init), q.dtype)

    return jax.lax.map(query_block, jnp.arange(q.shape[0]))


def _flash_fwd(visibility, q, k, v, segments):
    out, lse = _flash_forward(visibility, q, k, v, segments)
    return out, (q, k, v, segments, out, lse)


def _flash_bwd(visibility, residuals, d_out):
    """FlashAttention-2's backward: per key block, the dk and dv of every query block that sees it, with the
    probabilities recomputed from the saved log-sum-exp; dq accumulates across key blocks."""
    q, k, v, segments, out, lse = residuals
    count, block = q.shape[0], q.shape[-2]
    delta = output_dot(out, d_out)
    positions = block_positions(count, block)

    def key_block(dq, j):
        def visit(i, carry):
            dk, dv, dq = carry
            residuals = (lse[i], delta[i], d_out[i])
            dq_i, dk_j, dv_j = block_gradients(
                visibility, q[i], k[j], v[j], (segments[i], segments[j]), (positions[i], positions[j]), residuals
            )
            return dk + dk_j, dv + dv_j, dq.at[i].add(dq_i)

        zeros = _varying_like(jnp.zeros(k.shape[1:]), q, k, v, segments, d_out)
        queries = _query_block_range(j, visibility, block, count)
        dk, dv, dq = jax.lax.fori_loop(*queries, visit, (zeros, zeros, dq))
        return dq, (dk, dv)

    dq = _varying_like(jnp.zeros(q.shape), q, k, v, segments, d_out)
    dq, (dk, dv) = jax.lax.scan(key_block, dq, jnp.arange(count))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_flash.defvjp(_flash_fwd, _flash_bwd)


def _varying_like(init, *arrays):
    """`init` typed as varying over every manual mesh axis that `arrays` vary over: inside a shard_map (e.g. the
    pipeline's) a loop's carry must keep the type the body gives it."""
    axes = tuple(sorted(set().union(*(jax.typeof(x).manual_axis_type.varying for x in arrays))))
    return jax.tree.map(lambda x: jax.lax.pcast(x, axes, to="varying"), init) if axes else init


def _key_block_range(i, visibility: Visibility, block: int, count: int):
    """The key blocks [start, stop) that any query of block i (of `count`) sees: causal, from 0 or where its first
    query's window starts, to block i; else all."""
    if not visibility.causal:
        return 0, count
    window = visibility.window
    return (0 if window is None else jnp.maximum(0, (i * block - window + 1) // block)), i + 1


def _query_block_range(j, visibility: Visibility, block: int, count: int):
    """The query blocks [start, stop) that see any key of block j (of `count`): causal, from block j to the last,
    or to where its last key leaves the windows; else all."""
    if not visibility.causal:
        return 0, count
    window = visibility.window
    last = count - 1 if window is None else jnp.minimum(count - 1, (j * block + block + window - 2) // block)
    return j, last + 1
