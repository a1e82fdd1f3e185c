"""Presets and key=value overrides."""

import dataclasses

import pytest

from jaxtrain.registry import available_models
from jaxtrain.run_config import (
    ConfigError,
    DataConfig,
    OptimizerConfig,
    TrainConfig,
    apply_overrides,
    default_config,
    describe_config,
)
from jaxtrain.settings import accepts_of, describe_field
from jaxtrain_models.gpt import GPTConfig


def test_short_and_dotted_keys():
    cfg = apply_overrides(
        default_config("gpt"),
        ["n_layers=3", "d_model=128", "optimizer.learning_rate=1e-4", "rules.embed=", "train.steps=7", "remat=full"],
    )
    assert (cfg.model.n_layers, cfg.model.d_model, cfg.model.remat) == (3, 128, "full")
    assert cfg.optimizer.learning_rate == 1e-4 and cfg.train.steps == 7 and cfg.rules == {"embed": ""}


def test_unknown_key_lists_close_matches():
    with pytest.raises(ConfigError, match=r"unknown config key 'n_layer'. Did you mean: .*n_layers"):
        apply_overrides(default_config("gpt"), ["n_layer=3"])


def test_wrong_type_is_named_once():
    for value in ("three", "2.5"):
        with pytest.raises(ConfigError) as err:
            apply_overrides(default_config("gpt"), [f"n_layers={value}"])
        assert str(err.value) == f"model.n_layers={value}: expected an integer >= 1 (transformer blocks)."


@pytest.mark.parametrize("order", [["n_heads=6", "d_model=48"], ["d_model=48", "n_heads=6"]])
def test_overrides_of_a_section_are_applied_together(order):
    cfg = apply_overrides(default_config("gpt-tiny"), order)  # 64 (the preset's d_model) % 6 != 0 on its own
    assert (cfg.model.n_heads, cfg.model.d_model) == (6, 48)
    assert apply_overrides(default_config("gpt-tiny"), ["n_heads=3", "n_heads=4"]).model.n_heads == 4  # last wins


def test_every_bad_value_of_a_section_is_named():
    with pytest.raises(ConfigError, match=r"data.batch_size=0: expected an integer >= 1 .*; data.seq_len=-1: "):
        apply_overrides(default_config("gpt"), ["batch_size=0", "seq_len=-1"])


def test_configs_made_in_python_are_checked_too():
    with pytest.raises(ConfigError, match="optimizer.learning_rate=nan: expected a finite number >= 0"):
        OptimizerConfig(learning_rate=float("nan"))
    with pytest.raises(ConfigError, match="model.n_layers=True: expected an integer >= 1"):
        GPTConfig(n_layers=True)  # a bool is not a count
    with pytest.raises(ConfigError, match="train.steps=2.0: expected an integer"):
        dataclasses.replace(TrainConfig(), steps=2.0)


def choice_fields():
    """(config class, field name, its choices) for every field declared with choices, in every section."""
    classes = {
        OptimizerConfig,
        DataConfig,
        TrainConfig,
        *(type(default_config(name).model) for name in available_models()),
    }
    for cls in sorted(classes, key=lambda c: c.__name__):
        for field in dataclasses.fields(cls):
            if accepts_of(field).choices:
                yield cls, field.name, accepts_of(field).choices


@pytest.mark.parametrize("cls,name,choices", list(choice_fields()), ids=lambda x: getattr(x, "__name__", str(x)))
def test_a_value_outside_the_choices_lists_them(cls, name, choices):
    with pytest.raises(ConfigError) as err:
        cls(**{name: "bogus"})
    assert f"{cls.key(name)}='bogus' is not one of {', '.join(choices)}" in str(err.value)
    for choice in choices:
        cls(**{name: choice})


def test_model_validation_is_reported():
    with pytest.raises(ConfigError, match="d_model=100 must be divisible by n_heads=3"):
        apply_overrides(default_config("gpt"), ["d_model=100", "n_heads=3"])


def test_presets_and_unknown_preset():
    assert default_config("gpt-small").model.d_model == 768
    assert default_config("mlp").data.source == "digits"
    with pytest.raises(ValueError, match="has no preset 'smal'.*Did you mean small"):
        default_config("gpt-smal")


def test_describe_lists_every_key():
    text = describe_config(default_config("gpt"))
    assert "model.n_layers = 4" in text and "optimizer.learning_rate" in text


def test_a_field_is_described_by_its_type_what_it_accepts_and_its_help():
    fields = {f.name: f for f in dataclasses.fields(OptimizerConfig)}
    assert describe_field(OptimizerConfig, fields["beta1"]) == (
        "float >= 0, < 1 · first-moment decay of AdamW, Lion and Muon's AdamW"
    )
    assert describe_field(OptimizerConfig, fields["name"]).startswith(
        "str: one of adamw, sgd, adafactor, lion, muon · "
    )
    assert describe_field(TrainConfig, {f.name: f for f in dataclasses.fields(TrainConfig)}["progress"]).startswith(
        "bool · "
    )
    resnet = type(default_config("resnet").model)
    stage_sizes = {f.name: f for f in dataclasses.fields(resnet)}["stage_sizes"]
    assert describe_field(resnet, stage_sizes) == "tuple[int, ...]"  # no `setting`: its annotation
