"""A decoder-only transformer (GPT): pre-norm (RMSNorm), rotary positions, causal attention, GELU MLP.

Layers are stacked along a leading `layers` dim and run with `lax.scan` (or, under pipeline parallelism, a pipeline
schedule), so compile time does not grow with depth.
Every parameter names its dims (`embed`, `heads`, `kv`, `mlp`, `vocab`, `layers`); the mapping to devices lives
outside the model. Parameters are float32; `dtype` is the compute dtype (bfloat16 on TPU/GPU).

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> with nnx.use_eager_sharding(False):
    ...     model = GPT(PRESETS["tiny"](), nnx.Rngs(0))
    >>> model(jnp.zeros((2, 16), jnp.int32)).shape
    (2, 16, 256)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxtrain.errors import ConfigError
from jaxtrain.settings import COMPUTE_DTYPES, Settings, setting
from jaxtrain.sharding.constraints import constrain, scan_layers

REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


@dataclasses.dataclass(frozen=True)
class GPTConfig(Settings):
    section: ClassVar[str] = "model"

    vocab_size: int = setting(256, "token ids", at_least=1)
    n_layers: int = setting(4, "transformer blocks", at_least=1)
    d_model: int = setting(256, "the residual stream's width", at_least=1)
    n_heads: int = setting(4, "attention heads; they split d_model", at_least=1)
    d_ff: int = setting(1024, "the MLP's hidden width", at_least=1)
    dtype: str = setting("bfloat16", "compute dtype; params stay float32", choices=COMPUTE_DTYPES)
    remat: str = setting("none", "what the backward pass recomputes per block", choices=REMAT_POLICIES)
    rope_base: float = setting(10_000.0, "rotary positions' base wavelength", above=0)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def __post_init__(self):
        super().__post_init__()
        # Rotary positions turn pairs of a head's channels: each head needs an even number of them.
        if self.d_model % self.n_heads or self.head_dim % 2:
            fits = [h for h in range(1, min(self.d_model, 64) + 1) if self.d_model % (2 * h) == 0]
            fix = f"use n_heads in {', '.join(map(str, fits))}" if fits else "use an even d_model"
            raise ConfigError(
                f"d_model={self.d_model} must be divisible by n_heads={self.n_heads} into an even number of channels "
                f"per head (rotary positions turn pairs of channels): with d_model={self.d_model}, {fix}."
            )

    def num_params(self) -> int:
        per_layer = 4 * self.d_model * self.d_model + 2 * self.d_model * self.d_ff + 2 * self.d_model
        return self.n_layers * per_layer + 2 * self.vocab_size * self.d_model + self.d_model

    def train_flops(self, batch_size: int, seq_len: int) -> float:
        """Model FLOPs of one training step: 6 x matmul params per token, plus causal attention.

        Attention per token and layer: QK^T and AV are 2 x 2*T*D forward, x3 with backward, halved by the mask.
        The embedding lookup is not a matmul and does not count.
        """
        matmul_params = self.num_params() - self.vocab_size * self.d_model - (2 * self.n_layers + 1) * self.d_model
        per_token = 6.0 * matmul_params + 6.0 * self.n_layers * seq_len * self.d_model
        return per_token * batch_size * seq_len


PRESETS = {
    "tiny": lambda: GPTConfig(vocab_size=256, n_layers=2, d_model=64, n_heads=4, d_ff=256, dtype="float32"),
    # remat=full is ~20% faster than none on CPU (less memory traffic; measured by scripts/benchmark.py variants).
    "cpu": lambda: GPTConfig(vocab_size=256, n_layers=4, d_model=256, n_heads=4, d_ff=1024, remat="full"),
    "small": lambda: GPTConfig(vocab_size=50304, n_layers=12, d_model=768, n_heads=12, d_ff=3072),
    "medium": lambda: GPTConfig(vocab_size=50304, n_layers=24, d_model=1024, n_heads=16, d_ff=4096),
    "1b": lambda: GPTConfig(vocab_size=50304, n_layers=16, d_model=2048, n_heads=16, d_ff=8192),
}


def normal_param(rngs: nnx.Rngs, shape: tuple[int, ...], names: tuple[str, ...], std: float) -> nnx.Param:
    """A float32 parameter drawn from N(0, std^2), with one logical dimension name per dimension."""
    return nnx.Param(jax.random.normal(rngs.params(), shape, jnp.float32) * std, out_sharding=names)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float = 1e-6) -> jax.Array:
    # Statistics in float32 even when the compute dtype is bfloat16.
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (normed * scale).astype(x.dtype)


def rotary_angles(seq_len: int, head_dim: int, base: float) -> tuple[jax.Array, jax.Array]:
    """sin and cos of RoPE's position-dependent angles, each (1, T, 1, K/2); computed once, shared by all layers."""
    freqs = base ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)  # (K/2,)
    angles = jnp.arange(seq_len, dtype=jnp.float32)[:, None] * freqs  # (T, K/2)
    return jnp.sin(angles)[None, :, None, :], jnp.cos(angles)[None, :, None, :]


