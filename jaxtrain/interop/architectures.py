"""Hugging Face architectures as settings of jaxtrain's models: one tensor table per architecture, and the config
translation both ways. This module holds what every architecture shares and the decoders (Llama, Mistral, Qwen2,
Qwen3 as settings of `models/gpt.py`); `encoders` holds BERT's.

A table row names a jaxtrain parameter, the Hugging Face tensor it is made of, and both layouts as dim letters
(einops-like; parentheses merge dims): `d` the model width, `h` query heads, `g` key/value heads, `k` a head's
channels, `f` the MLP width, `v` the vocabulary (`encoders` adds its own). A parameter under a `blocks/` module
(`blocks/w_q`, `encoder/blocks/w_q`) is stacked: its leading `layers` dim gathers the tensors of every layer, whose
names hold `{layer}` (`model.layers.{layer}....`).

What the layouts account for: PyTorch's Linear keeps its weight as (out, in), jaxtrain as (in, out) with the heads
split out, e.g. q_proj (h k, d) is w_q (d, h, k). RoPE needs no permutation: jaxtrain rotates channel pairs
(k, k + K/2) of each head, the "rotate_half" layout transformers' Llama, Mistral and Qwen use (the permutation in
Meta-to-HF conversion scripts exists because Meta's original checkpoints pair adjacent channels instead).
"""

from __future__ import annotations

import abc
import dataclasses
import math
import re
from typing import Any

import numpy as np

from jaxtrain.errors import UserInputError


