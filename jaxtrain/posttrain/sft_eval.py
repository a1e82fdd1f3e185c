"""Supervised fine-tuning's generation score: held-out chat prompts continued by the model as it trains, each reply
scored against the reference answer by a scorer chosen by name.

The prompts are the val split's conversations of the chat data the run trains on (`jaxtrain tokenize --chat`), cut
before their last assistant turn: the tokens before that turn's weighted ones are the conversation rendered with the
chat template up to it, with the generation prompt (that is how `jaxtrain.data.chat` finds the weights), and the
weighted tokens are the reference. The model continues each prompt greedily with the KV-cache generator
(`jaxtrain.inference.generate.Generator`) on the training mesh, stopping at the template's end-of-turn token
(`eos_token`) or `train.generate_eval_max_new_tokens`. The reply and the reference, cut at that token and decoded,
go to the scorer; the mean score is logged as `val_<scorer name>` beside the validation loss.

    >>> from jaxtrain.run_config import load_config
    >>> overrides = ["data.source=tokens:sft", "checkpoint.restore=runs/import", "train.generate_eval_every=100"]
    >>> cfg = load_config("runs/import/config.toml", overrides=overrides)            # doctest: +SKIP
    >>> summary = train(cfg)                                                         # doctest: +SKIP
    >>> summary["val_exact_match"]                                                   # doctest: +SKIP

A scorer is `scorer(prediction: str, reference: str) -> float`; `register_scorer("name", fn)` adds one by name, and
`train.generate_eval_scorer=package.module:function` imports one.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxtrain.data.tokenizer import Tokenizer
from jaxtrain.data.tokens import open_split, read_manifest, token_sources, tokenizer_of
from jaxtrain.errors import ConfigError
from jaxtrain.inference.generate import Generator, generation_shardings
from jaxtrain.placement.place import PlacedModel, place_model
from jaxtrain.run_config import RunConfig
from jaxtrain.training import loop
from jaxtrain.training.setup import Run

Scorer = Callable[[str, str], float]
SETTING = loop.GENERATE_EVAL_KEY


class GenerationEvalError(ConfigError):
    """A generation score the run cannot compute: an unknown scorer, data without held-out chat prompts, a stop
    token the tokenizer does not have."""


def exact_match(prediction: str, reference: str) -> float:
    """1.0 if the reply is the reference, leading and trailing whitespace aside; else 0.0."""
    return float(prediction.strip() == reference.strip())


SCORERS: dict[str, Scorer] = {"exact_match": exact_match}


def register_scorer(name: str, scorer: Scorer) -> None:
    """Make `scorer(prediction, reference) -> float` available as `train.generate_eval_scorer=name`."""
    if not name.isidentifier():
        raise GenerationEvalError(f"scorer name {name!r}: expected a Python identifier (it names the logged metric).")
    SCORERS[name] = scorer


RESERVED = ("loss", "targets")  # val_loss and val_targets are the validation loss's: a scorer may not overwrite them


def find_scorer(spec: str) -> tuple[str, Scorer]:
    """The scorer `spec` names, and its name in the metrics: a registered name, or `module:function`, imported."""
    name, scorer = _scorer(spec)
    if name in RESERVED:
        raise GenerationEvalError(
            f"train.generate_eval_scorer={spec!r} would be logged as val_{name}, the validation loss's own metric: "
            "give the scorer another name."
        )
    return name, scorer


def _scorer(spec: str) -> tuple[str, Scorer]:
    if spec in SCORERS:
        return spec, SCORERS[spec]
    module, _, attribute = spec.partition(":")
    if not module or not attribute:
        raise GenerationEvalError(
            f"train.generate_eval_scorer={spec!r} is not a registered scorer ({', '.join(sorted(SCORERS))}) nor "
            "module:function: register one with jaxtrain.posttrain.sft_eval.register_scorer, or name its function."
        )
    try:
        scorer = getattr(importlib.import_module(module), attribute)
    except (ImportError, AttributeError) as err:
        raise GenerationEvalError(f"train.generate_eval_scorer={spec!r}: cannot import it ({err}).") from None
    if not callable(scorer):
        raise GenerationEvalError(f"train.generate_eval_scorer={spec!r} is not callable: name a function.")
    return attribute, scorer


@dataclasses.dataclass(frozen=True)
class HeldOut:
    """Held-out prompts (token ids, up to and with the last assistant turn's generation prompt), their reference
    answers (token ids, cut at `stop_id`), and the tokenizer that decodes both."""

    prompts: list[list[int]]
    references: list[list[int]]
    stop_id: int
    tokenizer: Tokenizer


def held_out_prompts(cfg: RunConfig) -> HeldOut:
    """The first `train.generate_eval_prompts` conversations of the val split of the run's chat data, each cut
    before its last assistant turn; a `GenerationEvalError` naming what is missing (chat data, held-out ones)."""
    t, d = cfg.train, cfg.data
    sources = token_sources(d.source, d.path, d.mixture)
    directory = next((s for s, _ in sources or () if "chat" in read_manifest(s)), None)
    if directory is None:
        raise GenerationEvalError(
            f"{SETTING}={t.generate_eval_every} needs chat data (data.source=tokens:DIR of `jaxtrain tokenize "
            f"--chat`, which renders conversations with a chat template); data.source={d.source} has none."
        )
    manifest, split = open_split(Path(directory), "val")
    tokenizer = tokenizer_of(Path(directory))
    stop_id = _stop_id(cfg, manifest, tokenizer, directory)
    prompts, references = [], []
    for start, end in zip(split.documents, split.document_ends):
        cut = _last_turn(split.read_weights(int(start), int(end)))
        if cut is not None:
            ids = split.read(int(start), int(end)).tolist()
            prompts.append(ids[: cut[0]])
            references.append(_until(ids[cut[0] : cut[1]], stop_id))
        if len(prompts) == t.generate_eval_prompts:
            break
    if not prompts:
        raise GenerationEvalError(
            f"{SETTING}={t.generate_eval_every}: the val split of '{directory}' holds no conversation to prompt "
            "with: tokenize with --val-fraction above 0 (enough for some conversations), or set it to 0."
        )
    return HeldOut(prompts, references, stop_id, tokenizer)


def _last_turn(weights: np.ndarray) -> tuple[int, int] | None:
    """[start, stop) of the last run of weighted tokens (the last assistant turn), or None if none is weighted."""
    weighted = np.flatnonzero(weights > 0)
    if weighted.size == 0:
        return None
    stop = int(weighted[-1]) + 1
    gaps = np.flatnonzero(np.diff(weighted) > 1)
    start = int(weighted[gaps[-1] + 1]) if gaps.size else int(weighted[0])
    return start, stop


def _until(ids: Sequence[int], stop_id: int) -> list[int]:
    """`ids` up to (not with) the first `stop_id`."""
    ids = list(ids)
    return ids[: ids.index(stop_id)] if stop_id in ids else ids


def _stop_id(cfg: RunConfig, manifest: dict, tokenizer: Tokenizer, directory: Path) -> int:
    """The id of the token that ends a reply: `train.generate_eval_stop`, else the chat template's `eos_token`."""
    text = cfg.train.generate_eval_stop or manifest["chat"].get("special_tokens", {}).get("eos_token", "")
    if not text:
        raise GenerationEvalError(
            f"the chat template of '{directory}' names no eos_token, so a reply has no end: set "
            "train.generate_eval_stop=TOKEN (e.g. <|im_end|>)."
        )
    ids = tokenizer.encode(text)
    if len(ids) != 1:
        raise GenerationEvalError(
            f"stop token {text!r} is {len(ids)} tokens of {tokenizer.path}, not one: set train.generate_eval_stop to "
            "the single token that ends an assistant turn."
        )
    return ids[0]


class GenerationEval:
    """The generation score `train.generate_eval_*` asks for, as a `jaxtrain.training.loop.Evaluation`: built (and
    checked) before the run compiles, its generator built on the first call and its compiled program reused by
    every later one (the params change, not the shapes); the train step is not touched."""

    setting = SETTING

    def __init__(self, cfg: RunConfig):
        t = cfg.train
        loop.refuse_pipeline_mesh(cfg, f"{SETTING}={t.generate_eval_every}", GenerationEvalError)
        self.every, self.max_new_tokens = t.generate_eval_every, t.generate_eval_max_new_tokens
        self.name, self.scorer = find_scorer(t.generate_eval_scorer)
        self.held_out = held_out_prompts(cfg)
        self._generator: Generator | None = None
        self._merge: Callable | None = None

    def __call__(self, run: Run, params: Any, step: int) -> dict[str, float]:
        """`val_<scorer>`: the mean score of the replies to the held-out prompts after `step`."""
        generator = self._generator_with(run, params)
        held = self.held_out
        replies = generator.generate(held.prompts, max_new_tokens=self.max_new_tokens, eos_id=held.stop_id).tokens
        decode = held.tokenizer.decode
        scores = [
            float(self.scorer(decode(_until(reply, held.stop_id)), decode(reference)))
            for reply, reference in zip(replies, held.references)
        ]
        return {f"val_{self.name}": float(np.mean(scores))}

    def _generator_with(self, run: Run, params: Any) -> Generator:
        """The generator, holding the base model's params of the train state's `params` (adapters merged in)."""
        shardings = run.shardings
        params = shardings.params_in_model_order(params)
        if shardings.model.freezes:  # LoRA: generation reads the base model, adapters folded in
            self._merge = self._merge or jax.jit(shardings.model.merge)
            params = self._merge(params)
        if self._generator is None:
            self._generator = Generator(generation_shardings(_base(run)), params, run.cfg)
        else:  # the same program on new params: no compile
            self._generator.params = jax.device_put(params, self._generator.shardings.state_shardings["params"])
        return self._generator


def _base(run: Run) -> PlacedModel:
    """The run's model without adapters, on the run's mesh with its rules."""
    if not run.shardings.model.freezes:
        return run.placed
    cfg = run.cfg
    return place_model(cfg.model_name, cfg.model, cfg.mesh, cfg.rules, mesh=run.placed.mesh)
