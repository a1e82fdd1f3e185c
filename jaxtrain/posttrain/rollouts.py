"""GRPO's rollouts: prompts chosen by (seed, step), G completions of each sampled by the trainer's own generator on the
training mesh from the current params, scored by the rewards, and packed into a batch of fixed shape.

Prompts are JSON lines, one record a line; the record is handed to the rewards whole:

    {"prompt": "What is 2+3?", "answer": "5"}                                  plain text, encoded as it is
    {"prompt": [{"role": "user", "content": "..."}], "answer": "5", ...}       a conversation, rendered by the chat
                                                                               template with the generation prompt

Step s takes prompts s·P .. s·P + P - 1 of an order drawn afresh each epoch from (seed, epoch), so a run resumed at
step s samples the prompts, and with the step's own sampling seed the completions, of the uninterrupted run.

The sampler is a `Generator` on the run's own shardings, handed the train state's params at each step: the arrays
themselves, no copy and no reshard (its placement is the trainer's). With adapters it computes as the trainer does,
x·W + (x·A)·B, not with the adapters folded into a copy of W. The batch (`jaxtrain.posttrain.grpo.ROLLOUT_KEYS`) holds
the sampler's log-probs of its tokens as the old policy's: they equal the trainer's within a float32 ulp or two
(tests/test_sampler_log_probs.py), so at the first optimizer step on fresh rollouts the ratio is 1 to that precision,
and no forward pass recomputes them. Both are the model's own log-probs, at temperature 1: sampled at another
temperature or with top-p, the draw's distribution differs from the policy the loss weighs (see `Generation`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import jax
import numpy as np

from jaxtrain.data.chat import ChatError, checked_conversation
from jaxtrain.data.chat_template import ChatTemplate
from jaxtrain.data.datasets import placed_batch
from jaxtrain.errors import UserInputError
from jaxtrain.files import read_bytes
from jaxtrain.inference.generate import Generation, Generator
from jaxtrain.posttrain.grpo import REFERENCE_KEY, group_advantages
from jaxtrain.posttrain.rewards import Reward, score
from jaxtrain.run_config import RunConfig
from jaxtrain.training.setup import Run

PyTree = Any
PROMPT_ORDER, SAMPLING = 0, 1  # streams of (seed, stream, ...) draws
EXCERPT = 40


class RolloutError(UserInputError):
    """Prompts, or settings, that rollouts cannot be made from."""


class Tokenizer(Protocol):
    """What rollouts need of a tokenizer (`jaxtrain.inference.generate.ByteTokenizer`, `jaxtrain.data.tokenizer`'s)."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


@dataclasses.dataclass(frozen=True)
class Prompts:
    """Prompt records and their token ids, and which of them a step takes."""

    records: tuple[dict, ...]
    ids: tuple[tuple[int, ...], ...]

    @classmethod
    def from_jsonl(cls, path: str | Path, tokenizer: Tokenizer, template: ChatTemplate | None = None) -> Prompts:
        """The records of a JSON-lines file; an unreadable line or one without a prompt is an error naming it."""
        records = []
        for number, line in enumerate(read_bytes(Path(path), "prompts file", RolloutError).splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as err:
                raise RolloutError(f"{path} line {number} is not JSON ({err}): give one JSON object a line.") from None
            records.append((f"{path} line {number}", record))
        return cls._encoded(records, tokenizer, template)

    @classmethod
    def from_records(
        cls, records: Sequence[Mapping], tokenizer: Tokenizer, template: ChatTemplate | None = None
    ) -> Prompts:
        """Records in memory: dicts with a `prompt` (text or messages) and what the rewards read (`answer`, ...)."""
        return cls._encoded([(f"prompt {i}", r) for i, r in enumerate(records)], tokenizer, template)

    @classmethod
    def _encoded(cls, named: list[tuple[str, Any]], tokenizer: Tokenizer, template: ChatTemplate | None) -> Prompts:
        if not named:
            raise RolloutError("no prompts given: GRPO needs at least one record with a 'prompt'.")
        ids = tuple(tuple(encode_prompt(where, record, tokenizer, template)) for where, record in named)
        return cls(tuple(dict(record) for _, record in named), ids)

    @property
    def digest(self) -> str:
        """SHA-256 of the records: a resumed run checks it has the prompts it started with."""
        return hashlib.sha256(json.dumps(self.records, sort_keys=True, default=str).encode()).hexdigest()

    def chosen(self, seed: int, step: int, count: int) -> np.ndarray:
        """The indices of step `step`'s `count` prompts: positions step·count .. of the run's prompt sequence, which
        is each epoch's own permutation of all of them."""
        positions = step * count + np.arange(count)
        epochs, within = np.divmod(positions, len(self.records))
        orders = {e: np.random.default_rng((seed, PROMPT_ORDER, e)).permutation(len(self.records)) for e in set(epochs)}
        return np.array([orders[e][i] for e, i in zip(epochs, within)], np.int64)


def encode_prompt(where: str, record: Any, tokenizer: Tokenizer, template: ChatTemplate | None) -> list[int]:
    """A record's prompt as token ids: its text, or its conversation rendered with the generation prompt."""
    if not isinstance(record, Mapping) or "prompt" not in record:
        raise RolloutError(f"{where} has no 'prompt': give a JSON object with 'prompt' (a text or a list of messages).")
    prompt = record["prompt"]
    if isinstance(prompt, list):
        if template is None:
            raise RolloutError(f"{where}'s prompt is a conversation: give a chat template to render it with.")
        try:
            prompt = template.render(checked_conversation(prompt, reply=False), add_generation_prompt=True)
        except ChatError as err:
            raise RolloutError(f"{where}: {err}") from None
    if not isinstance(prompt, str) or not prompt:
        raise RolloutError(f"{where}'s prompt is {json.dumps(prompt)[:EXCERPT]}: give a non-empty text or messages.")
    return list(tokenizer.encode(prompt))


class RolloutShapes:
    """The shapes of GRPO's batch of rollouts, for building the run (its train step compiles for them); the batches
    themselves are sampled each step by `Rollouts`, not read."""

    task = "lm"

    def __init__(self, seq_len: int, reference: bool = False):
        """`reference`: the batch carries the reference's log-probs too (`grpo.beta` > 0)."""
        self.seq_len, self.reference = seq_len, reference

    def shapes(self, batch_size: int) -> dict[str, jax.ShapeDtypeStruct]:
        rows, t = batch_size, self.seq_len
        shapes = {
            "tokens": jax.ShapeDtypeStruct((rows, t + 1), np.int32),
            "loss_weights": jax.ShapeDtypeStruct((rows, t + 1), np.float32),
            "old_log_probs": jax.ShapeDtypeStruct((rows, t), np.float32),
            "advantages": jax.ShapeDtypeStruct((rows,), np.float32),
        }
        return shapes | ({REFERENCE_KEY: jax.ShapeDtypeStruct((rows, t), np.float32)} if self.reference else {})

    @classmethod
    def of(cls, cfg: RunConfig) -> RolloutShapes:
        """The shapes of the batches of rollouts `cfg` trains on."""
        return cls(cfg.data.seq_len, reference=bool(cfg.grpo.beta))

    def rows(self, split: str, step: int, rows: range, batch_size: int) -> dict[str, np.ndarray]:
        raise RolloutError(
            "GRPO's batches are sampled at each step from the current params (jaxtrain.posttrain.grpo_train), not "
            "read from a dataset."
        )


@dataclasses.dataclass(frozen=True)
class Rollout:
    """One step's rollouts on the host: the batch (`ROLLOUT_KEYS`, numpy, B = P x G rows) and what is logged of it."""

    batch: dict[str, np.ndarray]
    rewards: np.ndarray  # (B,) float32, the rewards' sum
    prompts: np.ndarray  # (B,) each row's prompt index
    completions: list[str]  # each row's completion text, without its stop token
    lengths: np.ndarray  # (B,) completion tokens, the stop token included
    stopped: np.ndarray  # (B,) bool: the completion ended with the stop token (else it ran to max_new_tokens)
    # Params versions between the sampler's and the learner's: 0 in process; up to engine.max_staleness from Ray's
    # rollout workers (jaxtrain.asynchronous.rollout_workers), which GRPO's importance ratio corrects for.
    staleness: int = 0

    def metrics(self, group_size: int) -> dict[str, float]:
        """Reward mean and standard deviation over the batch, the fraction of groups whose rewards are all equal
        (their advantages are 0: nothing to learn from them), completion lengths, the fraction stopped, and the
        staleness of the params they were sampled from."""
        groups = self.rewards.reshape(-1, group_size)
        return {
            "reward_mean": float(np.mean(self.rewards)),
            "reward_std": float(np.std(self.rewards)),
            "zero_std_fraction": float(np.mean(np.ptp(groups, axis=1) == 0)),
            "completion_length": float(np.mean(self.lengths)),
            "stopped_fraction": float(np.mean(self.stopped)),
            "staleness": float(self.staleness),
        }


class Rollouts:
    """Makes each step's rollouts with the run's own sampler: `rollouts(params, step) -> Rollout`."""

    def __init__(
        self,
        run: Run,
        params: PyTree,
        prompts: Prompts,
        rewards: Sequence[Reward],
        decode: Callable[[Sequence[int]], str],
    ):
        """`params`: the train state's (placed as the run places them); `decode`: token ids to the text the rewards
        read."""
        self.run, self.prompts, self.rewards, self.decode = run, prompts, list(rewards), decode
        self.settings, self.seq_len = run.cfg.grpo, run.cfg.data.seq_len
        self.per_step = run.cfg.data.batch_size // self.settings.group_size
        self._check_lengths()
        self.generator = Generator(run.shardings, params, run.cfg)  # the run's placement: the arrays, not a copy
        self.shardings = batch_shardings(run)

    def _check_lengths(self) -> None:
        """Every prompt leaves room for `max_new_tokens` in the batch's rows of seq_len + 1 tokens."""
        new, room = self.settings.max_new_tokens, self.seq_len + 1 - self.settings.max_new_tokens
        for index, ids in enumerate(self.prompts.ids):
            if len(ids) > room:
                raise RolloutError(
                    f"prompt {index} ({_excerpt(self.prompts.records[index])}) has {len(ids)} tokens, and with "
                    f"grpo.max_new_tokens={new} its row needs {len(ids) + new} > data.seq_len + 1 = "
                    f"{self.seq_len + 1}: raise data.seq_len, lower grpo.max_new_tokens, or shorten the prompt."
                )

    def __call__(self, params: PyTree, step: int) -> Rollout:
        """Step `step`'s rollouts from `params` (the train state's now): P prompts, G completions each."""
        g, seed = self.settings, self.run.cfg.train.seed
        chosen = np.repeat(
            self.prompts.chosen(seed, step, self.per_step), g.group_size
        )  # each prompt's G rows together
        self.generator.params = params  # this step's weights, as they are: the last step donated the previous ones
        generation = self.generator.generate(
            [list(self.prompts.ids[i]) for i in chosen],
            max_new_tokens=g.max_new_tokens,
            temperature=g.temperature,
            top_p=g.top_p,
            seed=sampling_seed(seed, step),
            eos_id=None if g.eos_id < 0 else g.eos_id,
        )
        return self.scored(chosen, generation)

    def scored(self, chosen: np.ndarray, generation: Generation) -> Rollout:
        """The rollout of `generation`, the completions of the prompts `chosen` (an index a row): each completion's
        text without its stop token, scored, its group's advantages, and the batch."""
        texts, stopped = completion_texts(generation, self.settings.eos_id, self.decode)
        records = [self.prompts.records[i] for i in chosen]
        rewards = score(self.rewards, texts, records, chosen.tolist())
        advantages = np.asarray(group_advantages(rewards, self.settings.group_size, self.settings.scale))
        prompts = [self.prompts.ids[i] for i in chosen]
        batch = pack(prompts, generation.tokens, generation.log_probs, advantages, self.seq_len)
        lengths = np.array([len(t) for t in generation.tokens])
        return Rollout(batch, rewards, chosen, texts, lengths, stopped)

    def place(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """`batch` on the mesh in the train step's batch shardings (every process holds the whole of it: the
        generator gives every process every row)."""
        return placed_batch(batch, self.shardings)


def batch_shardings(run: Run) -> dict[str, jax.sharding.Sharding]:
    """The train step's sharding of each array of a batch of rollouts (`place` puts a host batch there)."""
    shapes = RolloutShapes.of(run.cfg).shapes(run.cfg.data.batch_size)
    return {k: v.sharding for k, v in run.shardings.abstract_batch(shapes).items()}


def completion_texts(
    generation: Generation, eos_id: int, decode: Callable[[Sequence[int]], str]
) -> tuple[list[str], np.ndarray]:
    """Each completion's text without its stop token, and whether it ended with that token (`eos_id`; -1: none)."""
    stopped = np.array([bool(t) and t[-1] == eos_id for t in generation.tokens])
    return [decode(t[:-1] if s else t) for t, s in zip(generation.tokens, stopped)], stopped


def pack(
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    log_probs: Sequence[np.ndarray],
    advantages: np.ndarray,
    seq_len: int,
) -> dict[str, np.ndarray]:
    """Rows of prompt + completion, right-padded to seq_len + 1 tokens, in the layout of
    `jaxtrain.posttrain.grpo.ROLLOUT_KEYS`: a completion's tokens weigh 1, and the log-prob of its token at position
    n + k (n the prompt's length) is that of target n + k - 1, the target that position's token is."""
    rows = len(prompts)
    tokens = np.zeros((rows, seq_len + 1), np.int32)
    weights = np.zeros((rows, seq_len + 1), np.float32)
    old = np.zeros((rows, seq_len), np.float32)
    for row, (prompt, completion, lp) in enumerate(zip(prompts, completions, log_probs)):
        n, m = len(prompt), len(completion)
        tokens[row, :n], tokens[row, n : n + m] = prompt, completion
        weights[row, n : n + m] = 1.0
        old[row, n - 1 : n - 1 + m] = lp
    return {"tokens": tokens, "loss_weights": weights, "old_log_probs": old, "advantages": advantages}


def sampling_seed(seed: int, step: int) -> int:
    """The sampler's seed at step `step` (uint32): a run resumed there draws what the uninterrupted run drew."""
    return int(np.random.default_rng((seed, SAMPLING, step)).integers(2**32, dtype=np.uint64))


def _excerpt(record: Mapping) -> str:
    prompt = record.get("prompt")
    text = prompt if isinstance(prompt, str) else json.dumps(prompt)
    return repr(text if len(text) <= EXCERPT else text[:EXCERPT] + "...")
