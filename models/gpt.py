"""Decoder-only transformers, one family: GPT and the Llama family (Llama, Mistral, Qwen) are settings of this code.

A block is pre-norm (RMSNorm): x + attention(norm(x)), then x + mlp(norm(x)). What the settings choose:
- attention: `n_heads` query heads sharing `n_kv_heads` key/value heads (grouped-query; multi-query at 1), each of
  `head_dim` channels (by default d_model / n_heads), optional biases on q, k, v (Qwen2) and RMSNorm on each head's
  q and k (Qwen3); rotary positions (RoPE) with `rope_base` and Llama 3.1's long-context frequency scaling;
  the kernel that computes it (`attention`: see `jaxtrain.ops.attention`), an optional sliding window;
- the MLP: GELU (GPT) or SwiGLU (Llama's gated SiLU, three matrices);
- the output head: its own matrix, or the token embedding transposed (`tie_embeddings`).

Layers are stacked along a leading `layers` dim and run with `lax.scan` (or, under pipeline parallelism, a pipeline
schedule), so compile time does not grow with depth. Every parameter names its dims (`embed`, `heads`, `kv_heads`,
`kv`, `mlp`, `vocab`, `layers`); the mapping to devices lives outside the model. Parameters are float32; `dtype` is
the compute dtype (bfloat16 on TPU/GPU).

Packed documents: a batch may carry `segment_ids` (0 is padding); tokens then attend only within their document,
positions restart at each document, and targets across a document boundary do not count.

Generation: `init_cache` and `extend` run the same blocks one token (or one prompt) at a time over a KV cache.

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> with nnx.use_eager_sharding(False):
    ...     model = GPT(PRESETS["tiny"](), nnx.Rngs(0))
    >>> model(jnp.zeros((2, 16), jnp.int32)).shape
    (2, 16, 256)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxtrain.errors import ConfigError
from jaxtrain.ops.attention import CONTEXT_PARALLEL, IMPLEMENTATIONS, attention, masked_attention
from jaxtrain.ops.cross_entropy import output_cross_entropy, target_log_probs
from jaxtrain.ops.embedding import lookup
from jaxtrain.ops.plain import KERNELS, KERNELS_HELP
from jaxtrain.ops.projection import REMAT_POLICIES, project
from jaxtrain.ops.sequence import natural_order, next_tokens, segment_positions
from jaxtrain.settings import COMPUTE_DTYPES, Settings, setting
from jaxtrain.sharding.constraints import constrain, scan_layers

MLPS = ("gelu", "swiglu")
ROPE_SCALINGS = ("none", "llama3")
CACHE_NAMES = ("layers", "batch", "cache_seq", "kv_heads", "kv")


@dataclasses.dataclass(frozen=True)
class GPTConfig(Settings):
    section: ClassVar[str] = "model"

    vocab_size: int = setting(256, "token ids", at_least=1)
    n_layers: int = setting(4, "transformer blocks", at_least=1)
    d_model: int = setting(256, "the residual stream's width", at_least=1)
    n_heads: int = setting(4, "attention (query) heads", at_least=1)
    n_kv_heads: int = setting(
        0, "key/value heads, each shared by n_heads / n_kv_heads query heads; 0: n_heads", at_least=0
    )
    head_dim: int = setting(0, "channels per attention head; 0: d_model / n_heads", at_least=0)
    d_ff: int = setting(1024, "the MLP's hidden width", at_least=1)
    mlp: str = setting("gelu", "the MLP: gelu (GPT) or swiglu (Llama: gated SiLU)", choices=MLPS)
    dtype: str = setting("bfloat16", "compute dtype; params stay float32", choices=COMPUTE_DTYPES)
    remat: str = setting("none", "what the backward pass recomputes per block", choices=REMAT_POLICIES)
    attention: str = setting("auto", "how attention is computed (jaxtrain.ops.attention)", choices=IMPLEMENTATIONS)
    context_parallel: str = setting(
        "ring",
        "attention where the mesh splits the sequence (a context axis): ring or allgather",
        choices=CONTEXT_PARALLEL,
    )
    sliding_window: int = setting(0, "attend to at most this many latest tokens; 0: every earlier one", at_least=0)
    rope_base: float = setting(10_000.0, "rotary positions' base wavelength", above=0)
    rope_scaling: str = setting("none", "RoPE frequency scaling: none, or llama3 (Llama 3.1+)", choices=ROPE_SCALINGS)
    rope_factor: float = setting(8.0, "llama3 scaling: how much the long wavelengths are stretched", at_least=1)
    rope_low_freq_factor: float = setting(1.0, "llama3 scaling: wavelengths over context/this are scaled", above=0)
    rope_high_freq_factor: float = setting(4.0, "llama3 scaling: wavelengths under context/this are kept", above=0)
    rope_original_context: int = setting(8192, "llama3 scaling: the context length pre-trained on", at_least=1)
    tie_embeddings: bool = setting(False, "the output head is the token embedding (transposed)")
    qkv_bias: bool = setting(False, "biases on the query, key and value projections (Qwen2)")
    qk_norm: bool = setting(False, "RMSNorm on each head's queries and keys (Qwen3)")
    norm_eps: float = setting(1e-6, "RMSNorm's epsilon", above=0)
    chunked_loss: bool = setting(True, "the output loss a chunk of positions at a time (false: whole logits)")
    kernels: str = setting("fused", KERNELS_HELP, choices=KERNELS)

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_channels(self) -> int:
        return self.head_dim or self.d_model // self.n_heads

    def __post_init__(self):
        super().__post_init__()
        # Rotary positions turn pairs of a head's channels: each head needs an even number of them.
        if self.head_dim % 2:
            raise ConfigError(
                f"head_dim={self.head_dim} is odd; rotary positions turn pairs of channels: use an even head_dim."
            )
        if not self.head_dim and (self.d_model % self.n_heads or self.head_channels % 2):
            fits = [h for h in range(1, min(self.d_model, 64) + 1) if self.d_model % (2 * h) == 0]
            fix = f"use n_heads in {', '.join(map(str, fits))}" if fits else "use an even d_model"
            raise ConfigError(
                f"d_model={self.d_model} must be divisible by n_heads={self.n_heads} into an even number of channels "
                f"per head (rotary positions turn pairs of channels): {fix}, or set head_dim."
            )
        if self.n_heads % self.kv_heads:
            fits = [g for g in range(1, self.n_heads + 1) if self.n_heads % g == 0]
            raise ConfigError(
                f"n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads} (each key/value head serves an "
                f"equal group of query heads): use one of {', '.join(map(str, fits))}."
            )
        if self.rope_scaling == "llama3" and self.rope_high_freq_factor <= self.rope_low_freq_factor:
            raise ConfigError(
                f"rope_high_freq_factor={self.rope_high_freq_factor} must exceed rope_low_freq_factor="
                f"{self.rope_low_freq_factor}: between them llama3 scaling blends scaled and unscaled wavelengths."
            )

    def attention_matmul_params(self) -> int:
        """The weights of one layer's q, k, v and output projections."""
        d, h, g, k = self.d_model, self.n_heads, self.kv_heads, self.head_channels
        return 2 * d * h * k + 2 * d * g * k

    def mlp_params(self) -> int:
        return (3 if self.mlp == "swiglu" else 2) * self.d_model * self.d_ff

    def num_params(self) -> int:
        h, g, k = self.n_heads, self.kv_heads, self.head_channels
        vectors = (h + 2 * g) * k * self.qkv_bias + 2 * k * self.qk_norm + 2 * self.d_model  # biases and norms
        per_layer = self.attention_matmul_params() + self.mlp_params() + vectors
        tables = 1 if self.tie_embeddings else 2
        return self.n_layers * per_layer + tables * self.vocab_size * self.d_model + self.d_model

    def train_flops(self, batch_size: int, seq_len: int, weight_gradients: bool = True) -> float:
        """Model FLOPs of one training step: 6 x matmul params per token (2 forward, 2 for the inputs' gradients, 2
        for the weights'; 4 without `weight_gradients`, the weights frozen), plus causal attention.

        Attention per token and layer: QK^T and AV are 2 x 2*T*H*K forward, x3 with backward, halved by the mask
        (a sliding window caps T). The embedding lookup is not a matmul and does not count; a tied head does.
        """
        matmul_params = (
            self.n_layers * (self.attention_matmul_params() + self.mlp_params()) + self.vocab_size * self.d_model
        )
        seen = min(seq_len, self.sliding_window or seq_len)
        per_token = (
            4.0 + 2.0 * weight_gradients
        ) * matmul_params + 6.0 * self.n_layers * seen * self.n_heads * self.head_channels
        return per_token * batch_size * seq_len


