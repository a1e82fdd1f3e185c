"""Encoder-only transformers (BERT): bidirectional attention, a masked-language-model head and a classification head.

A block attends in both directions, within each row's documents (`segment_ids`, 0 is padding), then runs its MLP:
post-norm as BERT, x = LN(x + attention(x)), x = LN(x + mlp(x)); or pre-norm, x + attention(LN(x)), x + mlp(LN(x))
with a final LN. LayerNorm has a scale and a bias and every projection a bias, as BERT's. Positions are a learned
table (BERT) or rotary (as the decoder's, `models/gpt.py`); token types (BERT's sentence A/B) add an embedding.

Two models share the encoder:
- `MaskedLM` (task "mlm"): the MLM head (dense, GELU, LN, then the token embedding transposed plus a bias) scored
  on the positions the data masked (`jaxtrain.data.masking`).
- `Classifier` (task "text_classification"): the first token's output (BERT's [CLS]) or the mean over a row's
  tokens, through BERT's pooler (dense, tanh) and a linear classifier.

Layers are stacked along `layers` and scanned, every parameter names its dims, and the model knows nothing about
meshes: under context parallelism the batch is laid out along the sequence like a decoder's
(`jaxtrain.ops.sequence`), and attention, having no causal order to balance, sees every key block.

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> with nnx.use_eager_sharding(False):
    ...     model = MaskedLM(PRESETS["tiny"](), nnx.Rngs(0))
    >>> model(jnp.zeros((2, 16), jnp.int32)).shape
    (2, 16, 320)
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxtrain.errors import ConfigError
from jaxtrain.ops.attention import CONTEXT_PARALLEL, IMPLEMENTATIONS, attention
from jaxtrain.ops.embedding import lookup
from jaxtrain.ops.plain import KERNELS, KERNELS_HELP
from jaxtrain.ops.projection import REMAT_POLICIES, project
from jaxtrain.ops.sequence import laid_out, natural_order, segment_positions, sequence_order
from jaxtrain.settings import COMPUTE_DTYPES, Settings, setting
from jaxtrain.sharding.constraints import constrain, scan_layers

from .gpt import Rope, constant_param, layer_function, normal_param, rope_frequencies, stacked_blocks

POSITIONS = ("learned", "rotary")
NORMS = ("post", "pre")
POOLINGS = ("first", "mean")


@dataclasses.dataclass(frozen=True)
class EncoderConfig(Settings):
    section: ClassVar[str] = "model"

    vocab_size: int = setting(
        320, "token ids (byte-level text: 256 bytes and the specials of jaxtrain.data)", at_least=1
    )
    n_layers: int = setting(2, "transformer blocks", at_least=1)
    d_model: int = setting(64, "the residual stream's width", at_least=1)
    n_heads: int = setting(4, "attention heads", at_least=1)
    d_ff: int = setting(256, "the MLP's hidden width", at_least=1)
    positions: str = setting("learned", "learned: a table of max_positions (BERT); rotary: RoPE", choices=POSITIONS)
    max_positions: int = setting(512, "positions.learned: the longest sequence the table covers", at_least=1)
    rope_base: float = setting(10_000.0, "positions.rotary: the base wavelength", above=0)
    type_vocab_size: int = setting(2, "token types (BERT's sentence A and B); 0: none", at_least=0)
    norm: str = setting("post", "post: LN(x + f(x)) (BERT); pre: x + f(LN(x)) with a final LN", choices=NORMS)
    norm_eps: float = setting(1e-12, "LayerNorm's epsilon", above=0)
    init_std: float = setting(0.02, "the weights' initial standard deviation (BERT's initializer_range)", above=0)
    gelu_approximate: bool = setting(False, "the MLP's GELU in its tanh form (HF gelu_new) rather than erf (gelu)")
    dtype: str = setting("float32", "compute dtype; params stay float32", choices=COMPUTE_DTYPES)
    remat: str = setting("none", "what the backward pass recomputes per block", choices=REMAT_POLICIES)
    attention: str = setting("auto", "how attention is computed (jaxtrain.ops.attention)", choices=IMPLEMENTATIONS)
    context_parallel: str = setting(
        "allgather",
        "attention where the mesh splits the sequence (a context axis): ring or allgather",
        choices=CONTEXT_PARALLEL,
    )
    kernels: str = setting("fused", KERNELS_HELP, choices=KERNELS)

    rope_scaling: ClassVar[str] = "none"  # what `rope_frequencies` reads: encoders use plain RoPE

    @property
    def head_channels(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        """Every head has its own keys and values (what the planner's context-parallel bytes read)."""
        return self.n_heads

    def __post_init__(self):
        super().__post_init__()
        if self.d_model % self.n_heads:
            fits = [h for h in range(1, min(self.d_model, 64) + 1) if self.d_model % h == 0]
            raise ConfigError(
                f"d_model={self.d_model} must be divisible by n_heads={self.n_heads}: use n_heads in "
                f"{', '.join(map(str, fits))}."
            )
        if self.positions == "rotary" and self.head_channels % 2:
            raise ConfigError(
                f"positions=rotary turns pairs of a head's channels, but d_model / n_heads = {self.head_channels} is "
                f"odd: use an even d_model / n_heads, or positions=learned."
            )

    def layer_matmul_params(self) -> int:
        return 4 * self.d_model * self.d_model + 2 * self.d_model * self.d_ff

    def num_params(self) -> int:
        d, f = self.d_model, self.d_ff
        per_layer = self.layer_matmul_params() + 5 * d + f + 4 * d  # biases; two LayerNorms
        tables = (self.vocab_size + self.type_vocab_size) * d + self.max_positions * d * (self.positions == "learned")
        head = d * d + 3 * d + self.vocab_size  # the MLM transform, its LayerNorm, the output bias
        final = 2 * d * (self.norm == "pre")
        return self.n_layers * per_layer + tables + 2 * d + final + head

    def train_flops(self, batch_size: int, seq_len: int, weight_gradients: bool = True) -> float:
        """Model FLOPs of an MLM training step: 6 x matmul params per token (4 with the weights frozen), the MLM
        head's transform and tied output matmul on every position, and attention over every key (no causal half):
        QK^T and AV, 2 x 2*T*D forward, x3 with backward."""
        matmuls = (
            self.n_layers * self.layer_matmul_params() + self.d_model * self.d_model + self.vocab_size * self.d_model
        )
        per_token = (4.0 + 2.0 * weight_gradients) * matmuls + 12.0 * self.n_layers * seq_len * self.d_model
        return per_token * batch_size * seq_len


@dataclasses.dataclass(frozen=True)
class ClassifierConfig(EncoderConfig):
    """An encoder with BERT's pooler and a classifier of `n_classes` in place of the MLM head."""

    n_classes: int = setting(2, "the classes a label may name, 0..n_classes-1", at_least=2)
    pooling: str = setting("first", "what the classifier reads: the first token ([CLS]) or the mean", choices=POOLINGS)

    def num_params(self) -> int:
        d = self.d_model
        mlm_head = d * d + 3 * d + self.vocab_size
        return super().num_params() - mlm_head + d * d + d + (d + 1) * self.n_classes

    def train_flops(self, batch_size: int, seq_len: int, weight_gradients: bool = True) -> float:
        """As the encoder's, without the MLM head; the pooler and classifier run once per row."""
        per_row_head = (4.0 + 2.0 * weight_gradients) * (self.d_model * self.d_model + self.d_model * self.n_classes)
        mlm_head = (4.0 + 2.0 * weight_gradients) * (self.d_model * self.d_model + self.vocab_size * self.d_model)
        encoder = super().train_flops(batch_size, seq_len, weight_gradients) - mlm_head * batch_size * seq_len
        return encoder + per_row_head * batch_size


PRESETS = {
    # BERT's 0.02 is for d_model 768: at d_model 64 it leaves attention near uniform for hundreds of steps
    # (docs/encoders.md), so the test model starts at 0.1, near 1/sqrt(d_model).
    "tiny": lambda: EncoderConfig(init_std=0.1),
    "cpu": lambda: EncoderConfig(n_layers=4, d_model=256, n_heads=4, d_ff=1024),
    # BERT-base and BERT-large, shape for shape (bert-base-uncased's vocabulary).
    "base": lambda: EncoderConfig(vocab_size=30_522, n_layers=12, d_model=768, n_heads=12, d_ff=3072, dtype="bfloat16"),
    "large": lambda: EncoderConfig(
        vocab_size=30_522, n_layers=24, d_model=1024, n_heads=16, d_ff=4096, dtype="bfloat16"
    ),
}
CLASSIFIER_PRESETS = {
    name: (lambda make=make: ClassifierConfig(**dataclasses.asdict(make()))) for name, make in PRESETS.items()
}


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, eps: float) -> jax.Array:
    # Statistics in float32 even when the compute dtype is bfloat16.
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    centred = x32 - mean
    normed = centred * jax.lax.rsqrt(jnp.mean(centred * centred, axis=-1, keepdims=True) + eps)
    return (normed * scale + bias).astype(x.dtype)


