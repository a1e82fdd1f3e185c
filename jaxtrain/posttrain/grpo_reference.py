"""GRPO's reference log-probs (`grpo.beta` > 0): each batch of rollouts' once, before its optimizer steps, not in each
of them (the reference does not train, so `grpo.num_iterations` steps would compute the same values again).

- With adapters the reference is the train state's own params with the adapters switched off: the base weights,
  which never train (`AdaptedModel.reference_module`); no copy.
- Without, it is a frozen copy of the run's starting weights, held on the mesh in the params' shardings beside the
  trained ones: TRL's reference model, one more copy of the params and no optimizer state. A resumed run makes its
  starting weights again (its seed's initialisation, or `checkpoint.restore`'s), so its reference is the
  uninterrupted run's.

The batch carries them as `reference_log_probs` (B, T), in the train step's sharding of the batch.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxtrain.posttrain.grpo import REFERENCE_KEY
from jaxtrain.training.recovery import initial_state
from jaxtrain.training.setup import Run

PyTree = Any


class ReferenceLogProbs:
    """`reference.attach(params, batch) -> batch` with the reference's log-probs of the batch's tokens added, on the
    run's mesh; `params` the train state's (read only with adapters)."""

    def __init__(self, run: Run, batch_shardings: dict[str, jax.sharding.Sharding], state: PyTree, step: int):
        """`batch_shardings`: the train step's, of each array of a batch of rollouts (`rollouts.batch_shardings`);
        `state`: the train state at `step`, where the run starts or resumes."""
        shardings, model = run.shardings, run.shardings.model
        self.frozen = None if model.freezes else _starting_params(run, state, step)

        def log_probs(params: PyTree, tokens: jax.Array) -> jax.Array:
            module = model.reference_module(params) if model.freezes else model.module(params)
            return module.target_log_probs({"tokens": tokens})

        shape = (run.cfg.data.batch_size, run.cfg.data.seq_len + 1)
        tokens = jax.ShapeDtypeStruct(shape, "int32", sharding=batch_shardings["tokens"])
        self.compiled = shardings.compile(
            log_probs,
            shardings.abstract_state["params"],
            tokens,
            donate_state=False,
            out_shardings=batch_shardings[REFERENCE_KEY],
        )

    def attach(self, params: PyTree, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
        """`batch` (on the mesh) with its `reference_log_probs`."""
        reference = self.frozen if self.frozen is not None else params
        return {**batch, REFERENCE_KEY: self.compiled(reference, batch["tokens"])}


def _starting_params(run: Run, state: PyTree, step: int) -> PyTree:
    """The run's starting weights: a copy of `state`'s at step 0 (each step donates the state's own); a resumed run's
    made again as the run made them (its seed's initialisation, or `checkpoint.restore`'s)."""
    if step == 0:
        return jax.tree.map(jnp.copy, state["params"])  # in the params' shardings, on the mesh
    return initial_state(run, None, log=lambda *_: None)[0]["params"]
