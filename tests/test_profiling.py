"""Profiler traces of chosen steps (read back with the profiler's own reader), the settings that choose them, and the
device memory profile an out-of-memory step leaves behind."""

from __future__ import annotations

import gzip

import jax
import pytest
from helpers import TINY

from jaxtrain.cli import _run_config, _train_parser
from jaxtrain.errors import ConfigError
from jaxtrain.run_config import apply_overrides, default_config
from jaxtrain.training.loop import train
from jaxtrain.training.profiling import DeviceMemoryError, memory_profile_on_oom, parse_profile_steps


def test_a_profile_holds_the_chosen_steps_and_their_device_work(tmp_path):
    overrides = ["steps=5", "log_every=1", "eval_every=100", "progress=false", "mesh=data=2"]
    overrides += ["profile_steps=2:4", f"profile_dir={tmp_path / 'profile'}"]
    train(
        apply_overrides(default_config("gpt-tiny"), [*TINY, *overrides]), log=lambda *_: None, devices=jax.devices()[:2]
    )
    [trace] = (tmp_path / "profile").glob("plugins/profile/*/*.xplane.pb")
    data = jax.profiler.ProfileData.from_file(str(trace))
    events = [(line.name, event) for plane in data.planes for line in plane.lines for event in line.events]
    annotated = {dict(event.stats)["step_num"] for _, event in events if event.name == "train"}
    assert annotated == {2, 3}
    # The compiled step ran inside the trace, not only its dispatch: XLA's executor lines have its work.
    assert any("XLA" in line and event.name.startswith("ThunkExecutor") for line, event in events)


@pytest.mark.parametrize("text", ["3:3", "0:2", "5", "a:b", "4:2"])
def test_bad_profile_steps_are_refused_by_name(text):
    with pytest.raises(ConfigError, match=f"tracking.profile_steps='{text}'.*START:STOP"):
        parse_profile_steps(text)


def test_profile_steps_without_a_directory_are_refused_before_compiling():
    cfg = apply_overrides(default_config("gpt-tiny"), [*TINY, "profile_steps=1:2", "progress=false"])
    with pytest.raises(ConfigError, match="needs tracking.profile_dir"):
        train(cfg, log=lambda *_: None)


def test_the_command_line_sets_the_profile():
    args = _train_parser().parse_args(["--model", "gpt-tiny", "--profile-steps", "10:13", "--profile-dir", "p"])
    cfg = _run_config(args)
    assert (cfg.tracking.profile_steps, cfg.tracking.profile_dir) == ("10:13", "p")
    assert parse_profile_steps(cfg.tracking.profile_steps) == range(10, 13)


def test_out_of_memory_saves_a_device_memory_profile_and_names_it(tmp_path):
    jax.numpy.ones(1024).block_until_ready()  # something on the device for the profile to show
    oom = jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 9.00GiB.")
    with pytest.raises(DeviceMemoryError, match="step 7 ran out of device memory") as caught:
        memory_profile_on_oom(7, tmp_path)(oom)
    path = tmp_path / "device_memory_step7.prof"
    assert str(path) in str(caught.value)
    assert gzip.decompress(path.read_bytes())  # pprof's format: a gzipped profile
    assert memory_profile_on_oom(7, tmp_path / "other")(jax.errors.JaxRuntimeError("INTERNAL: boom")) is None
    assert not (tmp_path / "other").exists()
