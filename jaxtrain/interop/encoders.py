"""BERT as settings of jaxtrain's encoder (`models/bert.py`): `BertForMaskedLM` is the model `bert` (task mlm),
`BertForSequenceClassification` the model `bert_classifier` (task text_classification); their tensor tables, and
config.json translated both ways.

Besides the letters of `architectures` (`d` width, `h` heads, `k` a head's channels, `f` MLP width, `v` vocabulary),
the tables use `p` positions, `t` token types, `c` classes, and `e` the output side of a square (d, d) matrix (the MLM
transform, the pooler), so that its transpose is written like any other Linear's: weight "e d" is ours "d e".

What jaxtrain's encoder cannot compute is refused by name, both ways: on import, an activation other than GELU
(erf: `gelu`; tanh: `gelu_new`, `gelu_pytorch_tanh`), relative position embeddings, a causal or cross-attending
BERT, an untied MLM output matrix, a regression or multi-label classifier; on export, a pre-norm or rotary encoder,
no token types, or mean pooling, none of which a BERT class computes.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from jaxtrain.interop.architectures import SHAPE_FIELDS, Architecture, ArchitectureError, Tensor

# config.json keys that BertConfig defaults when absent, as transformers reads them: (key, setting, its default).
DEFAULTED_FIELDS = (
    ("max_position_embeddings", "max_positions", 512),
    ("type_vocab_size", "type_vocab_size", 2),
    ("layer_norm_eps", "norm_eps", 1e-12),
    ("initializer_range", "init_std", 0.02),
)
# hidden_act -> gelu_approximate: GELU with erf, or its tanh form (the same formula under both tanh names).
GELUS = {"gelu": False, "gelu_new": True, "gelu_pytorch_tanh": True}


def _norm(param: str, module: str) -> tuple[Tensor, Tensor]:
    """A LayerNorm: our scale and bias are its weight and bias."""
    return Tensor(f"{param}/scale", f"{module}.weight", "d", "d"), Tensor(f"{param}/bias", f"{module}.bias", "d", "d")


def _dense(weight: str, bias: str, module: str, hf_dims: str, dims: str) -> tuple[Tensor, Tensor]:
    """A Linear layer: weight (out, in) as ours `weight` (in, out; heads split out), bias (out,) as ours `bias`."""
    out = re.findall(r"\([^)]*\)|\w", hf_dims)[0]
    return Tensor(weight, f"{module}.weight", hf_dims, dims), Tensor(bias, f"{module}.bias", out, out.strip("()"))


def _within(param: str, module: str, rows: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    """`rows` with their params inside module `param` and their tensors inside module `module`."""
    return tuple(dataclasses.replace(t, param=f"{param}/{t.param}", hf_name=f"{module}.{t.hf_name}") for t in rows)


EMBEDDINGS = _within(
    "encoder",
    "bert.embeddings",
    (
        Tensor("embedding", "word_embeddings.weight", "v d", "v d"),
        Tensor("position_embedding", "position_embeddings.weight", "p d", "p d"),
        Tensor("type_embedding", "token_type_embeddings.weight", "t d", "t d"),
        *_norm("embed_norm", "LayerNorm"),
    ),
)
BLOCKS = _within(
    "encoder/blocks",
    "bert.encoder.layer.{layer}",
    (
        *_dense("w_q", "b_q", "attention.self.query", "(h k) d", "d h k"),
        *_dense("w_k", "b_k", "attention.self.key", "(h k) d", "d h k"),
        *_dense("w_v", "b_v", "attention.self.value", "(h k) d", "d h k"),
        *_dense("w_out", "b_out", "attention.output.dense", "d (h k)", "h k d"),
        *_norm("attn_norm", "attention.output.LayerNorm"),
        *_dense("w_in", "b_in", "intermediate.dense", "f d", "d f"),
        *_dense("w_down", "b_down", "output.dense", "d f", "f d"),
        *_norm("mlp_norm", "output.LayerNorm"),
    ),
)
# The output matrix is the word embeddings (tied), so the head's own tensors are the transform and a bias.
MLM_HEAD = (
    *_dense("w_transform", "b_transform", "cls.predictions.transform.dense", "e d", "d e"),
    *_norm("transform_norm", "cls.predictions.transform.LayerNorm"),
    Tensor("output_bias", "cls.predictions.bias", "v", "v"),
)
CLASSIFIER_HEAD = (
    *_dense("w_pool", "b_pool", "bert.pooler.dense", "e d", "d e"),
    *_dense("w_classes", "b_classes", "classifier", "c d", "d c"),
)
# Tensors a checkpoint may hold that carry nothing: the position ids older versions saved (a buffer, 0..P-1).
CARRY_NOTHING = (r"bert\.embeddings\.position_ids",)
# For the MLM also the decoder's tied copies (of the word embeddings and of cls.predictions.bias), and the pooler and
# next-sentence head of a pre-training checkpoint (bert-base-uncased's), which BertForMaskedLM drops too.
MLM_CARRY_NOTHING = (r"cls\.predictions\.decoder\.(weight|bias)", r"bert\.pooler\..*", r"cls\.seq_relationship\..*")


@dataclasses.dataclass(frozen=True)
class EncoderArchitecture(Architecture):
    """A Hugging Face BERT class as settings of jaxtrain's encoder: with the MLM head, or (`classifier`) BERT's pooler
    and a classifier of config.json's labels. `ignored`: patterns of the tensors that carry nothing."""

    classifier: bool = False
    ignored: tuple[str, ...] = CARRY_NOTHING

    def settings(self, hf: dict[str, Any], source: str) -> dict[str, Any]:
        """jaxtrain encoder settings (`models.bert.EncoderConfig` fields; `ClassifierConfig`'s for a classifier)
        equal to config.json `hf`."""
        missing = [key for key, _ in SHAPE_FIELDS if key not in hf]
        if missing:
            raise ArchitectureError(f"{source} lacks {', '.join(missing)}: a {self.name} config.json sets them.")
        self._refuse_unsupported(hf, source)
        settings = {
            **{ours: hf[key] for key, ours in SHAPE_FIELDS},
            **{ours: hf.get(key, default) for key, ours, default in DEFAULTED_FIELDS},
            "positions": "learned",
            "norm": "post",
            "gelu_approximate": GELUS[hf.get("hidden_act", "gelu")],
        }
        return {**settings, "n_classes": n_labels(hf), "pooling": "first"} if self.classifier else settings

    def _refuse_unsupported(self, hf: dict[str, Any], source: str) -> None:
        """Settings jaxtrain's encoder has no equivalent of: an error naming each, never a different model."""
        problems = []
        activation = hf.get("hidden_act", "gelu")
        if activation not in GELUS:
            problems.append(f"hidden_act={activation!r} (jaxtrain's encoder computes GELU: {', '.join(GELUS)})")
        positions = hf.get("position_embedding_type", "absolute")
        if positions != "absolute":
            problems.append(
                f"position_embedding_type={positions!r} (jaxtrain's encoder learns absolute positions: 'absolute')"
            )
        if hf.get("is_decoder") or hf.get("add_cross_attention"):
            problems.append("is_decoder or add_cross_attention (jaxtrain's encoder attends both ways, to itself)")
        if self.classifier:
            kind = hf.get("problem_type") or ("regression" if n_labels(hf) == 1 else "single_label_classification")
            if kind != "single_label_classification":
                problems.append(
                    f"problem_type={kind!r} (jaxtrain's classifier picks one of 2 or more labels by softmax: "
                    "single_label_classification)"
                )
        elif not hf.get("tie_word_embeddings", True):
            problems.append("tie_word_embeddings=false (jaxtrain's MLM head scores tokens by the word embeddings)")
        if problems:
            raise ArchitectureError(
                f"{source} ({self.name}) has settings jaxtrain cannot express: {'; '.join(problems)}."
            )

    def config(self, model: Any, dtype: str, imported: dict[str, Any] | None = None) -> dict[str, Any]:
        """config.json for encoder `model` as this class, over the config it was imported from (which keeps what
        jaxtrain does not model: token ids, dropout, label names)."""
        config = dict(imported or {})
        config.update({key: getattr(model, ours) for key, ours in SHAPE_FIELDS})
        config.update({key: getattr(model, ours) for key, ours, _ in DEFAULTED_FIELDS})
        config.update(
            architectures=[self.name],
            model_type=self.model_type,
            hidden_act=_activation(model, imported),
            position_embedding_type="absolute",
            is_decoder=False,
            add_cross_attention=False,
            dtype=dtype,
        )
        config.pop("torch_dtype", None)  # transformers 5 reads `dtype`
        if not self.classifier:
            return {**config, "tie_word_embeddings": True}
        config.pop("num_labels", None)  # it would override id2label's count: the labels below are the count
        return {**config, **_labels(model.n_classes, imported)}

    def ignorable(self, name: str, model: Any) -> bool:
        return any(re.fullmatch(pattern, name) for pattern in self.ignored)


