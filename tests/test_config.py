"""Presets and key=value overrides."""

import pytest

from jaxtrain.config import ConfigError, apply_overrides, default_config, describe_config


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


def test_wrong_type():
    with pytest.raises(ConfigError, match=r"n_layers=three: expected a int"):
        apply_overrides(default_config("gpt"), ["n_layers=three"])


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
