"""GRPO's held-out score (`grpo.eval_prompts`): every held-out prompt completed greedily by the trainer's own generator
from the current params and scored by the run's rewards. The rollouts' reward is a noisy figure of sampled
completions of training prompts; this one says what the policy's likeliest answer earns on prompts it never trained
on, e.g. `val_exact_match`, the held-out exact match.

Prompts are completed `data.batch_size` at a time, the last batch topped up with copies of its last prompt (their
scores dropped), so each evaluation runs the one compiled program.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jaxtrain.inference.generate import Generation, Generator
from jaxtrain.posttrain.rewards import Reward, score
from jaxtrain.posttrain.rollouts import Prompts, completion_texts
from jaxtrain.training.setup import Run

PyTree = Any


class HeldOutScore:
    """`score(params) -> {"val_reward_mean": ..., "val_<reward name>": ..., ...}` on `prompts`."""

    def __init__(
        self,
        run: Run,
        params: PyTree,
        prompts: Prompts,
        rewards: Sequence[Reward],
        decode: Callable[[Sequence[int]], str],
    ):
        """`params`: the train state's (placed as the run places them: the generator uses the arrays, no copy)."""
        self.prompts, self.rewards, self.decode = prompts, list(rewards), decode
        self.settings, self.rows = run.cfg.grpo, run.cfg.data.batch_size
        self.generator = Generator(run.shardings, params, run.cfg)

    def __call__(self, params: PyTree) -> dict[str, float]:
        """Each reward's mean over the held-out prompts and their sum's (`val_reward_mean`), the mean completion length
        (stop token included) and the fraction of completions that ended with the stop token."""
        self.generator.params = params
        generation = self._complete()
        texts, stopped = completion_texts(generation, self.settings.eos_id, self.decode)
        indices = list(range(len(self.prompts.ids)))
        each = {r.name: score([r], texts, self.prompts.records, indices) for r in self.rewards}
        return {
            "val_reward_mean": float(np.mean(sum(each.values()))),
            **{f"val_{name}": float(np.mean(values)) for name, values in each.items()},
            "val_completion_length": float(np.mean([len(t) for t in generation.tokens])),
            "val_stopped_fraction": float(np.mean(stopped)),
        }

    def _complete(self) -> Generation:
        """Greedy completions of every prompt, in its order."""
        ids, tokens = [list(p) for p in self.prompts.ids], []
        eos = None if self.settings.eos_id < 0 else self.settings.eos_id
        for start in range(0, len(ids), self.rows):
            chunk = ids[start : start + self.rows]
            padded = chunk + [chunk[-1]] * (self.rows - len(chunk))
            out = self.generator.generate(padded, max_new_tokens=self.settings.max_new_tokens, eos_id=eos)
            tokens += out.tokens[: len(chunk)]
        return Generation(tokens)
