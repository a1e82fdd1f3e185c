"""Reward functions for GRPO, by name: each scores one completion of one prompt.

A reward is a Python callable `fn(completion, record) -> number`: the completion's text (decoded, without its stop
token) and the prompt's record, the JSON line it came from (`prompt`, `answer`, and any other field the line has).
Several rewards are summed. They are named where a run names them:

    exact_match           1.0 where the completion, stripped, equals the record's `answer` (as text, stripped), else 0.0
    format:REGEX          1.0 where the completion, stripped, matches REGEX in full (Python `re.fullmatch`), else 0.0
    a registered name     `register_reward("mine", fn)` first
    module:function       a function of an importable module, e.g. `my_rewards:length_penalty`

A reward that raises, or returns anything but a finite real number, stops the run with one line naming the reward,
the prompt (its index in the prompts and the start of its text) and what went wrong.

    >>> register_reward("short", lambda completion, record: float(len(completion) < 20))
    >>> rewards = resolve_rewards(["exact_match", "short"])
    >>> score(rewards, ["4", "five"], [{"prompt": "2+2=", "answer": 4}] * 2, [0, 0]).tolist()
    [2.0, 1.0]
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import numbers
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from jaxtrain.errors import UserInputError
from jaxtrain.posttrain.sft_eval import exact_match as sft_exact_match

RewardFn = Callable[[str, Mapping[str, Any]], float]
FORMAT = "format:"  # a reward named format:REGEX checks the completion's format
EXCERPT = 40  # characters of a prompt shown in an error


class RewardError(UserInputError):
    """A reward that cannot be found, or that failed on a completion."""


@dataclasses.dataclass(frozen=True)
class Reward:
    """A reward function and the name it is known by in errors and metrics."""

    name: str
    fn: RewardFn


def exact_match(completion: str, record: Mapping[str, Any]) -> float:
    """1.0 where the completion, stripped, is the record's `answer` as text, stripped; else 0.0."""
    if "answer" not in record:
        raise KeyError("the prompt's record has no 'answer' field, which exact_match compares with")
    return sft_exact_match(completion, str(record["answer"]))


def format_reward(pattern: str) -> RewardFn:
    """A reward of 1.0 where the stripped completion matches `pattern` in full, else 0.0."""
    try:
        compiled = re.compile(pattern, re.DOTALL)
    except re.error as err:
        raise RewardError(f"reward '{FORMAT}{pattern}': the pattern is no regular expression: {err}.") from None
    return lambda completion, record: float(compiled.fullmatch(completion.strip()) is not None)


REWARDS: dict[str, RewardFn] = {"exact_match": exact_match}


def register_reward(name: str, fn: RewardFn) -> None:
    """Make `fn(completion, record) -> number` a reward named `name` (replacing one of that name)."""
    if not name or ":" in name:
        raise RewardError(f"reward name {name!r}: give a non-empty name without ':' (which names module:function).")
    if not callable(fn):
        raise RewardError(f"reward '{name}': {fn!r} is not callable; give a function (completion, record) -> number.")
    REWARDS[name] = fn


def resolve_rewards(spec: str | RewardFn | Sequence[str | RewardFn]) -> list[Reward]:
    """The rewards `spec` names: a name, a callable, or a list of them (summed)."""
    items = [spec] if isinstance(spec, str) or callable(spec) else list(spec)
    if not items:
        raise RewardError("no reward given: name one (exact_match, format:REGEX, module:function) or pass a function.")
    return [_resolve(item) for item in items]


def _resolve(item: str | RewardFn) -> Reward:
    if callable(item):
        return Reward(getattr(item, "__name__", repr(item)), item)
    if item.startswith(FORMAT):
        return Reward(item, format_reward(item[len(FORMAT) :]))
    if item in REWARDS:
        return Reward(item, REWARDS[item])
    if ":" in item:
        return Reward(item, _imported(item))
    known = ", ".join(sorted(REWARDS))
    raise RewardError(
        f"reward '{item}' is not known: use one of {known}, format:REGEX, module:function, or register_reward it."
    )


def _imported(item: str) -> RewardFn:
    """The function `module:function` names."""
    module_name, _, attribute = item.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise RewardError(f"reward '{item}': module '{module_name}' does not import: {err}.") from None
    fn = getattr(module, attribute, None)
    if not callable(fn):
        raise RewardError(f"reward '{item}': module '{module_name}' has no function '{attribute}'.")
    return fn


def score(
    rewards: Sequence[Reward], completions: Sequence[str], records: Sequence[Mapping], prompts: Sequence[int]
) -> np.ndarray:
    """Each completion's reward, (B,) float32: the sum of `rewards` on (completion i, record i); `prompts[i]` is the
    index of completion i's prompt, which an error names."""
    total = np.zeros(len(completions), np.float64)
    for reward in rewards:
        for i, (completion, record) in enumerate(zip(completions, records)):
            total[i] += _one(reward, completion, record, prompts[i])
    return total.astype(np.float32)


def _one(reward: Reward, completion: str, record: Mapping, prompt: int) -> float:
    """One reward's number for one completion, or a `RewardError` naming the reward and the prompt."""
    try:
        value = reward.fn(completion, record)
    except Exception as err:  # noqa: BLE001 - a user's function may raise anything; the error names it
        said = " ".join(str(err).split())  # one line, whatever the message
        raise RewardError(f"{_where(reward, record, prompt)} raised {type(err).__name__}: {said}") from err
    if isinstance(value, numbers.Real) and math.isfinite(value):  # a bool is a real number too: 1.0 or 0.0
        return float(value)
    got = f"{value!r} ({type(value).__name__})"
    raise RewardError(f"{_where(reward, record, prompt)} returned {got[:80]}: a reward must be a finite number")


def _where(reward: Reward, record: Mapping, prompt: int) -> str:
    text = record.get("prompt", "")
    text = text if isinstance(text, str) else str(text[-1].get("content", "")) if text else ""
    excerpt = text if len(text) <= EXCERPT else text[:EXCERPT] + "..."
    return f"reward '{reward.name}' on prompt {prompt} ({excerpt!r})"
