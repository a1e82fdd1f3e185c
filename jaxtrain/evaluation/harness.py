"""lm-eval-harness's model `jaxtrain`: a language model trained, exported or imported with jaxtrain, evaluated on any
mesh by lm-eval's tasks. Importing this module registers it with lm-eval's registry (`--model jaxtrain`).

    $ python -m jaxtrain.evaluation --model jaxtrain --model_args path=runs/x,mesh=fsdp=4,tensor=2 \
          --tasks hellaswag --batch_size 16

    >>> import lm_eval, jaxtrain.evaluation.harness                                            # doctest: +SKIP
    >>> args = {"path": "runs/x", "mesh": "data=8"}                                            # doctest: +SKIP
    >>> lm_eval.simple_evaluate(model="jaxtrain", model_args=args, tasks=["arc_easy"])         # doctest: +SKIP

Its requests are answered as lm-eval's `hf` backend answers them for the same model exported to Hugging Face, so the
two agree: the same token ids (`jaxtrain.evaluation.tokenization`: the tokenizer's beginning-of-text token, the
context/continuation split of `TemplateLM`), the same left truncation to `max_length` (default: the model's context,
`max_position_embeddings` of an import, else the sequence length it trained on), the same rolling windows for
`loglikelihood_rolling`, and greedy generation stopped at the end-of-text token and cut at the first stop string.
Log-likelihoods come from one program per (rows, length bucket) (`jaxtrain.evaluation.scoring`); generation from the
KV-cache generator (`jaxtrain.inference.generate`), one program per (rows, prompt bucket, new tokens); a short batch is
padded to `batch_size` rows so that it reuses its program.

Model arguments: `path` (a checkpoint step, a params export or a run directory; a LoRA run's adapters are merged
into its weights), `mesh` (a layout name or inline layout; lm-eval splits arguments at commas, so
`mesh=fsdp=4,tensor=2` arrives as `mesh=fsdp=4` and `tensor=2`, and the axes are put back together), `max_length`,
`max_gen_toks` (256, as the `hf` backend), `add_bos_token` and `prefix_token_id` (as the `hf` backend's). lm-eval's
`batch_size` is the rows per program call (a number; `auto` is refused); `device` and `max_batch_size`, which lm-eval
hands every model, do nothing here: the mesh places the model.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import lm_eval.models  # noqa: F401 - lm-eval's own models, registered before ours (it loads them only into an empty registry)
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from jaxtrain.errors import UserInputError
from jaxtrain.evaluation.scoring import Score, Scorer
from jaxtrain.evaluation.tokenization import TextCodec
from jaxtrain.inference.generate import Generator
from jaxtrain.sharding.mesh import MESH_AXES

MODEL_NAME = "jaxtrain"
ARGUMENTS = ("path", "mesh", "batch_size", "max_length", "max_gen_toks", "add_bos_token", "prefix_token_id")
SAMPLING = ("temperature", "top_k", "top_p")  # the generation settings taken beside until, max_gen_toks, do_sample


class HarnessError(UserInputError):
    """A model argument or request the `jaxtrain` lm-eval model cannot take."""


@register_model(MODEL_NAME)
class JaxtrainLM(TemplateLM):
    """lm-eval's `LM` for a jaxtrain language model on a mesh: `loglikelihood`, `loglikelihood_rolling` and
    `generate_until`, batched. Build it from `path` (and `mesh`), or from a `generator` already holding the model
    (the training loop's, `jaxtrain.evaluation.in_loop`)."""

    def __init__(
        self,
        path: str | None = None,
        mesh: str | None = None,
        batch_size: int | str = 16,
        max_length: int | None = None,
        max_gen_toks: int = 256,
        add_bos_token: bool | None = None,
        prefix_token_id: int | None = None,
        generator: Generator | None = None,
        device: Any = None,
        max_batch_size: Any = None,
        **axes: Any,
    ):
        super().__init__()
        if generator is not None and (path is not None or mesh is not None or axes):
            raise HarnessError("give the model as path= (and mesh=) or as a generator, not both.")
        self.generator = generator or _restored(path, _mesh_layout(mesh, axes))
        self.batch_size = _count("batch_size", batch_size)
        self.scorer = Scorer(self.generator, self.batch_size)
        self.codec = TextCodec.of(self.generator, add_bos_token)
        self._max_length = _count("max_length", max_length if max_length is not None else _context(self.generator))
        self.max_gen_toks = _count("max_gen_toks", max_gen_toks)
        self.custom_prefix_token_id = prefix_token_id

    @property
    def eot_token_id(self) -> int | None:
        return self.codec.eos.id if self.codec.eos else None

    @property
    def prefix_token_id(self) -> int:
        """What an empty context (and a rolling window's first input) is: the beginning-of-text token, else the
        end-of-text token, as the `hf` backend."""
        if self.custom_prefix_token_id is not None:
            return self.custom_prefix_token_id
        special = self.codec.bos or self.codec.eos
        if special is None:
            raise HarnessError(
                "the model's tokenizer has no beginning- or end-of-text token to stand for an empty context: give "
                "the token id to condition on as the model argument prefix_token_id=ID."
            )
        return special.id

    @property
    def max_length(self) -> int:
        return self._max_length

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        return self.codec.encode(string, add_special_tokens)

    def tok_decode(self, tokens: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.codec.decode(tokens, skip_special_tokens)

    def _loglikelihood_tokens(
        self, requests: list[tuple[Any, list[int], list[int]]], disable_tqdm: bool = False, **kwargs: Any
    ) -> list[Score]:
        """(log-likelihood, greedy) of each (key, context ids, continuation ids); the inputs cut from the left to
        `max_length` tokens, as the `hf` backend cuts them."""
        rows, counts = [], []
        for _, context, continuation in requests:
            if len(continuation) > self.max_length:
                raise HarnessError(
                    f"a continuation of {len(continuation)} tokens is longer than max_length={self.max_length}: give "
                    "a larger max_length (the model's context allowing)."
                )
            rows.append((context + continuation)[-(self.max_length + 1) :])
            counts.append(len(continuation))
        return self.scorer.score(rows, counts)

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Each text's log-likelihood over disjoint windows of `max_length` tokens, each conditioned on as much of
        what precedes it as fits (lm-eval's `get_rolling_token_windows`, as the `hf` backend calls it)."""
        windows, owners = [], []
        for number, (text,) in enumerate(request.args for request in requests):
            tokens = self.tok_encode(text)
            for context, continuation in map(
                make_disjoint_window, get_rolling_token_windows(tokens, self.prefix_token_id, self.max_length, 1)
            ):
                windows.append((None, context, continuation))
                owners.append(number)
        totals = [0.0] * len(requests)
        for number, (log_likelihood, _) in zip(owners, self._loglikelihood_tokens(windows)):
            totals[number] += log_likelihood
        return totals

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Each context continued (greedily, unless its settings sample) by up to its `max_gen_toks` tokens, and cut
        at the first of its stop strings; requests of the same settings are generated together."""
        groups: dict[str, list[int]] = {}
        for number, request in enumerate(requests):
            groups.setdefault(json.dumps(request.args[1], sort_keys=True, default=str), []).append(number)
        out = [""] * len(requests)
        for numbers in groups.values():
            texts = self._generate([requests[n].args[0] for n in numbers], requests[numbers[0]].args[1])
            for number, text in zip(numbers, texts):
                out[number] = text
        return out

    def _generate(self, contexts: list[str], settings: dict[str, Any]) -> list[str]:
        kwargs = normalize_gen_kwargs(settings, self.max_gen_toks)
        eos = self.tok_decode([self.eot_token_id], skip_special_tokens=False) if self.eot_token_id is not None else None
        until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
        new_tokens = kwargs.pop("max_gen_toks")
        context_tokens = self.max_length - new_tokens
        if context_tokens < 1:
            raise HarnessError(
                f"max_gen_toks={new_tokens} leaves no room for a context in max_length={self.max_length}: give fewer "
                "new tokens or a larger max_length."
            )
        sampling = _sampling(kwargs)
        prompts = [self.tok_encode(context)[-context_tokens:] for context in contexts]
        rows = self.scorer.rows
        longest_first = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
        texts = [""] * len(prompts)
        for start in range(0, len(prompts), rows):
            chunk = longest_first[start : start + rows]
            batch = [prompts[i] for i in chunk]
            batch += [batch[-1]] * (rows - len(batch))  # a full batch reuses its program; the copies are dropped
            continuations = self.generator.generate(
                batch, max_new_tokens=new_tokens, eos_id=self.eot_token_id, **sampling
            ).tokens
            for i, tokens in zip(chunk, continuations):
                texts[i] = postprocess_generated_text(self.tok_decode(tokens), until, None)
        return texts


def _restored(path: str | None, mesh: str | None) -> Generator:
    if path is None:
        raise HarnessError(
            "the jaxtrain model needs path=CHECKPOINT in --model_args: a checkpoint step, a params export "
            "(jaxtrain export, jaxtrain import-hf) or a run directory."
        )
    return Generator.restore(str(path), mesh)


def _mesh_layout(mesh: str | None, axes: dict[str, Any]) -> str | None:
    """The layout `mesh` names, with the mesh axes lm-eval split off at its commas put back."""
    unknown = [key for key in axes if key not in MESH_AXES]
    if unknown:
        raise HarnessError(
            f"model argument {unknown[0]!r} is not one the jaxtrain model takes: give {', '.join(ARGUMENTS)}."
        )
    if axes and mesh is None:
        named = ",".join(f"{key}={value}" for key, value in axes.items())
        raise HarnessError(f"mesh axes {named} without mesh=: give the layout as mesh={named}.")
    return ",".join([str(mesh), *(f"{key}={value}" for key, value in axes.items())]) if axes else mesh


def _count(name: str, value: Any) -> int:
    """A positive integer model argument (lm-eval's command line gives some as text)."""
    number = int(value) if isinstance(value, str) and value.isdigit() else value
    if isinstance(number, bool) or not isinstance(number, int) or number < 1:
        raise HarnessError(f"{name}={value!r}: expected a positive integer.")
    return number


def _context(generator: Generator) -> int:
    """The positions a model was made for: an import's `max_position_embeddings`, else the sequence length it
    trained on."""
    if generator.context is not None:
        return generator.context
    if generator.cfg is None:
        raise HarnessError("the model's context length is unknown (no run config): give max_length=N.")
    return generator.cfg.data.seq_len


def _sampling(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The generator's sampling settings of lm-eval's normalised generation settings: greedy unless `do_sample`."""
    sample = kwargs.pop("do_sample")
    settings = {key: kwargs.pop(key) for key in SAMPLING if key in kwargs}
    if kwargs:
        raise HarnessError(
            f"generation setting {next(iter(kwargs))!r} is not one the jaxtrain model takes: it takes until, "
            f"max_gen_toks, do_sample and {', '.join(SAMPLING)}."
        )
    return settings if sample else {}