PRESETS = {
    "tiny": lambda: GPTConfig(vocab_size=256, n_layers=2, d_model=64, n_heads=4, d_ff=256, dtype="float32"),
    # remat=full: the fastest policy on CPU, as recomputing costs less than the saved activations' memory traffic
    # (docs/benchmarks.md).
    "cpu": lambda: GPTConfig(vocab_size=256, n_layers=4, d_model=256, n_heads=4, d_ff=1024, remat="full"),
    "small": lambda: GPTConfig(vocab_size=50304, n_layers=12, d_model=768, n_heads=12, d_ff=3072),
    "medium": lambda: GPTConfig(vocab_size=50304, n_layers=24, d_model=1024, n_heads=16, d_ff=4096),
    "1b": lambda: GPTConfig(vocab_size=50304, n_layers=16, d_model=2048, n_heads=16, d_ff=8192),
}


def normal_param(rngs: nnx.Rngs, shape: tuple[int, ...], names: tuple[str, ...], std: float) -> nnx.Param:
    """A float32 parameter drawn from N(0, std^2), with one logical dimension name per dimension."""
    return nnx.Param(jax.random.normal(rngs.params(), shape, jnp.float32) * std, out_sharding=names)


def constant_param(value: float, shape: tuple[int, ...], names: tuple[str, ...]) -> nnx.Param:
    return nnx.Param(jnp.full(shape, value, jnp.float32), out_sharding=names)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float = 1e-6) -> jax.Array:
    # Statistics in float32 even when the compute dtype is bfloat16.
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (normed * scale).astype(x.dtype)


