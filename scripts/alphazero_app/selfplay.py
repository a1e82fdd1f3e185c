"""AlphaZero self-play and matches on a two-player `pgx` game, with `mctx`'s Gumbel MuZero search, batched over games.

The network is any `forward(params, observation) -> (logits, value)` (value for the player to move, in [-1, 1]).
Every function is pure and jitted by its caller: the games of a batch depend only on their own keys, so their
moves do not depend on how the batch is split over devices.

    >>> games = self_play(forward, env, params, jax.random.key(0), games=64, simulations=32)     # doctest: +SKIP
    >>> rows = training_rows(jax.device_get(games))   # observation, policy and value targets    # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import mctx
import numpy as np

PyTree = Any
Forward = Callable[[PyTree, jax.Array], tuple[jax.Array, jax.Array]]


def _masked(logits: jax.Array, legal: jax.Array) -> jax.Array:
    return jnp.where(legal, logits - jnp.max(logits, axis=-1, keepdims=True), jnp.finfo(logits.dtype).min)


def search(forward: Forward, env: Any, params: PyTree, key: jax.Array, state: Any, simulations: int) -> Any:
    """mctx's Gumbel MuZero search from each game's `state`, with the game's own rules as the model of the world.
    Returns mctx's `PolicyOutput` (`action`, `action_weights`)."""

    def recurrent(params, _key, action, state):
        mover = state.current_player
        state = jax.vmap(env.step)(state, action)
        logits, value = forward(params, state.observation)
        reward = state.rewards[jnp.arange(state.rewards.shape[0]), mover]
        value = jnp.where(state.terminated, 0.0, value)
        discount = jnp.where(state.terminated, 0.0, -1.0)  # the next player is the opponent: values flip sign
        prior = _masked(logits, state.legal_action_mask)
        return mctx.RecurrentFnOutput(reward=reward, discount=discount, prior_logits=prior, value=value), state

    logits, value = forward(params, state.observation)
    legal = state.legal_action_mask | state.terminated[:, None]  # a finished game searches anything, unused
    root = mctx.RootFnOutput(prior_logits=_masked(logits, legal), value=value, embedding=state)
    return mctx.gumbel_muzero_policy(
        params, key, root, recurrent, num_simulations=simulations, invalid_actions=~legal,
        qtransform=mctx.qtransform_completed_by_mix_value,
    )  # fmt: skip


def self_play(
    forward: Forward, env: Any, params: PyTree, key: jax.Array, games: int, simulations: int, max_moves: int = 42
) -> dict[str, jax.Array]:
    """`games` games of the network against itself, `max_moves` moves each (42 fills a Connect Four board). Returns
    per move (T, B, ...): observation, policy (the search's visit distribution), player, valid (the game was still
    on), action; and per game (B, 2): outcome, each player's total reward."""
    init_key, key = jax.random.split(key)
    state = jax.vmap(env.init)(jax.random.split(init_key, games))

    def move(state, key):
        policy = search(forward, env, params, key, state, simulations)
        record = {
            "observation": state.observation,
            "policy": policy.action_weights,
            "action": policy.action,
            "player": state.current_player,
            "valid": ~state.terminated,
        }
        state = jax.vmap(env.step)(state, policy.action)
        return state, {**record, "rewards": state.rewards}

    _, moves = jax.lax.scan(move, state, jax.random.split(key, max_moves))
    rewards = moves.pop("rewards")
    return {**moves, "outcome": rewards.sum(axis=0)}


def training_rows(games: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Self-play's valid moves as training rows: observation, policy target, and value target (the game's outcome
    for the player who moved)."""
    outcome = np.take_along_axis(games["outcome"][None], games["player"][..., None].astype(np.int64), axis=-1)[..., 0]
    valid = games["valid"]
    return {
        "observation": games["observation"][valid].astype(np.float32),
        "policy": games["policy"][valid].astype(np.float32),
        "value": outcome[valid].astype(np.float32),
    }


def match(
    forward: Forward,
    env: Any,
    params: PyTree,
    opponent: PyTree | None,
    key: jax.Array,
    games: int,
    simulations: int,
    max_moves: int = 42,
) -> jax.Array:
    """`games` games of the network (`params`) against `opponent` (other params, searched alike; None: uniformly
    random legal moves); the network moves first in the even-numbered games. Returns its score per game: 1 win,
    0.5 draw, 0 loss."""
    init_key, key = jax.random.split(key)
    state = jax.vmap(env.init)(jax.random.split(init_key, games))
    # pgx draws who starts: the network is that player in the even-numbered games, the other in the odd ones.
    side = jnp.where(jnp.arange(games) % 2 == 0, state.current_player, 1 - state.current_player)

    def move(carry, key):
        state, score = carry
        search_key, other_key = jax.random.split(key)
        mine = search(forward, env, params, search_key, state, simulations).action
        if opponent is None:
            theirs = jax.random.categorical(other_key, jnp.log(state.legal_action_mask.astype(jnp.float32)))
        else:
            theirs = search(forward, env, opponent, other_key, state, simulations).action
        state = jax.vmap(env.step)(state, jnp.where(state.current_player == side, mine, theirs))
        score = score + state.rewards[jnp.arange(games), side]
        return (state, score), None

    (_, score), _ = jax.lax.scan(move, (state, jnp.zeros(games)), jax.random.split(key, max_moves))
    return (score + 1) / 2