class Norm(nnx.Module):
    """LayerNorm's scale and bias over the model width."""

    def __init__(self, cfg: EncoderConfig):
        self.scale = constant_param(1.0, (cfg.d_model,), ("norm",))
        self.bias = constant_param(0.0, (cfg.d_model,), ("norm",))
        self.eps = cfg.norm_eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return layer_norm(x, self.scale[...], self.bias[...], self.eps)


class Context(NamedTuple):
    """What every layer sees besides the activations: rotary angles (None with a learned table), the documents."""

    rope: Rope | None
    segment_ids: jax.Array | None  # (B, T), 0 is padding


def _biased(x: jax.Array, bias: nnx.Param) -> jax.Array:
    return x + bias[...].astype(x.dtype)


class Block(nnx.Module):
    """One encoder layer: bidirectional attention and an MLP, each with its LayerNorm (post or pre)."""

    def __init__(self, cfg: EncoderConfig, rngs: nnx.Rngs):
        d, h, k = cfg.d_model, cfg.n_heads, cfg.head_channels
        self.cfg = cfg
        self.w_q, self.w_k, self.w_v = (
            normal_param(rngs, (d, h, k), ("embed", "heads", "kv"), cfg.init_std) for _ in "qkv"
        )
        self.b_q, self.b_k, self.b_v = (constant_param(0.0, (h, k), ("heads", "kv")) for _ in "qkv")
        self.w_out = normal_param(rngs, (h, k, d), ("heads", "kv", "embed"), cfg.init_std)
        self.b_out = constant_param(0.0, (d,), ("norm",))
        self.attn_norm = Norm(cfg)
        self.w_in = normal_param(rngs, (d, cfg.d_ff), ("embed", "mlp"), cfg.init_std)
        self.b_in = constant_param(0.0, (cfg.d_ff,), ("mlp",))
        self.w_down = normal_param(rngs, (cfg.d_ff, d), ("mlp", "embed"), cfg.init_std)
        self.b_down = constant_param(0.0, (d,), ("norm",))
        self.mlp_norm = Norm(cfg)

    def __call__(self, x: jax.Array, context: Context) -> jax.Array:  # x: (B, T, D)
        if self.cfg.norm == "pre":
            x = x + self.attend(self.attn_norm(x), context)
            x = x + self.mlp(self.mlp_norm(x))
        else:
            x = self.attn_norm(x + self.attend(x, context))
            x = self.mlp_norm(x + self.mlp(x))
        return constrain(x, ("batch", "seq", "embed"))

    def attend(self, x: jax.Array, context: Context) -> jax.Array:
        """Bidirectional self-attention of x (B, T, D), within documents where the context has them."""
        q, k, v = (_biased(project("btd,dhk->bthk", x, w[...]), b) for w, b in self.qkv())
        if context.rope is not None:
            q, k = context.rope.rotate(q), context.rope.rotate(k)
        q, k, v = (constrain(y, ("batch", "seq", "heads", "kv")) for y in (q, k, v))
        cfg = self.cfg
        mixed = attention(
            q, k, v, implementation=cfg.attention, segment_ids=context.segment_ids, causal=False,
            context_parallel=cfg.context_parallel, kernels=cfg.kernels,
        )  # fmt: skip
        return _biased(project("bthk,hkd->btd", mixed, self.w_out[...]), self.b_out)

    def qkv(self) -> tuple[tuple[nnx.Param, nnx.Param], ...]:
        return (self.w_q, self.b_q), (self.w_k, self.b_k), (self.w_v, self.b_v)

    def mlp(self, x: jax.Array) -> jax.Array:
        hidden = _biased(project("btd,df->btf", x, self.w_in[...]), self.b_in)  # (B, T, F)
        hidden = constrain(jax.nn.gelu(hidden, approximate=self.cfg.gelu_approximate), ("batch", "seq", "mlp"))
        return _biased(project("btf,fd->btd", hidden, self.w_down[...]), self.b_down)


