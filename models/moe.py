"""A mixture-of-experts decoder: GPT (models/gpt.py) with each block's MLP replaced by `n_experts` expert MLPs, of
which a learned router picks `top_k` per token.

Routing (`routing=capacity`, the default) is GShard/Switch style, with a fixed capacity so every array has a static
shape; `routing=dropless` sends every token to its experts through grouped matmuls instead
(`jaxtrain.ops.expert_dispatch`: where the mesh splits the experts, the tokens travel to them and back by
all-to-all over the expert axis, by `expert_exchange`).
Tokens are routed in groups, one group per sequence: each expert takes at most
`capacity = ceil(capacity_factor * top_k * seq / n_experts)` tokens of a group, in sequence order (a token's choices
best first); the rest are dropped (they pass by on the residual path). Slots go in sequence order so that routing is
causal: what a token keeps depends on earlier tokens only. Dispatch and combine are einsums with one-hot (group,
token, expert, slot) tensors:

    x (G, S, D) --dispatch--> (E, G, C, D) --expert MLPs--> (E, G, C, D) --combine, gate-weighted--> (G, S, D)

The expert dim of the expert weights and of the dispatched tokens is `expert`; the tokens' groups are `batch`
outside the layer and `expert_group` inside it. With the rules mapping `batch` over the expert axis too and
`expert_group` without it, the dispatch and the combine each become one all-to-all over the expert axis.

A Switch-style auxiliary loss (`aux_loss_weight` x E x sum_e f_e P_e, f_e the fraction of routed tokens and P_e
the mean router probability of expert e: 1 when uniform) keeps the load balanced. The loss reports it, with the
load (`expert_load`: most tokens routed to one expert over the mean, 1 is uniform; the mean over layers) and the
fraction of routed tokens dropped for want of capacity (`dropped`).

The layers run in a `lax.scan` of the model's own, which also returns each layer's routing statistics, rather than
through `scan_layers` (whose layers return only the activations): pipeline parallelism is not supported.

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> with nnx.use_eager_sharding(False):
    ...     model = MoE(PRESETS["tiny"](), nnx.Rngs(0))
    >>> logits, stats = model(jnp.zeros((2, 16), jnp.int32))
    >>> logits.shape, stats["load"].shape  # (layers, experts)
    ((2, 16, 256), (2, 8))
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtrain.errors import ConfigError
from jaxtrain.ops.expert_dispatch import EXCHANGES, dropless_experts
from jaxtrain.ops.projection import project
from jaxtrain.ops.sequence import next_tokens
from jaxtrain.settings import setting
from jaxtrain.sharding.constraints import constrain

from .gpt import GPT, Block, Context, GPTConfig, normal_param, residual_std

ROUTINGS = ("capacity", "dropless")


@dataclasses.dataclass(frozen=True)
class MoEConfig(GPTConfig):
    """GPTConfig plus the experts; `d_ff` is each expert's hidden width."""

    n_experts: int = setting(8, "expert MLPs per block", at_least=1)
    top_k: int = setting(2, "experts per token: 1 (Switch) or 2 (GShard)", at_least=1)
    routing: str = setting(
        "capacity",
        "capacity: each expert takes at most capacity_factor x its fair share of a sequence, the rest dropped; "
        "dropless: every token reaches its top_k experts (grouped matmuls, jax.lax.ragged_dot)",
        choices=ROUTINGS,
    )
    expert_exchange: str = setting(
        "auto",
        "how dropless routing sends tokens to experts split over devices: ragged (only the tokens routed, "
        "jax.lax.ragged_all_to_all; TPU, GPU), padded (buffers sized for the worst case; any backend), auto (ragged, "
        "padded on CPU)",
        choices=EXCHANGES,
    )
    # Slots per expert over its fair share; n_experts / top_k never drops a token.
    capacity_factor: float = setting(1.25, "slots per expert over its fair share (routing=capacity)")
    aux_loss_weight: float = setting(0.01, "weight of the load-balancing loss", at_least=0)

    def __post_init__(self):
        super().__post_init__()
        if self.top_k > self.n_experts:
            raise ConfigError(
                f"top_k={self.top_k} must be between 1 and n_experts={self.n_experts}: a token cannot go to more "
                "experts than there are."
            )
        if self.capacity_factor <= 0:
            raise ConfigError(
                f"capacity_factor={self.capacity_factor} must be positive: each expert needs room for tokens."
            )

    def capacity(self, group_size: int) -> int:
        """Tokens each expert takes from a group of `group_size` tokens (routed `top_k` times each)."""
        return min(group_size, math.ceil(self.capacity_factor * self.top_k * group_size / self.n_experts))

    def mlp_params(self) -> int:
        """Every expert's MLP and the router."""
        return self.n_experts * 2 * self.d_model * self.d_ff + self.d_model * self.n_experts

    def train_flops(self, batch_size: int, seq_len: int, weight_gradients: bool = True) -> float:
        """Model FLOPs of one training step, counted as GPTConfig's: 6 x the matmul weights a token uses (attention,
        the router, its `top_k` experts, the head; 4 x without `weight_gradients`), plus causal attention. Unused
        capacity and the one-hot dispatch and combine einsums are overhead, not model FLOPs."""
        d = self.d_model
        per_layer = self.attention_matmul_params() + d * self.n_experts + self.top_k * 2 * d * self.d_ff
        attention = 6.0 * self.n_layers * seq_len * self.n_heads * self.head_channels
        per_token = (4.0 + 2.0 * weight_gradients) * (self.n_layers * per_layer + d * self.vocab_size) + attention
        return per_token * batch_size * seq_len


