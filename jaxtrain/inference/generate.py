"""Text generation from a trained language model, with a KV cache laid out by the training sharding rules.

A `Generator` holds a model's params on a mesh, placed as training places them (`jaxtrain.placement.shardings`), and one
compiled program per batch shape: the whole right-padded prompt batch is prefilled in one `model.extend` call, then a
`lax.while_loop` adds one token per step until every row has met `eos_id` or `max_new_tokens` are written. The KV
cache is sharded by the activation rules through the model's `cache_names()` (batch over the data axes, kv heads
over `tensor`). Prompts may differ in length: row i's first new token goes at position len_i, over the padding, so
no later token attends to a pad. Each new token comes with the model's log-probability of it
(`Generation.log_probs`), which reinforcement learning sets against the trainer's. Batch rows are padded to a multiple
of the data axes and prompt lengths rounded up to a power of two, so calls of similar sizes reuse one compiled program.

The model must follow the decoder protocol (`models/gpt.py`): `init_cache(batch, max_len)`, `cache_names()` and
`extend(tokens, positions, cache) -> (logits, cache)`.

    >>> generator = Generator.restore("runs/x/ckpt/400", mesh="data=2,tensor=2")          # doctest: +SKIP
    >>> generator.generate([[72, 105], [84]], max_new_tokens=20, temperature=0.8, top_p=0.9).tokens  # doctest: +SKIP
    >>> generate("runs/x/ckpt/400", [[72, 105]], max_new_tokens=20)                         # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from jaxtrain.data.tokenizer import Tokenizer, load_tokenizer
from jaxtrain.data.tokens import token_sources, tokenizer_of
from jaxtrain.errors import UserInputError
from jaxtrain.formatting import fmt_bytes
from jaxtrain.inference.sampling import Sampling, sample, token_log_probs
from jaxtrain.placement.place import PlacedModel, place_model
from jaxtrain.placement.shardings import Shardings
from jaxtrain.run_config import RunConfig
from jaxtrain.sharding.constraints import activation_sharding
from jaxtrain.sharding.mesh import MeshLayout, build_mesh, parse_layout
from jaxtrain.sharding.rules import logical_to_spec
from jaxtrain.training.adapted_checkpoints import restore_merged
from jaxtrain.training.checkpoint import carried_files, find_checkpoint, trained_config
from jaxtrain.training.distributed import to_host

PyTree = Any
NO_EOS = -1  # the eos id the program is given when there is none: no token equals it
STOPPED = -1  # what the output holds after a row has stopped
MIN_PROMPT_BUCKET = 8
DECODER_METHODS = ("init_cache", "cache_names", "extend")
SHOWN_PIECES = 5  # unknown pieces of a prompt named in a message; the rest are counted


class GenerationError(UserInputError):
    """A prompt, setting or model that generation cannot take."""


@dataclasses.dataclass(frozen=True)
class Generation:
    """The continuation of each prompt (ending with `eos_id` where a row met it); if asked for, the logits each new
    token was chosen from: one float32 array (len(tokens[i]), vocab) per prompt; and each new token's log-probability
    (`log_probs`, one float32 array (len(tokens[i]),) per prompt, always given by `Generator.generate`).

    `log_probs` is the model's: log_softmax of the raw logits at the token, at temperature 1 and before top-k and
    top-p, whatever settings drew it (`jaxtrain.inference.sampling.token_log_probs`). That is the policy's
    log-probability, which reinforcement learning's importance ratio sets against the trainer's
    (`GPT.target_log_probs` on prompt + continuation). Sampled at temperature 1 without top-k or top-p, it is also
    the log-probability of the draw; otherwise the draw came from the tempered, truncated distribution, whose
    log-probability differs, and this is still the model's, the one the trainer recomputes."""

    tokens: list[list[int]]
    logits: list[np.ndarray] | None = None
    log_probs: list[np.ndarray] | None = None