BERT_MLM = EncoderArchitecture(
    "BertForMaskedLM", "bert", "bert", EMBEDDINGS + BLOCKS + MLM_HEAD, ignored=CARRY_NOTHING + MLM_CARRY_NOTHING
)
BERT_CLASSIFIER = EncoderArchitecture(
    "BertForSequenceClassification", "bert", "bert_classifier", EMBEDDINGS + BLOCKS + CLASSIFIER_HEAD, classifier=True
)
ENCODERS = {a.name: a for a in (BERT_MLM, BERT_CLASSIFIER)}


def n_labels(hf: dict[str, Any]) -> int:
    """The classes of a classifier's config.json, as transformers counts them: `num_labels` where given, else the
    labels `id2label` names, else 2."""
    return hf.get("num_labels") or len(hf.get("id2label") or {}) or 2


def _activation(model: Any, imported: dict[str, Any] | None) -> str:
    """hidden_act for `model`'s GELU: the imported name where it computes the same, else gelu or gelu_new."""
    given = (imported or {}).get("hidden_act")
    if GELUS.get(given) == model.gelu_approximate:
        return given
    return "gelu_new" if model.gelu_approximate else "gelu"


def _labels(n_classes: int, imported: dict[str, Any] | None) -> dict[str, Any]:
    """id2label and label2id of `n_classes` classes: the imported names where there are as many, else
    transformers' own (LABEL_0, ...)."""
    names = (imported or {}).get("id2label") or {}
    if len(names) != n_classes:
        names = {str(i): f"LABEL_{i}" for i in range(n_classes)}
    return {"id2label": names, "label2id": {name: int(i) for i, name in names.items()}}


def architecture_for(model_name: str, model: Any) -> EncoderArchitecture:
    """The BERT class that computes encoder `model` (an EncoderConfig or ClassifierConfig) of registered model
    `model_name` (bert, bert_classifier); an error naming each setting no BERT class has."""
    arch = next(a for a in ENCODERS.values() if a.model == model_name)
    problems = []
    if model.norm != "post":
        problems.append(f"norm={model.norm!r} (BERT normalises after each block: norm=post)")
    if model.positions != "learned":
        problems.append(f"positions={model.positions!r} (BERT learns a table of positions: positions=learned)")
    if not model.type_vocab_size:
        problems.append("type_vocab_size=0 (BERT always adds a token type's embedding: type_vocab_size >= 1)")
    if arch.classifier and model.pooling != "first":
        problems.append(f"pooling={model.pooling!r} (BERT's classifier reads the first token: pooling=first)")
    if problems:
        raise ArchitectureError(
            f"model {model_name} has settings no Hugging Face {arch.name} computes: {'; '.join(problems)}. Only an "
            "encoder trained with those settings exports."
        )
    return arch