PRESETS = {
    "tiny": lambda: MoEConfig(vocab_size=256, n_layers=2, d_model=64, n_heads=4, d_ff=128, dtype="float32"),
    "cpu": lambda: MoEConfig(vocab_size=256, n_layers=4, d_model=256, n_heads=4, d_ff=512, remat="full"),
    # Mixtral-like proportions at GPT-2 small's width: 8 experts, 2 per token.
    "small": lambda: MoEConfig(vocab_size=50304, n_layers=12, d_model=768, n_heads=12, d_ff=3072),
}


def top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """The k largest entries of the last dim and their indices, largest first, as `jax.lax.top_k`, by k argmaxes:
    XLA partitions a reduction over a batch sharded on devices, but gathers every token onto every device for the
    TopK custom call."""
    values, indices = [], []
    for _ in range(k):
        index = jnp.argmax(x, axis=-1)
        values.append(jnp.take_along_axis(x, index[..., None], axis=-1)[..., 0])
        indices.append(index)
        x = jnp.where(jax.nn.one_hot(index, x.shape[-1], dtype=bool), -jnp.inf, x)
    return jnp.stack(values, axis=-1), jnp.stack(indices, axis=-1)


def choose(logits: jax.Array, k: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Router probabilities (G, S, E) from logits, and each token's `k` experts, best first (G, S, K) with their gates:
    their probabilities, renormalised over the k choices when k > 1."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    gates, choice = top_k(probs, k)
    if k > 1:
        gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
    return probs, gates, choice


def balance_loss(probs: jax.Array, routed: jax.Array, k: int) -> jax.Array:
    """Switch's auxiliary loss: E x sum_e f_e P_e, from the router probabilities (G, S, E) and the tokens routed to
    each expert (E,)."""
    groups, size, experts = probs.shape
    # A float, not an int: as an int32 the count overflows for the huge batches `jaxtrain plan` traces with.
    return experts * jnp.sum(routed / float(groups * size * k) * jnp.mean(probs, axis=(0, 1)))


def route(logits: jax.Array, k: int, capacity: int) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """Top-k routing with `capacity` slots per expert and group, from router logits (G, S, E).

    Returns the one-hot dispatch tensor (G, S, E, C) (token s of group g goes to slot c of expert e), the combine
    tensor (the same, weighted by the token's gate for that expert: its router probability, renormalised over its
    k choices when k > 1), and the statistics: the auxiliary loss, tokens routed to each expert (E,) before
    capacity, and the routed tokens dropped.
    """
    groups, size, experts = logits.shape
    probs, gates, choice = choose(logits, k)  # (G, S, E), (G, S, K) twice
    chosen = jax.nn.one_hot(choice, experts, dtype=jnp.float32)  # (G, S, K, E)
    # Slots in each expert's buffer go to the tokens in sequence order, each token's choices best first: what a token
    # keeps depends on earlier tokens only, so training routes as generation does, one token at a time (causal).
    # GShard's order (every first choice before any second) lets a later token's first choice push out an earlier
    # token's second.
    slot = (jnp.cumsum(chosen.reshape(groups, size * k, experts), axis=1) - 1).reshape(groups, size, k, experts)
    kept = chosen * (slot < capacity)  # (G, S, K, E)
    slots = jax.nn.one_hot(jnp.sum(slot * kept, axis=-1).astype(jnp.int32), capacity, dtype=jnp.float32)  # (G,S,K,C)
    dispatch = jnp.einsum("gske,gskc->gsec", kept, slots)
    combine = jnp.einsum("gsk,gske,gskc->gsec", gates, kept, slots)
    routed = jnp.sum(chosen, axis=(0, 1, 2))  # (E,)
    stats = {"aux": balance_loss(probs, routed, k), "load": routed, "dropped": jnp.sum(chosen) - jnp.sum(kept)}
    return dispatch, combine, stats


class MoEBlock(Block):
    """GPT's block (its attention, norms and their weights) with a router and one MLP per expert."""

    def init_mlp(self, cfg: MoEConfig, rngs: nnx.Rngs) -> None:
        d, f, e = cfg.d_model, cfg.d_ff, cfg.n_experts
        self.router = normal_param(rngs, (d, e), ("embed", "router"), 0.02)
        self.w_in = normal_param(rngs, (e, d, f), ("expert", "embed", "mlp"), 0.02)
        self.w_down = normal_param(rngs, (e, f, d), ("expert", "mlp", "embed"), residual_std(cfg))

    def __call__(self, x: jax.Array, context: Context) -> tuple[jax.Array, dict[str, jax.Array]]:
        x = x + self.attend(self.norm(x, self.attn_norm), context)
        y, stats = self.experts(self.norm(x, self.mlp_norm))
        return constrain(x + y, ("batch", "seq", "embed")), stats

    def experts(self, x: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:  # x: (G, S, D), a group a sequence
        logits = jnp.einsum("gsd,de->gse", x.astype(jnp.float32), self.router[...])  # (G, S, E)
        if self.cfg.routing == "dropless":
            return self.dropless(x, logits)
        dispatch, combine, stats = route(logits, self.cfg.top_k, self.cfg.capacity(x.shape[1]))
        dtype = x.dtype
        tokens = jnp.einsum("gsec,gsd->egcd", dispatch.astype(dtype), x)  # (E, G, C, D)
        # Sort the tokens by expert where they are, then move them (all-to-all over the expert axis). Given only
        # the second constraint, XLA instead gathered x over the expert axis on meshes with a tensor axis.
        tokens = constrain(tokens, (None, "batch", "capacity", "embed"))
        tokens = constrain(tokens, ("expert", "expert_group", "capacity", "embed"))
        # `project`: a weight gradient XLA:CPU runs at matmul speed (jaxtrain.ops.projection).
        hidden = jax.nn.gelu(project("egcd,edf->egcf", tokens, self.w_in[...]))  # (E, G, C, F)
        hidden = constrain(hidden, ("expert", "expert_group", "capacity", "mlp"))
        out = project("egcf,efd->egcd", hidden, self.w_down[...])  # (E, G, C, D)
        out = constrain(out, ("expert", "expert_group", "capacity", "embed"))
        out = constrain(out, (None, "batch", "capacity", "embed"))  # back to the tokens' devices (all-to-all)
        return jnp.einsum("egcd,gsec->gsd", out, combine.astype(dtype)), stats

    def dropless(self, x: jax.Array, logits: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Every token through its top-k experts by grouped matmuls (`jaxtrain.ops.expert_dispatch`); nothing
        dropped. Where the mesh splits the experts, the tokens reach them by all-to-all over the expert axis."""
        k = self.cfg.top_k
        probs, gates, choice = choose(logits, k)
        routed = jnp.sum(jax.nn.one_hot(choice, self.cfg.n_experts, dtype=jnp.float32), axis=(0, 1, 2))
        y = dropless_experts(x, gates, choice, self.w_in[...], self.w_down[...], exchange=self.cfg.expert_exchange)
        return y, {"aux": balance_loss(probs, routed, k), "load": routed, "dropped": jnp.zeros((), jnp.float32)}


class MoE(GPT):
    """GPT with mixture-of-experts blocks, whose layer loop also collects each layer's routing statistics."""

    block_type = MoEBlock
    # No KV-cache decoding yet: GPT's runs Block.decode, whose MLP is not the experts'. Generation says so by name.
    init_cache = cache_names = extend = None
    # No per-token log-probs yet (preference and RL losses): they would drop the router's auxiliary loss.
    target_log_probs = None

    def __call__(self, tokens: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        """tokens (B, T) -> logits (B, T, V) float32, and each layer's routing statistics (stacked, L first)."""
        hidden, stats = self.hidden_and_stats(tokens)
        return self.unembed(hidden), stats

    def hidden_and_stats(
        self, tokens: jax.Array, positions: jax.Array | None = None
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        layer, block_params = self.layer_stack(self.context(tokens.shape[1], positions=positions))
        return jax.lax.scan(layer, self.embed(tokens), block_params)

    def loss(self, batch: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Next-token cross-entropy plus `aux_loss_weight` x the mean auxiliary loss over layers. batch["tokens"]:
        (B, T + 1); optional batch["loss_weights"] (B, T + 1), each token's weight as a target (chat data). Packed
        documents (`segment_ids`) are refused: the router's capacity is shared by a row's tokens, so a document's
        routing would depend on what shares its row. Metrics: cross_entropy, aux_loss, expert_load, dropped."""
        if "segment_ids" in batch:
            raise ConfigError(
                "data.packing=segments with an MoE model: its tokens compete for expert capacity across a row, so "
                "packed documents would not be independent. Use data.packing=concat."
            )
        batch = next_tokens(batch)
        hidden, stats = self.hidden_and_stats(batch.inputs, batch.positions)
        cross_entropy = self.next_token_loss(hidden, batch.targets, batch.weights)
        aux = jnp.mean(stats["aux"])
        load = stats["load"]  # (L, E)
        metrics = {
            "cross_entropy": cross_entropy,
            "aux_loss": aux,
            "expert_load": jnp.mean(jnp.max(load, axis=-1) / jnp.mean(load, axis=-1)),
            "dropped": jnp.sum(stats["dropped"]) / jnp.sum(load),
        }
        return cross_entropy + self.cfg.aux_loss_weight * aux, metrics