class EncoderBatch(NamedTuple):
    """An encoder's inputs, every field (B, T) in the devices' sequence layout (`jaxtrain.ops.sequence`)."""

    tokens: jax.Array
    positions: jax.Array  # each token's position in its document; (1, T) when the rows share them
    segment_ids: jax.Array | None = None
    token_types: jax.Array | None = None


def encoder_batch(batch: dict[str, jax.Array]) -> EncoderBatch:
    """The inputs of a batch {"tokens": (B, T), optional "segment_ids" (0: padding), optional "token_types" (absent
    or None)}, laid out along the sequence as the active mesh splits it. Positions restart at each document of a
    packed row."""
    tokens, segments = batch["tokens"], batch.get("segment_ids")
    order = sequence_order(tokens.shape[1])
    positions = jnp.asarray(order)[None] if segments is None else laid_out(segment_positions(segments))
    optional = (laid_out(x) if x is not None else None for x in (segments, batch.get("token_types")))
    return EncoderBatch(laid_out(tokens), positions, *optional)


class Encoder(nnx.Module):
    """Token, position and type embeddings with their LayerNorm, then `n_layers` stacked blocks (and, pre-norm, a
    final LayerNorm): the residual stream a head reads."""

    def __init__(self, cfg: EncoderConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embedding = normal_param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), cfg.init_std)
        if cfg.positions == "learned":
            self.position_embedding = normal_param(
                rngs, (cfg.max_positions, cfg.d_model), (None, "embed"), cfg.init_std
            )
        if cfg.type_vocab_size:
            self.type_embedding = normal_param(rngs, (cfg.type_vocab_size, cfg.d_model), (None, "embed"), cfg.init_std)
        self.embed_norm = Norm(cfg)

        self.blocks = stacked_blocks(lambda rngs: Block(cfg, rngs), cfg.n_layers, rngs)
        if cfg.norm == "pre":
            self.final_norm = Norm(cfg)

    def __call__(self, inputs: EncoderBatch) -> jax.Array:
        """The last block's output (B, T, D) in the compute dtype, for inputs already laid out (`encoder_batch`)."""
        layer, block_params = layer_function(self.blocks, self.context(inputs), self.cfg.remat)
        x = scan_layers(layer, self.embed(inputs), block_params)
        return self.final_norm(x) if self.cfg.norm == "pre" else x

    def embed(self, inputs: EncoderBatch) -> jax.Array:  # -> (B, T, D)
        cfg, dtype = self.cfg, jnp.dtype(self.cfg.dtype)
        x = lookup(self.embedding[...], inputs.tokens, dtype)
        if cfg.positions == "learned":
            self._check_length(inputs.tokens.shape[1])
            x = x + lookup(self.position_embedding[...], inputs.positions, dtype)
        if cfg.type_vocab_size:
            types = jnp.zeros_like(inputs.tokens) if inputs.token_types is None else inputs.token_types
            x = x + lookup(self.type_embedding[...], types, dtype)
        return constrain(self.embed_norm(x), ("batch", "seq", "embed"))

    def _check_length(self, seq_len: int) -> None:
        if seq_len > self.cfg.max_positions:
            raise ConfigError(
                f"sequences of {seq_len} tokens, but the learned position table has max_positions="
                f"{self.cfg.max_positions}: use data.seq_len <= {self.cfg.max_positions}, a larger max_positions, or "
                "positions=rotary."
            )

    def context(self, inputs: EncoderBatch) -> Context:
        rope = Rope.at(inputs.positions, rope_frequencies(self.cfg)) if self.cfg.positions == "rotary" else None
        return Context(rope, inputs.segment_ids)


