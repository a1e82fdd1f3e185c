"""Throughput and MFU as the real loop logs them: a step's time is taken once its outputs are ready, so it lands in
the step it belongs to, and no figure exceeds what the devices can do."""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TINY

from jaxtrain.run_config import apply_overrides, default_config
from jaxtrain.training import setup as run_setup
from jaxtrain.training.loop import train
from jaxtrain.training.profiling import StepProfiler

SLOW_STEP, SLOW_S = 3, 1.0  # long beside a gpt-tiny step (~20 ms), short enough for the default suite
RUN = [*TINY, "steps=5", "log_every=1", "eval_every=1000", "progress=false", "mesh=data=8"]


def slowed_in_program(real_step, step_number: int, seconds: float):
    """`real_step`, whose step `step_number` also waits `seconds` on the host, inside the compiled program: its
    outputs are ready only after the wait, as a step that really took that long."""

    def wait_at(counter):
        if int(counter) + 1 == step_number:
            time.sleep(seconds)
        return np.float32(0.0)

    def step(state, batch, **kwargs):
        new_state, metrics = real_step(state, batch, **kwargs)
        waited = jax.pure_callback(wait_at, jax.ShapeDtypeStruct((), jnp.float32), state["step"])
        return new_state, {**metrics, "loss": metrics["loss"] + waited}

    return step


def plant_in_program(monkeypatch) -> None:
    monkeypatch.setattr(run_setup, "train_step", slowed_in_program(run_setup.train_step, SLOW_STEP, SLOW_S))


def plant_in_dispatch(monkeypatch) -> None:
    """Step `SLOW_STEP`'s call returns `SLOW_S` later, as when the CPU client runs a step on the calling thread
    (it does under load): the time is spent before the step's outputs exist, so it is that step's."""
    real_run = StepProfiler.run

    def run(self, number, step):
        if number == SLOW_STEP:
            time.sleep(SLOW_S)
        return real_run(self, number, step)

    monkeypatch.setattr(StepProfiler, "run", run)


def step_times(history: list[dict]) -> dict[int, float]:
    """Each logged step's seconds, as its record's throughput says (log_every=1: one step per record)."""
    tokens = 8 * 32  # TINY: batch_size x seq_len
    return {r["step"]: tokens / r["tokens_per_sec"] for r in history}


@pytest.mark.parametrize("plant", [plant_in_program, plant_in_dispatch], ids=["in_program", "in_dispatch"])
def test_a_slow_step_shows_its_time_in_its_own_record(monkeypatch, plant):
    plant(monkeypatch)
    summary = train(apply_overrides(default_config("gpt-tiny"), RUN), log=lambda *_: None)
    times = step_times(summary["history"])
    assert times[SLOW_STEP] >= SLOW_S, times  # the wait is inside the step: its time holds it, whatever the load
    assert times[SLOW_STEP - 1] < SLOW_S, times  # not the step dispatched before it: it was done before the wait
    assert [r["step_time_s"] for r in summary["history"]] == pytest.approx(list(times.values()), rel=1e-6)


def test_logged_figures_stay_within_what_the_devices_can_do(monkeypatch):
    """The real loop with every step logged and a peak set far below what the CPU does: a step faster than the peak
    says is evidence that the peak is low; the MFU is then reported against the rate seen, never above 1, and the
    log says so."""
    monkeypatch.setenv("JAXTRAIN_CPU_PEAK_FLOPS", "1e6")  # 1 MFLOP/s: every gpt-tiny step runs faster
    lines = []
    summary = train(apply_overrides(default_config("gpt-tiny"), RUN), log=lines.append)
    history, run = summary["history"], summary["run"]
    assert all(0 < r["mfu"] <= 1 for r in history), [r["mfu"] for r in history]
    assert 0 < summary["mfu"] <= 1
    for r in history:  # tokens/s, model FLOPs/s and the logged step time tell one story
        assert r["tokens_per_sec"] == pytest.approx(run.tokens_per_step / r["step_time_s"], rel=1e-6)
    raised = [line for line in lines if "above the peak" in line]
    assert raised and "JAXTRAIN_CPU_PEAK_FLOPS" in raised[0], lines
