"""Where GRPO's rollouts are sampled: in the learner's process with `engine.kind=spmd` (`Rollouts`, on the run's own
mesh from its current params), on Ray's rollout workers with `engine.kind=ray`
(`jaxtrain.asynchronous.rollout_workers`: params up to `engine.max_staleness` versions old, while the learner trains).
Ray is imported only for the latter: it is an optional extra."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import jax
import numpy as np

from jaxtrain.posttrain.rewards import Reward
from jaxtrain.posttrain.rollouts import Prompts, Rollout, RolloutError, Rollouts
from jaxtrain.training.setup import Run


class Sampler(Protocol):
    """What GRPO's loop needs of its rollouts: batch `number` for the learner's params (version `number`), and a host
    batch placed in the train step's shardings. `Rollouts` and `jaxtrain.asynchronous.rollout_workers.RayRollouts`."""

    def __call__(self, params: Any, number: int) -> Rollout: ...

    def place(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]: ...


@contextlib.contextmanager
def rollout_source(
    run: Run,
    params: Any,
    prompts: Prompts,
    rewards: Sequence[Reward],
    decode: Callable[[Sequence[int]], str],
    log: Callable[[str], None] = print,
) -> Iterator[Sampler]:
    """Inside: GRPO's sampler for `run` (`sampler(params, number) -> Rollout`, `sampler.place(batch)`), built from
    the train state's `params`; Ray's workers, if any, stop on leaving."""
    if run.cfg.engine.kind != "ray":
        yield Rollouts(run, params, prompts, rewards, decode)
        return
    try:
        from jaxtrain.asynchronous.rollout_workers import ray_rollouts
    except ModuleNotFoundError as err:
        if err.name != "ray":
            raise
        raise RolloutError(
            "engine.kind=ray samples GRPO's rollouts on Ray, which is not installed: pip install -e '.[async]' (or "
            "pip install ray), or set engine.kind=spmd."
        ) from None
    with ray_rollouts(run, params, prompts, rewards, decode, log) as sampler:
        yield sampler