class MaskedLM(nnx.Module):
    """The encoder and BERT's MLM head: dense, GELU, LayerNorm, then the token embedding transposed plus a bias.

    batch: {"tokens": (B, T) with the masked positions replaced, "targets": (B, T) the original tokens,
    "loss_weights": (B, T) 1 where the data masked, optional "segment_ids", "token_types"}."""

    def __init__(self, cfg: EncoderConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.encoder = Encoder(cfg, rngs)
        self.w_transform = normal_param(rngs, (cfg.d_model, cfg.d_model), ("embed", "mlp"), cfg.init_std)
        self.b_transform = constant_param(0.0, (cfg.d_model,), ("mlp",))
        self.transform_norm = Norm(cfg)
        self.output_bias = constant_param(0.0, (cfg.vocab_size,), ("vocab",))

    def __call__(
        self, tokens: jax.Array, segment_ids: jax.Array | None = None, token_types: jax.Array | None = None
    ) -> jax.Array:
        """tokens (B, T) -> logits (B, T, V) float32, in the natural order whatever the devices' sequence layout."""
        batch = {"tokens": tokens, "segment_ids": segment_ids, "token_types": token_types}
        hidden = self.encoder(encoder_batch(batch))
        return natural_order(self.logits(hidden))

    def logits(self, hidden: jax.Array) -> jax.Array:  # (B, T, D) -> (B, T, V) float32
        x = _biased(jnp.einsum("btd,de->bte", hidden, self.w_transform[...].astype(hidden.dtype)), self.b_transform)
        x = self.transform_norm(jax.nn.gelu(x, approximate=self.cfg.gelu_approximate))
        logits = jnp.einsum("btd,vd->btv", x, self.encoder.embedding[...].astype(x.dtype)).astype(jnp.float32)
        return constrain(logits + self.output_bias[...], ("batch", "seq", "vocab"))

    def loss(self, batch: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Mean cross-entropy over the masked positions (nats/token), and the share of them predicted right."""
        logits = self.logits(self.encoder(encoder_batch(batch)))
        targets, weights = laid_out(batch["targets"]), laid_out(batch["loss_weights"].astype(jnp.float32))
        # The target picked by a one-hot, as the decoder's whole-logits loss does: a gather's gradient is a scatter
        # into zeroed (B, T, V) float32 buffers that XLA keeps beside the softmax's (tests/test_planner_aot.py).
        one_hot = constrain(jax.nn.one_hot(targets, logits.shape[-1], dtype=logits.dtype), ("batch", "seq", "vocab"))
        nll = optax.softmax_cross_entropy(logits, one_hot)
        count = jnp.maximum(jnp.sum(weights), 1.0)
        right = (jnp.argmax(logits, -1) == targets).astype(jnp.float32)
        return jnp.sum(nll * weights) / count, {"accuracy": jnp.sum(right * weights) / count}


class Classifier(nnx.Module):
    """The encoder, BERT's pooler (dense, tanh) on the first token or the mean over a row's tokens, and a linear
    classifier. batch: {"tokens": (B, T), "segment_ids": (B, T) 1 on tokens and 0 on padding, "labels": (B,),
    optional "token_types"}."""

    def __init__(self, cfg: ClassifierConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.encoder = Encoder(cfg, rngs)
        self.w_pool = normal_param(rngs, (cfg.d_model, cfg.d_model), ("embed", "mlp"), cfg.init_std)
        self.b_pool = constant_param(0.0, (cfg.d_model,), ("mlp",))
        self.w_classes = normal_param(rngs, (cfg.d_model, cfg.n_classes), ("mlp", "classes"), cfg.init_std)
        self.b_classes = constant_param(0.0, (cfg.n_classes,), ("classes",))

    def __call__(
        self, tokens: jax.Array, segment_ids: jax.Array | None = None, token_types: jax.Array | None = None
    ) -> jax.Array:
        """tokens (B, T) -> class logits (B, C) float32."""
        batch = {"tokens": tokens, "segment_ids": segment_ids, "token_types": token_types}
        return self.class_logits(encoder_batch(batch))

    def class_logits(self, inputs: EncoderBatch) -> jax.Array:
        hidden = self.encoder(inputs)  # (B, T, D)
        pooled = self.pool(hidden, inputs.segment_ids).astype(hidden.dtype)
        pooled = jnp.tanh(_biased(pooled @ self.w_pool[...].astype(pooled.dtype), self.b_pool))
        logits = pooled @ self.w_classes[...].astype(pooled.dtype) + self.b_classes[...].astype(pooled.dtype)
        return logits.astype(jnp.float32)

    def pool(self, hidden: jax.Array, segment_ids: jax.Array | None) -> jax.Array:  # -> (B, D)
        if self.cfg.pooling == "first":
            # The slot holding position 0, wherever the sequence layout put it.
            first = int(np.flatnonzero(sequence_order(hidden.shape[1]) == 0)[0])
            return hidden[:, first]
        weights = jnp.ones(hidden.shape[:2], jnp.float32) if segment_ids is None else (segment_ids != 0)
        weights = weights.astype(jnp.float32)[..., None]
        total = jnp.sum(hidden.astype(jnp.float32) * weights, axis=1)
        return total / jnp.maximum(jnp.sum(weights, axis=1), 1.0)

    def loss(self, batch: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Mean cross-entropy over the rows, and the share classified right."""
        logits = self.class_logits(encoder_batch(batch))
        labels = batch["labels"].astype(jnp.int32)
        nll = -jnp.take_along_axis(jax.nn.log_softmax(logits, -1), labels[:, None], axis=-1)[:, 0]
        return jnp.mean(nll), {"accuracy": jnp.mean((jnp.argmax(logits, -1) == labels).astype(jnp.float32))}