class ArchitectureError(UserInputError):
    """A Hugging Face config, or a jaxtrain model, that has no counterpart on the other side."""


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One jaxtrain parameter (`param`, e.g. "blocks/w_q") and the Hugging Face tensor `hf_name` it is, with the
    dims of each (`hf_dims` "(h k) d", `dims` "d h k"; a stacked param's leading layers dim is not written)."""

    param: str
    hf_name: str
    hf_dims: str
    dims: str

    @property
    def stacked(self) -> bool:
        """Whether the param stacks every layer's tensor: it lives in a `blocks` module."""
        return "blocks" in self.param.split("/")[:-1]

    def name(self, layer: int | None = None) -> str:
        return self.hf_name.format(layer=layer)

    def groups(self) -> list[str]:
        """The Hugging Face dims as groups of our letters: "(h k) d" -> ["hk", "d"]."""
        return [g.strip("()").replace(" ", "") for g in re.findall(r"\([^)]*\)|\w", self.hf_dims)]

    def sizes(self, shape: tuple[int, ...]) -> dict[str, int]:
        """Each letter's size, from our (per-layer) shape."""
        return dict(zip(self.dims.split(), shape))

    def hf_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The Hugging Face tensor's shape for our per-layer `shape`."""
        sizes = self.sizes(shape)
        return tuple(math.prod(sizes[c] for c in group) for group in self.groups())

    def to_hf(self, x: np.ndarray) -> np.ndarray:
        """Our per-layer array in the Hugging Face layout."""
        letters = "".join(self.groups())
        ours = self.dims.replace(" ", "")
        return x.transpose([ours.index(c) for c in letters]).reshape(self.hf_shape(x.shape))

    def from_hf(self, read: np.ndarray, index: dict[str, slice], sizes: dict[str, int]) -> np.ndarray:
        """Our slice `index` (a slice per letter) of the per-layer array, from `read`: what `hf_index` asked for."""
        groups = self.groups()
        letters = "".join(groups)
        split = [index[c].stop - index[c].start if c == g[0] else sizes[c] for g in groups for c in g]
        x = read.reshape(split)
        x = x[tuple(slice(None) if c == g[0] else index[c] for g in groups for c in g)]
        return x.transpose([letters.index(c) for c in self.dims.replace(" ", "")])

    def hf_index(self, index: dict[str, slice], sizes: dict[str, int]) -> tuple[slice, ...]:
        """The part of the Hugging Face tensor that holds our slice `index`: for merged dims "(h k)", the whole
        rows of the heads asked for (`from_hf` then keeps the channels asked for)."""
        out = []
        for group in self.groups():
            inner = math.prod(sizes[c] for c in group[1:])
            first = index[group[0]]
            out.append(slice(first.start * inner, first.stop * inner))
        return tuple(out)


def _layer(param: str, module: str, hf_dims: str, dims: str) -> Tensor:
    return Tensor(f"blocks/{param}", f"model.layers.{{layer}}.{module}.weight", hf_dims, dims)


EMBEDDING = Tensor("embedding", "model.embed_tokens.weight", "v d", "v d")
FINAL_NORM = Tensor("final_norm", "model.norm.weight", "d", "d")
HEAD = Tensor("head", "lm_head.weight", "v d", "d v")  # absent when the embeddings are tied
DECODER = (
    EMBEDDING,
    _layer("attn_norm", "input_layernorm", "d", "d"),
    _layer("w_q", "self_attn.q_proj", "(h k) d", "d h k"),
    _layer("w_k", "self_attn.k_proj", "(g k) d", "d g k"),
    _layer("w_v", "self_attn.v_proj", "(g k) d", "d g k"),
    _layer("w_out", "self_attn.o_proj", "d (h k)", "h k d"),
    _layer("mlp_norm", "post_attention_layernorm", "d", "d"),
    _layer("w_gate", "mlp.gate_proj", "f d", "d f"),
    _layer("w_in", "mlp.up_proj", "f d", "d f"),
    _layer("w_down", "mlp.down_proj", "d f", "f d"),
    FINAL_NORM,
)
QKV_BIAS = tuple(
    Tensor(f"blocks/b_{p}", f"model.layers.{{layer}}.self_attn.{p}_proj.bias", f"({h} k)", f"{h} k")
    for p, h in (("q", "h"), ("k", "g"), ("v", "g"))
)
QK_NORM = tuple(_layer(f"{p}_norm", f"self_attn.{p}_norm", "k", "k") for p in "qk")


@dataclasses.dataclass(frozen=True)
class Architecture(abc.ABC):
    """A Hugging Face model class, the registered jaxtrain model it is a setting of (`model`: "llama", "bert") and its
    tensor table (`tensors`, the token embedding first). Each family says how config.json becomes the model's
    settings and back, and which of a checkpoint's tensors carry nothing."""

    name: str
    model_type: str
    model: str
    tensors: tuple[Tensor, ...]

    @abc.abstractmethod
    def settings(self, hf: dict[str, Any], source: str) -> dict[str, Any]:
        """The jaxtrain model's settings equal to config.json `hf` (read from `source`); an error naming what has no
        counterpart."""

    @abc.abstractmethod
    def config(self, model: Any, dtype: str, imported: dict[str, Any] | None = None) -> dict[str, Any]:
        """config.json for jaxtrain model settings `model` as this class, over the config it was imported from."""

    def tensors_of(self, model: Any) -> tuple[Tensor, ...]:
        """The rows of every tensor of jaxtrain model settings `model`."""
        return self.tensors

    def ignorable(self, name: str, model: Any) -> bool:
        """Whether checkpoint tensor `name`, which no row of `model`'s reads, carries nothing (else it is refused)."""
        return False


@dataclasses.dataclass(frozen=True)
class DecoderArchitecture(Architecture):
    """A Hugging Face causal LM class as settings of jaxtrain's decoder. `qkv_bias`, `qk_norm`: the class always has
    them; `window`: its config's `sliding_window` applies to every layer (Mistral)."""

    qkv_bias: bool = False
    qk_norm: bool = False
    window: bool = False

    def table(self, tie_embeddings: bool) -> tuple[Tensor, ...]:
        return self.tensors + (() if tie_embeddings else (HEAD,))

    def tensors_of(self, model: Any) -> tuple[Tensor, ...]:
        return self.table(model.tie_embeddings)

    def settings(self, hf: dict[str, Any], source: str) -> dict[str, Any]:
        return model_settings(self, hf, source)

    def config(self, model: Any, dtype: str, imported: dict[str, Any] | None = None) -> dict[str, Any]:
        return hf_config(self, model, dtype, imported)

    def ignorable(self, name: str, model: Any) -> bool:
        """RoPE's frequencies (recomputed), and a tied head's copy."""
        return name.endswith("rotary_emb.inv_freq") or (name == HEAD.name() and model.tie_embeddings)


LLAMA = DecoderArchitecture("LlamaForCausalLM", "llama", "llama", DECODER)
MISTRAL = DecoderArchitecture("MistralForCausalLM", "mistral", "llama", DECODER, window=True)
QWEN2 = DecoderArchitecture("Qwen2ForCausalLM", "qwen2", "llama", DECODER + QKV_BIAS, qkv_bias=True)
QWEN3 = DecoderArchitecture("Qwen3ForCausalLM", "qwen3", "llama", DECODER + QK_NORM, qk_norm=True)
DECODERS = {a.name: a for a in (LLAMA, MISTRAL, QWEN2, QWEN3)}
DECODER_MODELS = ("gpt", "llama")  # the registered models that are settings of the decoder


def architecture(config: dict[str, Any], source: str, known: dict[str, Architecture]) -> Architecture:
    """The architecture of `known` (by class name) that `config` (a config.json read from `source`) names; an error
    naming it if none."""
    names = config.get("architectures") or []
    found = [known[n] for n in names if n in known]
    if not found:
        raise ArchitectureError(
            f"{source}: architecture {', '.join(names) or '(none given)'} is not supported; jaxtrain imports "
            f"{', '.join(known)}."
        )
    return found[0]


# config.json keys that are a transformer's settings as they stand, both ways, in every family: (key, setting).
SHAPE_FIELDS = (
    ("vocab_size", "vocab_size"),
    ("num_hidden_layers", "n_layers"),
    ("hidden_size", "d_model"),
    ("num_attention_heads", "n_heads"),
    ("intermediate_size", "d_ff"),
)
# ... and the decoders'.
SAME_FIELDS = (*SHAPE_FIELDS, ("rms_norm_eps", "norm_eps"))


def model_settings(arch: DecoderArchitecture, hf: dict[str, Any], source: str) -> dict[str, Any]:
    """jaxtrain decoder settings (`models.gpt.GPTConfig` fields) equal to Hugging Face config `hf`."""
    missing = [key for key, _ in SAME_FIELDS if key not in hf]
    if missing:
        raise ArchitectureError(f"{source} lacks {', '.join(missing)}: a {arch.name} config.json sets them.")
    _refuse_unsupported(arch, hf, source)
    heads = hf["num_attention_heads"]
    return {
        **{ours: hf[key] for key, ours in SAME_FIELDS},
        "n_kv_heads": hf.get("num_key_value_heads") or heads,
        "head_dim": hf.get("head_dim") or hf["hidden_size"] // heads,
        "mlp": "swiglu",
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "qkv_bias": arch.qkv_bias,
        "qk_norm": arch.qk_norm,
        "sliding_window": (hf.get("sliding_window") or 0) if arch.window else 0,
        **_rope_settings(hf, source),
    }


def _refuse_unsupported(arch: DecoderArchitecture, hf: dict[str, Any], source: str) -> None:
    """Settings jaxtrain's decoder has no equivalent of: an error naming the setting, never a wrong model."""
    problems = []
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={hf['hidden_act']!r} (jaxtrain's SwiGLU uses silu)")
    if hf.get("attention_bias") and not arch.qkv_bias:
        problems.append("attention_bias=true (a bias on the output projection too; jaxtrain has q, k, v biases only)")
    if hf.get("mlp_bias"):
        problems.append("mlp_bias=true (jaxtrain's MLP has no biases)")
    windowed = [t for t in hf.get("layer_types") or [] if t != "full_attention"]
    if hf.get("use_sliding_window") and not arch.window or windowed:
        problems.append("sliding-window attention on some layers only (jaxtrain's window is the same on every layer)")
    if problems:
        raise ArchitectureError(f"{source} ({arch.name}) has settings jaxtrain cannot express: {'; '.join(problems)}.")


def _rope_settings(hf: dict[str, Any], source: str) -> dict[str, Any]:
    """RoPE's base and scaling: transformers 5 writes them as `rope_parameters`, earlier versions as `rope_theta`
    and `rope_scaling`."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    base = {"rope_base": float(rope.get("rope_theta", hf.get("rope_theta", 10_000.0)))}
    if kind == "default":
        return {**base, "rope_scaling": "none"}
    if kind != "llama3":
        raise ArchitectureError(f"{source}: rope_type {kind!r} is not supported; jaxtrain has 'default' and 'llama3'.")
    return {
        **base,
        "rope_scaling": "llama3",
        "rope_factor": float(rope["factor"]),
        "rope_low_freq_factor": float(rope["low_freq_factor"]),
        "rope_high_freq_factor": float(rope["high_freq_factor"]),
        "rope_original_context": int(rope["original_max_position_embeddings"]),
    }


def architecture_for(model: Any, imported: dict[str, Any] | None = None) -> DecoderArchitecture:
    """The Hugging Face architecture that computes jaxtrain decoder `model` (a GPTConfig): the one it was imported
    from when that still fits, else Qwen2 for q/k/v biases, Qwen3 for q/k norms, Mistral for a sliding window,
    Llama otherwise."""
    if model.mlp != "swiglu":
        raise ArchitectureError(
            f"model mlp={model.mlp!r}: the Hugging Face decoders jaxtrain exports (Llama, Mistral, Qwen2, Qwen3) use "
            "SwiGLU; a GPT-style model (mlp=gelu) has no such counterpart."
        )
    if model.qkv_bias and model.qk_norm:
        raise ArchitectureError("qkv_bias and qk_norm together: no exported architecture has both.")
    if model.sliding_window and (model.qkv_bias or model.qk_norm):
        raise ArchitectureError("a sliding window with qkv_bias or qk_norm: only Mistral's window is exported.")
    names = (imported or {}).get("architectures") or []
    fits = [a for a in map(DECODERS.get, names) if a and _fits(a, model)]
    if fits:
        return fits[0]
    if model.qkv_bias:
        return QWEN2
    if model.qk_norm:
        return QWEN3
    return MISTRAL if model.sliding_window else LLAMA


def _fits(arch: DecoderArchitecture, model: Any) -> bool:
    return (
        arch.qkv_bias == model.qkv_bias and arch.qk_norm == model.qk_norm and (arch.window or not model.sliding_window)
    )


def hf_config(
    arch: DecoderArchitecture, model: Any, dtype: str, imported: dict[str, Any] | None = None
) -> dict[str, Any]:
    """config.json for decoder `model` as `arch`, over the config it was imported from (which keeps what jaxtrain
    does not model: token ids, context length)."""
    config = dict(imported or {})
    config.update({key: getattr(model, ours) for key, ours in SAME_FIELDS})
    config.update(
        architectures=[arch.name],
        model_type=arch.model_type,
        num_key_value_heads=model.kv_heads,
        head_dim=model.head_channels,
        hidden_act="silu",
        tie_word_embeddings=model.tie_embeddings,
        rope_parameters=_rope_parameters(model),
        dtype=dtype,
    )
    config.setdefault("max_position_embeddings", _context(model))
    for superseded in ("rope_scaling", "rope_theta", "torch_dtype"):  # transformers 5 reads the fields above
        config.pop(superseded, None)
    if arch.window:
        config["sliding_window"] = model.sliding_window or None
    if arch is not QWEN2:
        config["attention_bias"] = False
    return config


def _rope_parameters(model: Any) -> dict[str, Any]:
    if model.rope_scaling == "none":
        return {"rope_type": "default", "rope_theta": model.rope_base}
    return {
        "rope_type": "llama3",
        "rope_theta": model.rope_base,
        "factor": model.rope_factor,
        "low_freq_factor": model.rope_low_freq_factor,
        "high_freq_factor": model.rope_high_freq_factor,
        "original_max_position_embeddings": model.rope_original_context,
    }


def _context(model: Any) -> int:
    """A context length for a model that was not imported: the scaled context under llama3 scaling, else 4096
    (jaxtrain's RoPE has no limit; transformers sizes nothing by it for these architectures)."""
    if model.rope_scaling == "llama3":
        return int(model.rope_original_context * model.rope_factor)
    return 4096