def rotary(x: jax.Array, sin: jax.Array, cos: jax.Array) -> jax.Array:
    """Rotate pairs of channels by a position-dependent angle (RoPE). x: (B, T, H, K)."""
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)  # (B, T, H, K/2) each
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).astype(x.dtype)


def residual_std(cfg: GPTConfig) -> float:
    """Init scale of the weights that write to the residual stream: GPT-2's, shrinking with depth."""
    return 0.02 / (2 * cfg.n_layers) ** 0.5


class Block(nnx.Module):
    """One transformer layer: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
        d, h, k = cfg.d_model, cfg.n_heads, cfg.head_dim
        self.cfg = cfg
        self.attn_norm = nnx.Param(jnp.ones((d,)), out_sharding=("norm",))
        self.w_qkv = normal_param(rngs, (d, 3, h, k), ("embed", "qkv", "heads", "kv"), 0.02)
        self.w_out = normal_param(rngs, (h, k, d), ("heads", "kv", "embed"), residual_std(cfg))
        self.mlp_norm = nnx.Param(jnp.ones((d,)), out_sharding=("norm",))
        self.init_mlp(cfg, rngs)

    def init_mlp(self, cfg: GPTConfig, rngs: nnx.Rngs) -> None:
        """The MLP's weights; a subclass with another MLP (e.g. mixture-of-experts) makes its own."""
        self.w_in = normal_param(rngs, (cfg.d_model, cfg.d_ff), ("embed", "mlp"), 0.02)
        self.w_down = normal_param(rngs, (cfg.d_ff, cfg.d_model), ("mlp", "embed"), residual_std(cfg))

    def __call__(self, x: jax.Array, rope: tuple[jax.Array, jax.Array]) -> jax.Array:  # x: (B, T, D)
        x = x + self.attention(rms_norm(x, self.attn_norm[...]), rope)
        x = x + self.mlp(rms_norm(x, self.mlp_norm[...]))
        return constrain(x, ("batch", "seq", "embed"))

    def attention(self, x: jax.Array, rope: tuple[jax.Array, jax.Array]) -> jax.Array:
        dtype, head_dim = x.dtype, self.cfg.head_dim
        qkv = jnp.einsum("btd,dchk->cbthk", x, self.w_qkv[...].astype(dtype))  # (3, B, T, H, K)
        q, k, v = qkv[0], qkv[1], qkv[2]
        q, k = rotary(q, *rope), rotary(k, *rope)
        scores = jnp.einsum("bthk,bshk->bhts", q, k).astype(jnp.float32) / head_dim**0.5  # (B, H, T, T)
        seq_len = x.shape[1]
        causal = jnp.tril(jnp.ones((seq_len, seq_len), dtype=bool))
        probs = jax.nn.softmax(jnp.where(causal, scores, -1e30), axis=-1).astype(dtype)
        mixed = jnp.einsum("bhts,bshk->bthk", probs, v)  # (B, T, H, K)
        return jnp.einsum("bthk,hkd->btd", mixed, self.w_out[...].astype(dtype))

    def mlp(self, x: jax.Array) -> jax.Array:
        hidden = jax.nn.gelu(jnp.einsum("btd,df->btf", x, self.w_in[...].astype(x.dtype)))  # (B, T, F)
        hidden = constrain(hidden, ("batch", "seq", "mlp"))
        return jnp.einsum("btf,fd->btd", hidden, self.w_down[...].astype(x.dtype))