class ByteTokenizer:
    """The tokenizer of jaxtrain's text data (`builtin` and text files, `jaxtrain.data.datasets.byte_text`): one token
    per UTF-8 byte."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        """The text of `ids`; a byte sequence that is not UTF-8 (a character cut at a prompt's end) shows U+FFFD."""
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def tokenizer_for(cfg: RunConfig, carried: Path | None = None) -> ByteTokenizer | Tokenizer:
    """The tokenizer the model of `cfg` trained with (bytes, or tokenized data's own); for synthetic data (an import
    from Hugging Face is stored with it), the tokenizer the checkpoint carries (`carried`, its `carried_files`); an
    error for synthetic data without one."""
    directories = token_sources(cfg.data.source, cfg.data.path, cfg.data.mixture)
    if directories:  # a mixture's sources share one tokenizer
        return tokenizer_of(directories[0][0])
    if cfg.data.source == "synthetic" and carried is not None and (carried / "tokenizer.json").is_file():
        return load_tokenizer(carried)
    if cfg.data.source == "synthetic":
        raise GenerationError(
            f"model {cfg.model_name} was trained on data.source=synthetic (random token ids), which has no text to "
            "encode a prompt in: give the prompt as token ids (--prompt-ids 1,2,3)."
        )
    return ByteTokenizer()


def generation_shardings(placed: PlacedModel) -> Shardings:
    """The params' shardings on the placed model's mesh as training lays them out; generation keeps no optimizer
    state."""
    if placed.mesh.shape["pipeline"] > 1:
        raise GenerationError(
            f"generation runs each token through every layer, without a pipeline: the mesh has pipeline="
            f"{placed.mesh.shape['pipeline']}. Give a --mesh without a pipeline axis (e.g. data=2,tensor=2)."
        )
    return placed.shardings()


class Generator:
    """A language model's params on a mesh and its decoding program, compiled once per batch shape and reused.

    Build one with `Generator.restore(path)` (a checkpoint or export: the model comes from the config it stores),
    `Generator.from_training(summary)` (what `jaxtrain.train` returns), or from a model's `Shardings` and its params."""

    def __init__(self, shardings: Shardings, params: PyTree, cfg: RunConfig | None = None, carried: Path | None = None):
        """`params` in the model's layer order (placed here into `shardings`: params already placed there are used
        as they are, not copied); `cfg` the run config the model trained with, and `carried` the files its checkpoint
        carries, for its tokenizer. A model with adapters (a training run's shardings) generates through them, as its
        train step computes (`ModelParts.module`): GRPO's sampler."""
        self.shardings, self.cfg, self.carried = shardings, cfg, carried
        self.params = jax.device_put(params, shardings.state_shardings["params"])
        module = shardings.model.module(self.params)
        missing = [name for name in DECODER_METHODS if not callable(getattr(module, name, None))]
        if missing:
            raise GenerationError(
                f"model {cfg.model_name if cfg else type(module).__name__} has no {', '.join(missing)}: generation "
                "needs a decoder with a KV cache (init_cache, cache_names, extend; see models/gpt.py)."
            )
        self.cache_names = module.cache_names()
        self.vocab_size = jax.eval_shape(module.extend, *_probe(module))[0].shape[-1]
        mesh = shardings.mesh
        self.batch_ways = math.prod(mesh.shape[a] for a in shardings.rules.batch_axes())
        self._program = jax.jit(
            self._decode,
            static_argnames=("max_new_tokens", "cache_len", "return_logits"),
            out_shardings=shardings.replicated,  # every process reads the whole result
        )

    @classmethod
    def restore(
        cls, path: str | Path, mesh: str | Mesh | None = None, devices: Sequence[jax.Device] | None = None
    ) -> Generator:
        """The model in checkpoint `path` (a step directory, a params export, or a run directory: its newest step),
        rebuilt from the config it stores, its params restored onto `mesh` (a layout name, inline `data=2,tensor=2`,
        or a Mesh; default: all `devices` on `data`) with the sharding rules it trained with; a run's adapters
        (`lora.rank` > 0) merged into its weights. A layout of a fixed size takes the first that many devices: a few
        prompts need not occupy a whole host."""
        step_dir, meta = find_checkpoint(path)
        cfg = trained_config(step_dir, meta)
        layout = parse_layout(mesh if isinstance(mesh, str) else "data=-1")
        placed = place_model(cfg.model_name, cfg.model, layout, cfg.rules, mesh=_mesh(mesh, devices))
        if placed.spec.task != "lm":
            raise GenerationError(
                f"checkpoint {step_dir} holds model {cfg.model_name}, a {placed.spec.task} model: generation needs "
                "a language model (task lm, e.g. gpt or llama)."
            )
        shardings = generation_shardings(placed)
        # A run trained with adapters generates as it computes: each adapter folded into its weight.
        return cls(shardings, restore_merged(step_dir, meta, placed), cfg, carried_files(step_dir))

    @classmethod
    def from_training(
        cls, summary: Mapping[str, Any], mesh: str | Mesh | None = None, devices: Sequence[jax.Device] | None = None
    ) -> Generator:
        """The model `jaxtrain.train` just trained (its summary's `run` and `state`), on the run's mesh or on `mesh`
        (as `restore` takes it), with the run's sharding rules."""
        run, state = summary["run"], summary["state"]
        params = run.shardings.params_in_model_order(state["params"])
        placed = run.placed if mesh is None else run.placed.on_mesh(_mesh(mesh, devices))
        shardings = generation_shardings(placed)
        return cls(shardings, params, run.cfg)

    @property
    def tokenizer(self) -> ByteTokenizer | Tokenizer:
        if self.cfg is None:
            raise GenerationError("this generator was built without the model's run config: give token ids.")
        return tokenizer_for(self.cfg, self.carried)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: int,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
        eos_id: int | None = None,
        return_logits: bool = False,
    ) -> Generation:
        """Continue each prompt (token ids) by up to `max_new_tokens` tokens, stopping a row at `eos_id` (kept as its
        last token). Greedy when `temperature` is 0; else sampled with `top_k` / `top_p`, the same for the same
        `seed`. Raises `GenerationError` (or `ConfigError` for a sampling setting) naming the bad value."""
        sampling = Sampling(temperature=temperature, top_k=top_k, top_p=top_p)
        self._check(prompts, max_new_tokens, eos_id)
        tokens, lengths, live = self._batch(prompts)
        self._check_length(prompts, max_new_tokens, tokens.shape, return_logits)
        rows = tokens.shape[0]
        inputs = [tokens, lengths, live, *(np.asarray(x) for x in sampling.per_row(rows))]
        put = [jax.device_put(x, self.shardings.batch_sharding(x.shape)) for x in inputs]
        scalars = [np.uint32(seed), np.int32(NO_EOS if eos_id is None else eos_id)]
        cache_len = tokens.shape[1] + max_new_tokens - 1  # the last token is never written to the cache
        out, log_probs, logits = to_host(
            self._program(
                self.params,
                *put,
                *scalars,
                max_new_tokens=max_new_tokens,
                cache_len=cache_len,
                return_logits=return_logits,
            )
        )
        continuations = [[int(t) for t in row if t != STOPPED] for row in out[: len(prompts)]]
        log_probs = [log_probs[i, : len(c)] for i, c in enumerate(continuations)]
        if not return_logits:
            return Generation(continuations, log_probs=log_probs)
        return Generation(continuations, [logits[i, : len(c)] for i, c in enumerate(continuations)], log_probs)

    def _check(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, eos_id: int | None) -> None:
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise GenerationError(f"max_new_tokens={max_new_tokens!r}: expected an integer >= 1.")
        if not prompts:
            raise GenerationError("no prompts given: give at least one prompt of token ids.")
        vocab = f"0..{self.vocab_size - 1}, the model's vocabulary"
        if eos_id is not None and not 0 <= eos_id < self.vocab_size:
            raise GenerationError(f"eos_id={eos_id} is outside {vocab}: give an id in it, or none.")
        for number, prompt in enumerate(prompts, 1):
            if len(prompt) == 0:
                raise GenerationError(f"prompt {number} is empty: give at least one token to continue.")
            bad = [t for t in prompt if isinstance(t, bool) or not isinstance(t, int | np.integer)]
            bad = bad or [t for t in prompt if not 0 <= t < self.vocab_size]
            if bad:
                raise GenerationError(
                    f"prompt {number}: token id {bad[0]!r} is not an integer in {vocab}. Give ids in that range."
                )

    def _check_length(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int, shape: tuple[int, int], return_logits: bool
    ) -> None:
        """Refuse, before anything is allocated, more new tokens than the model's context or the devices' memory
        takes after these prompts (batched as `shape`)."""
        limit, why = min(self._new_token_limits(prompts, shape, return_logits))
        if limit < 1:
            raise GenerationError(f"max_new_tokens={max_new_tokens}: no new token fits: {why}. Shorten the prompts.")
        if max_new_tokens > limit:
            raise GenerationError(
                f"max_new_tokens={max_new_tokens} is more than {limit}: {why}. Give max_new_tokens <= {limit}."
            )

    def _new_token_limits(
        self, prompts: Sequence[Sequence[int]], shape: tuple[int, int], return_logits: bool
    ) -> list[tuple[int, str]]:
        """The most new tokens each limit allows, and the limit in words: the device memory that the KV cache
        (`shape[1] + new - 1` positions) and the output must fit in, and an imported model's context."""
        rows, width = shape
        cache = self._cache_bytes_per_position(rows, width)
        # int32 tokens, float32 log-probs (and float32 logits), replicated
        output = rows * 4 * (2 + self.vocab_size * return_logits)
        memory, where = device_memory(self.shardings.mesh)
        per_token = cache + output
        limits = [
            (
                int((memory - cache * (width - 1)) // per_token),
                f"the KV cache and the output take {fmt_bytes(per_token)} a token on each device, which has "
                f"{fmt_bytes(memory)} ({where})",
            )
        ]
        if self.context is not None:
            longest = max(map(len, prompts))
            limits.append(
                (
                    self.context - longest,
                    f"the model's context is {self.context} positions (max_position_embeddings in its config.json) "
                    f"and the longest prompt has {longest} tokens",
                )
            )
        return limits

    def _cache_bytes_per_position(self, rows: int, positions: int) -> float:
        """The bytes one position of a `rows`-row KV cache takes on each device, as its rules lay it out (found on a
        cache of `positions`, which the layout divides as it will divide the real one)."""
        shapes = self._cache_shapes(rows, positions)
        shards = (self._cache_sharding(name, x.shape).shard_shape(x.shape) for name, x in shapes.items())
        return sum(math.prod(shard) * x.dtype.itemsize for shard, x in zip(shards, shapes.values())) / positions

    @functools.cached_property
    def context(self) -> int | None:
        """The positions an imported model was made for: max_position_embeddings in the config.json its checkpoint
        carries. None for a model trained here, whose rotary positions set no limit."""
        config = self.carried / "config.json" if self.carried is not None else None
        if config is None or not config.is_file():
            return None
        value = json.loads(config.read_text()).get("max_position_embeddings")
        return value if type(value) is int and value > 0 else None

    def _batch(self, prompts: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Prompts right-padded into (rows, P) int32, their lengths and which rows are real. Rows are padded to a
        multiple of the data axes (padding rows are stopped from the start); P is a power of two."""
        rows = -(-len(prompts) // self.batch_ways) * self.batch_ways
        width = max(MIN_PROMPT_BUCKET, 1 << (max(map(len, prompts)) - 1).bit_length())
        tokens = np.zeros((rows, width), np.int32)
        lengths = np.ones((rows,), np.int32)
        for row, prompt in enumerate(prompts):
            tokens[row, : len(prompt)] = prompt
            lengths[row] = len(prompt)
        return tokens, lengths, np.arange(rows) < len(prompts)

    # Long: prefill, then the decoding loop and its carry, read best as one piece; each part is a few lines.
    def _decode(
        self,
        params: PyTree,
        tokens: jax.Array,  # (B, P) int32, right-padded
        lengths: jax.Array,  # (B,) int32
        live: jax.Array,  # (B,) bool: False for padding rows
        temperature: jax.Array,  # (B,) float32
        top_k: jax.Array,  # (B,) int32
        top_p: jax.Array,  # (B,) float32
        seed: jax.Array,  # () uint32
        eos_id: jax.Array,  # () int32
        *,
        max_new_tokens: int,
        cache_len: int,
        return_logits: bool,
    ) -> tuple[jax.Array, jax.Array, jax.Array | None]:
        """(B, max_new_tokens) new tokens (STOPPED after a row's end), their log-probabilities (0 after a row's end)
        and, if asked, the logits they came from."""
        with activation_sharding(self.shardings.mesh, self.shardings.rules):
            model = self.shardings.model.module(params)
            batch, width = tokens.shape
            row_keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(jax.random.key(seed), jnp.arange(batch))

            def choose(logits, step):  # (B, V) -> (B,)
                keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(row_keys, step)
                return sample(logits, keys, temperature, top_k, top_p)

            cache = self._constrain(model.init_cache(batch, cache_len))
            positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), tokens.shape)
            logits, cache = model.extend(tokens, positions, cache)  # (B, P, V)
            last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]  # (B, V)
            first = choose(last, 0)
            out = jnp.full((batch, max_new_tokens), STOPPED, jnp.int32).at[:, 0].set(jnp.where(live, first, STOPPED))
            log_probs = jnp.zeros((batch, max_new_tokens), jnp.float32).at[:, 0].set(token_log_probs(last, first))
            seen = None
            if return_logits:
                seen = jnp.zeros((batch, max_new_tokens, last.shape[-1]), jnp.float32).at[:, 0].set(last)
            done = ~live | (first == eos_id)
            carry = (jnp.int32(1), first, lengths, self._constrain(cache), out, log_probs, done, seen)

            def running(carry):
                step, *_, done, _ = carry
                return (step < max_new_tokens) & ~jnp.all(done)

            def one_token(carry):
                step, token, position, cache, out, log_probs, done, seen = carry
                logits, cache = model.extend(token[:, None], position[:, None], cache)  # (B, 1, V)
                token = choose(logits[:, 0], step)
                out = out.at[:, step].set(jnp.where(done, STOPPED, token))
                log_probs = log_probs.at[:, step].set(jnp.where(done, 0.0, token_log_probs(logits[:, 0], token)))
                if return_logits:
                    seen = seen.at[:, step].set(logits[:, 0])
                done = done | (token == eos_id)
                return step + 1, token, position + 1, self._constrain(cache), out, log_probs, done, seen

            _, _, _, _, out, log_probs, _, seen = jax.lax.while_loop(running, one_token, carry)
            return out, log_probs, seen

    def cache_shardings(self, batch: int, max_len: int) -> dict[str, NamedSharding]:
        """How the KV cache of `batch` rows and `max_len` slots is laid out: the activation rules applied to the
        model's `cache_names()` (batch over the data axes, kv heads over `tensor`)."""
        return {name: self._cache_sharding(name, x.shape) for name, x in self._cache_shapes(batch, max_len).items()}

    def _cache_shapes(self, batch: int, max_len: int) -> dict[str, jax.ShapeDtypeStruct]:
        module = self.shardings.model.module(self.params)
        return jax.eval_shape(lambda: module.init_cache(batch, max_len))

    def _cache_sharding(self, name: str, shape: tuple[int, ...]) -> NamedSharding:
        mesh = self.shardings.mesh
        spec = logical_to_spec(
            self.cache_names[name], shape, self.shardings.rules.activations, mesh, f"KV cache '{name}'"
        )
        return NamedSharding(mesh, spec)

    def _constrain(self, cache: PyTree) -> PyTree:
        return {
            name: jax.lax.with_sharding_constraint(x, self._cache_sharding(name, x.shape)) for name, x in cache.items()
        }


def device_memory(mesh: Mesh) -> tuple[int, str]:
    """The bytes each device of `mesh` has for new arrays (the least of them), and where the figure comes from. A
    CPU device reports none: the host's physical memory, shared by the mesh's devices on it."""
    stats = [device.memory_stats() or {} for device in mesh.local_devices]
    if all("bytes_limit" in s for s in stats):
        return min(s["bytes_limit"] - s.get("bytes_in_use", 0) for s in stats), "free on the device"
    host = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return host // len(stats), f"the host's {fmt_bytes(host)} shared by {len(stats)} device(s)"


def encode_prompts(
    tokenizer: ByteTokenizer | Tokenizer, texts: Sequence[str], warn: Callable[[str], None]
) -> list[list[int]]:
    """`texts` as token ids. A prompt that is only the tokenizer's unknown token is refused: the model would be
    given nothing of it. One with some unknown pieces is encoded, and `warn` is told in one line which."""
    prompts = []
    for number, text in enumerate(texts, 1):
        ids = tokenizer.encode(text)
        unknown, pieces = unknown_pieces(tokenizer, text)
        named = f"{unknown} for {_listed(pieces)}"
        if pieces and len(pieces) == len(ids):
            raise GenerationError(
                f"prompt {number} ({_excerpt(text)}) is only unknown tokens ({named}): {tokenizer.path} has no token "
                "for its text. Give text the tokenizer knows, or token ids (--prompt-ids)."
            )
        if pieces:
            warn(
                f"prompt {number} ({_excerpt(text)}): {len(pieces)} of its {len(ids)} tokens are unknown ({named}); "
                "the model sees nothing of that text."
            )
        prompts.append(ids)
    return prompts


def unknown_pieces(tokenizer: ByteTokenizer | Tokenizer, text: str) -> tuple[str, list[str]]:
    """The tokenizer's unknown token and the pieces of `text` its encoding turns into it; none for a tokenizer that
    encodes any text (bytes, a byte-level BPE, sentencepiece with byte fallback)."""
    if isinstance(tokenizer, ByteTokenizer):
        return "", []
    if tokenizer.path.suffix == ".model":
        import sentencepiece

        sp = sentencepiece.SentencePieceProcessor(model_file=str(tokenizer.path))
        # An unknown piece comes back as its own text, which is no piece of the vocabulary.
        pieces = [p for p in sp.encode(text, out_type=str) if sp.piece_to_id(p) == sp.unk_id()]
        return sp.id_to_piece(sp.unk_id()), [p.replace("\u2581", " ").strip() for p in pieces]
    from tokenizers import Tokenizer as HFTokenizer

    hf = HFTokenizer.from_file(str(tokenizer.path))
    model = json.loads(tokenizer.path.read_text(encoding="utf-8"))["model"]
    # BPE, WordPiece and WordLevel name their unknown token; Unigram gives its id.
    unk_id = hf.token_to_id(model["unk_token"]) if model.get("unk_token") else model.get("unk_id")
    if unk_id is None:
        return "", []
    encoding = hf.encode(text, add_special_tokens=False)
    return hf.id_to_token(unk_id), [text[a:b] for i, (a, b) in zip(encoding.ids, encoding.offsets) if i == unk_id]


def _listed(pieces: Sequence[str]) -> str:
    distinct = list(dict.fromkeys(pieces))
    more = len(distinct) - SHOWN_PIECES
    return ", ".join(map(repr, distinct[:SHOWN_PIECES])) + (f" and {more} more" if more > 0 else "")


def _excerpt(text: str, chars: int = 40) -> str:
    return repr(text if len(text) <= chars else text[:chars] + "...")


def _mesh(mesh: str | Mesh | None, devices: Sequence[jax.Device] | None) -> Mesh:
    """`mesh` itself, or the mesh of layout `mesh` (default `data=-1`) over `devices` (default: as many as it
    needs)."""
    if isinstance(mesh, Mesh):
        return mesh
    layout = parse_layout(mesh or "data=-1")
    return build_mesh(layout, devices or _layout_devices(layout))


def _layout_devices(layout: MeshLayout) -> list[jax.Device]:
    """Every device for a layout with a -1 axis, else the first as many as its sizes multiply to (all of them when
    there are fewer: `build_mesh` then says the layout does not fit)."""
    devices = jax.devices()
    if -1 in layout.axes.values():
        return devices
    size = math.prod(layout.axes.values()) * math.prod(layout.dcn_axes.values())
    return devices[:size] if size <= len(devices) else devices


def _probe(module: nnx.Module) -> tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct, PyTree]:
    """Abstract arguments of one `extend` call on a batch of one token, to read the model's vocabulary size."""
    token = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    return token, token, jax.eval_shape(lambda: module.init_cache(1, 1))


def generate(
    source: str | Path | Generator | Mapping[str, Any],
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    eos_id: int | None = None,
    mesh: str | Mesh | None = None,
) -> list[list[int]]:
    """The continuations of `prompts` (lists of token ids) by the model `source` names: a checkpoint or export
    path, a `Generator`, or the summary `jaxtrain.train` returns. See `Generator.generate`; to generate more than
    once, make a `Generator` and reuse its compiled program."""
    if isinstance(source, Generator):
        generator = source
    elif isinstance(source, Mapping):
        generator = Generator.from_training(source, mesh)
    else:
        generator = Generator.restore(source, mesh)
    settings = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "seed": seed, "eos_id": eos_id}
    return generator.generate(prompts, max_new_tokens=max_new_tokens, **settings).tokens