def rope_frequencies(cfg: GPTConfig) -> np.ndarray:
    """RoPE's angular frequency of each pair of a head's channels (K/2,), with llama3 scaling where set.

    Llama 3.1's scaling divides the frequencies whose wavelength exceeds the pre-training context / low factor by
    `rope_factor`, keeps those under context / high factor, and blends linearly in between (as transformers'
    `_compute_llama3_parameters`).
    """
    k = cfg.head_channels
    freqs = cfg.rope_base ** (-np.arange(0, k, 2, dtype=np.float64) / k)
    if cfg.rope_scaling == "none":
        return freqs.astype(np.float32)
    wavelength = 2 * math.pi / freqs
    context, low, high = cfg.rope_original_context, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    blend = np.clip((context / wavelength - low) / (high - low), 0.0, 1.0)  # 0: long wavelength, 1: short
    return ((1 - blend) * freqs / cfg.rope_factor + blend * freqs).astype(np.float32)


class Rope(NamedTuple):
    """sin and cos of each token's rotary angles, (B or 1, T, 1, K/2): computed once, shared by every layer."""

    sin: jax.Array
    cos: jax.Array

    @classmethod
    def at(cls, positions: jax.Array, freqs: np.ndarray) -> Rope:
        angles = positions.astype(jnp.float32)[:, :, None, None] * freqs  # (B, T, 1, K/2)
        return cls(jnp.sin(angles), jnp.cos(angles))

    def rotate(self, x: jax.Array) -> jax.Array:
        """Rotate pairs of channels (k, k + K/2) of x (B, T, H, K) by each position's angle (as Llama's RoPE)."""
        x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
        return jnp.concatenate([x1 * self.cos - x2 * self.sin, x1 * self.sin + x2 * self.cos], -1).astype(x.dtype)


class Context(NamedTuple):
    """What every layer of a forward sees besides the activations: positions, and the documents of a packed row."""

    rope: Rope
    segment_ids: jax.Array | None = None  # (B, T)


def residual_std(cfg: GPTConfig) -> float:
    """Init scale of the weights that write to the residual stream: GPT-2's, shrinking with depth."""
    return 0.02 / (2 * cfg.n_layers) ** 0.5