class GPT(nnx.Module):
    """Token embedding, `n_layers` stacked blocks run by `scan_layers`, final norm and an untied output head."""

    block_type: type[Block] = Block  # what a subclass stacks instead (e.g. mixture-of-experts blocks)

    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embedding = normal_param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), 0.02)

        @nnx.split_rngs(splits=cfg.n_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make_blocks(rngs: nnx.Rngs) -> Block:
            return self.block_type(cfg, rngs)

        self.blocks = make_blocks(rngs)
        self.final_norm = nnx.Param(jnp.ones((cfg.d_model,)), out_sharding=("norm",))
        self.head = normal_param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), 0.02)

    def __call__(self, tokens: jax.Array) -> jax.Array:  # tokens: (B, T) -> logits (B, T, V) float32
        layer, block_params = self.layer_stack(tokens.shape[1])
        return self.unembed(scan_layers(layer, self.embed(tokens), block_params))

    def embed(self, tokens: jax.Array) -> jax.Array:  # tokens: (B, T) -> (B, T, D) in the compute dtype
        x = jnp.take(self.embedding[...], tokens, axis=0).astype(jnp.dtype(self.cfg.dtype))
        return constrain(x, ("batch", "seq", "embed"))

    def layer_stack(self, seq_len: int) -> tuple[Callable, Any]:
        """One layer as a function of (x, that layer's params), with the remat policy applied, and the stacked
        params (as the module holds them: what `scan_layers` needs to hand pipeline stages their rows)."""
        block_def, block_params = nnx.split(self.blocks)
        rope = rotary_angles(seq_len, self.cfg.head_dim, self.cfg.rope_base)

        def layer(x, params):
            return nnx.merge(block_def, params)(x, rope)

        if self.cfg.remat != "none":
            layer = jax.checkpoint(layer, policy=REMAT_POLICIES[self.cfg.remat], prevent_cse=False)
        return layer, block_params

    def unembed(self, x: jax.Array) -> jax.Array:  # x: (B, T, D) -> logits (B, T, V) float32
        x = rms_norm(x, self.final_norm[...])
        logits = jnp.einsum("btd,dv->btv", x, self.head[...].astype(x.dtype)).astype(jnp.float32)
        return constrain(logits, ("batch", "seq", "vocab"))

    def loss(self, batch: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Mean next-token cross-entropy (nats/token). batch["tokens"]: (B, T + 1)."""
        tokens = batch["tokens"]
        return self.next_token_loss(self(tokens[:, :-1]), tokens), {}

    def next_token_loss(self, logits: jax.Array, tokens: jax.Array) -> jax.Array:
        """Mean cross-entropy of `logits` (B, T, V) against the next tokens, tokens[:, 1:] (B, T)."""
        # One-hot rather than integer labels: with the vocabulary split over devices, picking each label's logit
        # is a gather XLA cannot partition inside the pipeline's partly manual shard_map; a masked sum can.
        targets = jax.nn.one_hot(tokens[:, 1:], self.cfg.vocab_size, dtype=logits.dtype)
        return optax.softmax_cross_entropy(logits, constrain(targets, ("batch", "seq", "vocab"))).mean()