class Block(nnx.Module):
    """One transformer layer: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
        d, h, g, k = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.head_channels
        self.cfg = cfg
        self.attn_norm = constant_param(1.0, (d,), ("norm",))
        self.w_q = normal_param(rngs, (d, h, k), ("embed", "heads", "kv"), 0.02)
        self.w_k = normal_param(rngs, (d, g, k), ("embed", "kv_heads", "kv"), 0.02)
        self.w_v = normal_param(rngs, (d, g, k), ("embed", "kv_heads", "kv"), 0.02)
        if cfg.qkv_bias:
            self.b_q = constant_param(0.0, (h, k), ("heads", "kv"))
            self.b_k = constant_param(0.0, (g, k), ("kv_heads", "kv"))
            self.b_v = constant_param(0.0, (g, k), ("kv_heads", "kv"))
        if cfg.qk_norm:
            self.q_norm = constant_param(1.0, (k,), ("norm",))
            self.k_norm = constant_param(1.0, (k,), ("norm",))
        self.w_out = normal_param(rngs, (h, k, d), ("heads", "kv", "embed"), residual_std(cfg))
        self.mlp_norm = constant_param(1.0, (d,), ("norm",))
        self.init_mlp(cfg, rngs)

    def init_mlp(self, cfg: GPTConfig, rngs: nnx.Rngs) -> None:
        """The MLP's weights; a subclass with another MLP (e.g. mixture-of-experts) makes its own."""
        self.w_in = normal_param(rngs, (cfg.d_model, cfg.d_ff), ("embed", "mlp"), 0.02)
        if cfg.mlp == "swiglu":
            self.w_gate = normal_param(rngs, (cfg.d_model, cfg.d_ff), ("embed", "mlp"), 0.02)
        self.w_down = normal_param(rngs, (cfg.d_ff, cfg.d_model), ("mlp", "embed"), residual_std(cfg))

    def __call__(self, x: jax.Array, context: Context) -> jax.Array:  # x: (B, T, D)
        x = x + self.attend(self.norm(x, self.attn_norm), context)
        x = x + self.mlp(self.norm(x, self.mlp_norm))
        return constrain(x, ("batch", "seq", "embed"))

    def attend(self, x: jax.Array, context: Context) -> jax.Array:
        """Causal self-attention of the normed stream x (B, T, D), within documents where the context has them."""
        q, k, v = self.project_qkv(x, context.rope)
        cfg = self.cfg
        mixed = attention(
            q, k, v, implementation=cfg.attention, segment_ids=context.segment_ids,
            sliding_window=cfg.sliding_window or None, context_parallel=cfg.context_parallel, kernels=cfg.kernels,
        )  # fmt: skip
        return self.project_out(mixed)

    def decode(self, x: jax.Array, rope: Rope, cache: dict, positions: jax.Array) -> tuple[jax.Array, dict]:
        """The layer on N new tokens per row (x (B, N, D) at `positions` (B, N)) over this layer's KV cache
        {"k", "v"}: (B, S, G, K). Writes their keys and values at those slots; each attends to slots up to its own."""
        q, k, v = self.project_qkv(self.norm(x, self.attn_norm), rope)
        write = jax.vmap(lambda slots, new, start: jax.lax.dynamic_update_slice_in_dim(slots, new, start, axis=0))
        cache = {
            name: write(cache[name], new.astype(cache[name].dtype), positions[:, 0])
            for name, new in (("k", k), ("v", v))
        }
        cache = {name: constrain(value, CACHE_NAMES[1:]) for name, value in cache.items()}
        slots = jnp.arange(cache["k"].shape[1])
        mask = slots[None, None, :] <= positions[:, :, None]  # (B, N, S)
        if self.cfg.sliding_window:
            mask &= positions[:, :, None] - slots[None, None, :] < self.cfg.sliding_window
        x = x + self.project_out(masked_attention(q, cache["k"], cache["v"], mask))
        x = x + self.mlp(self.norm(x, self.mlp_norm))
        return constrain(x, ("batch", "seq", "embed")), cache

    def norm(self, x: jax.Array, scale: nnx.Param) -> jax.Array:
        return rms_norm(x, scale[...], self.cfg.norm_eps)

    def project_qkv(self, x: jax.Array, rope: Rope) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Queries (B, T, H, K) and keys, values (B, T, G, K) of x (B, T, D): biased, normed, rotated as set."""
        q = project("btd,dhk->bthk", x, self.w_q[...])
        k = project("btd,dgk->btgk", x, self.w_k[...])
        v = project("btd,dgk->btgk", x, self.w_v[...])
        if self.cfg.qkv_bias:
            q, k, v = (y + b[...].astype(x.dtype) for y, b in ((q, self.b_q), (k, self.b_k), (v, self.b_v)))
        if self.cfg.qk_norm:
            q, k = self.norm(q, self.q_norm), self.norm(k, self.k_norm)
        q = constrain(rope.rotate(q), ("batch", "seq", "heads", "kv"))
        k = constrain(rope.rotate(k), ("batch", "seq", "kv_heads", "kv"))
        return q, k, constrain(v, ("batch", "seq", "kv_heads", "kv"))

    def project_out(self, mixed: jax.Array) -> jax.Array:  # (B, T, H, K) -> (B, T, D)
        return project("bthk,hkd->btd", mixed, self.w_out[...])

    def mlp(self, x: jax.Array) -> jax.Array:
        # The activations' inputs are kept out of XLA:CPU's transposing fusions (`jaxtrain.ops.cotangent`).
        hidden = project("btd,df->btf", x, self.w_in[...])  # (B, T, F)
        if self.cfg.mlp == "swiglu":
            gate = project("btd,df->btf", x, self.w_gate[...])
            hidden = jax.nn.silu(gate) * hidden
        else:
            hidden = jax.nn.gelu(hidden)
        hidden = constrain(hidden, ("batch", "seq", "mlp"))
        return project("btf,fd->btd", hidden, self.w_down[...])


def stacked_blocks(make: Callable[[nnx.Rngs], nnx.Module], n_layers: int, rngs: nnx.Rngs) -> nnx.Module:
    """`n_layers` blocks made by `make`, their params stacked along a leading `layers` dim (what `scan_layers` runs)."""

    @nnx.split_rngs(splits=n_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def make_blocks(rngs: nnx.Rngs) -> nnx.Module:
        return make(rngs)

    return make_blocks(rngs)


def layer_function(blocks: nnx.Module, context: Any, remat: str) -> tuple[Callable, Any]:
    """One of the stacked `blocks` as a function of (x, that layer's params), called with `context`, under the remat
    policy `remat`; and the stacked params, as the module holds them (what `scan_layers` takes)."""
    block_def, block_params = nnx.split(blocks)

    def layer(x, params):
        return nnx.merge(block_def, params)(x, context)

    if remat != "none":
        layer = jax.checkpoint(layer, policy=REMAT_POLICIES[remat], prevent_cse=False)
    return layer, block_params


class GPT(nnx.Module):
    """Token embedding, `n_layers` stacked blocks run by `scan_layers`, final norm and the output head."""

    block_type: type[Block] = Block  # what a subclass stacks instead (e.g. mixture-of-experts blocks)

    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embedding = normal_param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), 0.02)

        self.blocks = stacked_blocks(lambda rngs: self.block_type(cfg, rngs), cfg.n_layers, rngs)
        self.final_norm = constant_param(1.0, (cfg.d_model,), ("norm",))
        if not cfg.tie_embeddings:
            self.head = normal_param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), 0.02)

    def __call__(self, tokens: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
        """tokens (B, T) -> logits (B, T, V) float32; `segment_ids` (B, T) for packed documents. Where the mesh
        splits the sequence (context parallelism) tokens and logits are in its layout (`jaxtrain.ops.sequence`);
        `loss` lays its batch out itself."""
        return self.unembed(self.hidden(tokens, segment_ids))

    def hidden(
        self, tokens: jax.Array, segment_ids: jax.Array | None = None, positions: jax.Array | None = None
    ) -> jax.Array:
        """The residual stream after the last block, (B, T, D) in the compute dtype. `positions` (B or 1, T): each
        token's position for RoPE, where they are not 0..T-1 (or, with `segment_ids`, counted within documents)."""
        layer, block_params = self.layer_stack(self.context(tokens.shape[1], segment_ids, positions))
        return scan_layers(layer, self.embed(tokens), block_params)

    def embed(self, tokens: jax.Array) -> jax.Array:  # tokens: (B, T) -> (B, T, D) in the compute dtype
        x = lookup(self.embedding[...], tokens, jnp.dtype(self.cfg.dtype))
        return constrain(x, ("batch", "seq", "embed"))

    def context(
        self, seq_len: int, segment_ids: jax.Array | None = None, positions: jax.Array | None = None
    ) -> Context:
        if positions is None:
            positions = jnp.arange(seq_len)[None] if segment_ids is None else segment_positions(segment_ids)
        return Context(Rope.at(positions, rope_frequencies(self.cfg)), segment_ids)

    def layer_stack(self, context: Context) -> tuple[Callable, Any]:
        """One layer as a function of (x, that layer's params), with the remat policy applied, and the stacked
        params (as the module holds them: what `scan_layers` needs to hand pipeline stages their rows)."""
        return layer_function(self.blocks, context, self.cfg.remat)

    def head_matrix(self) -> tuple[jax.Array, str]:
        """The output head's weights and their layout: (D, V) "dv", or the tied embedding (V, D) "vd"."""
        return (self.embedding[...], "vd") if self.cfg.tie_embeddings else (self.head[...], "dv")

    def unembed(self, x: jax.Array) -> jax.Array:  # x: (B, T, D) -> logits (B, T, V) float32
        x = rms_norm(x, self.final_norm[...], self.cfg.norm_eps)
        weights, layout = self.head_matrix()
        logits = jnp.einsum(f"btd,{layout}->btv", x, weights.astype(x.dtype)).astype(jnp.float32)
        return constrain(logits, ("batch", "seq", "vocab"))

    def loss(self, batch: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Mean next-token cross-entropy (nats/token). batch["tokens"]: (B, T + 1); optional
        batch["segment_ids"] (B, T + 1), 0 for padding: targets in another document than their input, or padding,
        do not count. The positions are in the devices' sequence layout (`jaxtrain.ops.sequence`)."""
        batch = next_tokens(batch)
        hidden = self.hidden(batch.inputs, batch.segment_ids, batch.positions)
        return self.next_token_loss(hidden, batch.targets, batch.weights), {}

    def target_log_probs(self, batch: dict[str, jax.Array]) -> jax.Array:
        """The log-probability the model gives each next token of batch["tokens"] (B, T + 1): (B, T) float32, in the
        natural order whatever the devices' sequence layout; `segment_ids` as for `loss`. What preference and
        reinforcement-learning losses weigh (`jaxtrain.posttrain`); computed a chunk of positions at a time."""
        laid_out = next_tokens(batch)
        hidden = self.hidden(laid_out.inputs, laid_out.segment_ids, laid_out.positions)
        x, head, layout, chunk_len = self.head_inputs(hidden)
        return natural_order(target_log_probs(x, head, laid_out.targets, head_layout=layout, chunk_len=chunk_len))

    def next_token_loss(self, hidden: jax.Array, targets: jax.Array, weights: jax.Array | None = None) -> jax.Array:
        """Mean cross-entropy, weighted, of the head's logits of `hidden` (B, T, D), the last block's output,
        against `targets` (B, T), the next tokens. Computed a chunk of positions at a time, so the (B, T, V)
        logits are never held at once (`jaxtrain.ops.cross_entropy`); equal to the loss of `unembed`'s logits."""
        x, head, layout, chunk_len = self.head_inputs(hidden)
        total, count = output_cross_entropy(x, head, targets, weights=weights, head_layout=layout, chunk_len=chunk_len)
        return total / jnp.maximum(count, 1.0)

    def head_inputs(self, hidden: jax.Array) -> tuple[jax.Array, jax.Array, str, int | None]:
        """What the output head's chunked kernels take: the final-normed `hidden`, the head and its layout, and the
        positions per chunk (None: the kernel's default; the whole sequence, one chunk, is the plain program)."""
        x = rms_norm(hidden, self.final_norm[...], self.cfg.norm_eps)
        chunked = self.cfg.chunked_loss and self.cfg.kernels == "fused"
        return (x, *self.head_matrix(), None if chunked else x.shape[1])

    def init_cache(self, batch_size: int, max_len: int) -> dict[str, jax.Array]:
        """An empty KV cache for `max_len` positions of `batch_size` rows: {"k", "v"}: (L, B, S, G, K)."""
        cfg = self.cfg
        shape = (cfg.n_layers, batch_size, max_len, cfg.kv_heads, cfg.head_channels)
        return {name: constrain(jnp.zeros(shape, jnp.dtype(cfg.dtype)), CACHE_NAMES) for name in ("k", "v")}

    def cache_names(self) -> dict[str, tuple[str, ...]]:
        """The KV cache's logical dim names, for laying it out by the sharding rules."""
        return {"k": CACHE_NAMES, "v": CACHE_NAMES}

    def extend(
        self, tokens: jax.Array, positions: jax.Array, cache: dict[str, jax.Array]
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Run N new tokens per row, (B, N) at `positions` (B, N, contiguous per row), over the KV cache: their
        logits (B, N, V) float32 and the cache with their keys and values written at those slots."""
        block_def, block_params = nnx.split(self.blocks)
        rope = Rope.at(positions, rope_frequencies(self.cfg))

        def layer(x, params_and_cache):
            params, layer_cache = params_and_cache
            return nnx.merge(block_def, params).decode(x, rope, layer_cache, positions)

        x, cache = jax.lax.scan(layer, self.embed(tokens), (block_params, cache))
        return self.unembed(x), {name: constrain(value, CACHE_NAMES) for name, value in cache.items()}
