"""The CPU peak behind MFU: measured as a plain jitted matmul reaches it, cached only when the machine was quiet."""

import os

import jax
import numpy as np
import pytest

from jaxtrain.analysis import flops


def test_the_measured_cpu_peak_is_a_plain_matmul_rate(monkeypatch):
    # No timing here (a timed assertion fails on a busy machine): a clock that advances by a known amount per call
    # says the figure is 2 n^3 over the fastest repeat, and the compiled program says what was timed is one matmul.
    timed = []
    ticks = iter(np.arange(0.0, 1000.0, 0.5).tolist())  # every call of perf_counter moves 0.5 s on
    monkeypatch.setattr(flops.time, "perf_counter", lambda: next(ticks))
    # The process's CPU clock moves half as fast as the cores' wall time: half the cores were busy with other work.
    cpu = iter(np.arange(0.0, 1000.0, 0.75 * len(os.sched_getaffinity(0))).tolist())
    monkeypatch.setattr(flops.time, "process_time", lambda: next(cpu))
    real_times = flops.matmul_times

    def recording_times(matmul, a, repeats):
        timed.append((matmul.trace(a, a).jaxpr, matmul.lower(a, a).compile().as_text()))
        return real_times(matmul, a, repeats)

    monkeypatch.setattr(flops, "matmul_times", recording_times)
    peak = flops.measure_cpu_peak("float32", sizes=(64, 128), repeats=3)
    assert (peak.size, peak.flops, peak.spread, peak.cpu_share) == (128, 2.0 * 128**3 / 0.5, 0.0, 0.5)
    assert not peak.steady  # repeats alike, but on half the machine: steady load elsewhere
    for size, (jaxpr, hlo) in zip((64, 128), timed):
        assert [eqn.primitive.name for eqn in jaxpr.eqns] == ["dot_general"], jaxpr  # a matmul and nothing else
        assert hlo.count(" dot(") == 1 and f"f32[{size},{size}]" in hlo, hlo


def steady(gflops: float, spread: float, cpu_share: float = 0.97) -> flops.CpuPeak:
    return flops.CpuPeak(gflops * 1e9, "float32", 2048, spread, measured="2026-12-02", cpu_share=cpu_share)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setattr(flops, "CACHE_DIR", tmp_path)
    monkeypatch.setattr(flops, "_UNSTEADY", {})
    monkeypatch.setattr(flops.time, "sleep", lambda _: None)
    monkeypatch.delenv("JAXTRAIN_CPU_PEAK_FLOPS")
    return tmp_path / flops.CACHE_FILE


def test_a_steady_measurement_is_cached_with_its_spread(cache, monkeypatch):
    monkeypatch.setattr(flops, "measure_cpu_peak", lambda dtype: steady(200, 0.02))
    peak, cached = flops.cpu_peak("float32")
    assert (peak.flops, cached) == (200e9, False)
    monkeypatch.setattr(flops, "measure_cpu_peak", lambda dtype: pytest.fail("measured again"))
    again, cached = flops.cpu_peak("float32")
    assert again == peak and cached and '"spread": 0.02' in cache.read_text()
    figure, source = flops.peak_flops(jax.devices()[:1], "float32")
    assert figure == 200e9 and "2048x2048 matmul, best of 5, spread 2%, 97% of the cores" in source
    assert source.endswith("cached")


def test_a_busy_machine_is_measured_again_and_its_figure_not_kept(cache, monkeypatch):
    tries = iter([steady(90, 0.4), steady(150, 0.25), steady(120, 0.02, cpu_share=0.5)])
    monkeypatch.setattr(flops, "measure_cpu_peak", lambda dtype: next(tries))
    figure, source = flops.peak_flops(jax.devices()[:1], "float32")
    assert figure == 150e9  # the fastest of the tries: other work only slows a matmul down
    assert "not cached: the machine was busy" in source and not cache.exists()
    assert flops.peak_flops(jax.devices()[:1], "float32")[0] == 150e9  # once per process, not once per run


def test_the_environment_gives_the_peak_without_measuring(monkeypatch):
    monkeypatch.setenv("JAXTRAIN_CPU_PEAK_FLOPS", "3e11")
    monkeypatch.setattr(flops, "measure_cpu_peak", lambda dtype: pytest.fail("measured"))
    assert flops.peak_flops(jax.devices(), "bfloat16") == (3e11, "JAXTRAIN_CPU_PEAK_FLOPS")


def test_a_peak_a_run_exceeded_is_forgotten_and_measured_again(cache, monkeypatch):
    """A cached figure a run went faster than was measured while other work held the cores (a busy machine only
    slows a matmul down): it is dropped, so the next run measures again, and the reason names the way out."""
    monkeypatch.setattr(flops, "measure_cpu_peak", lambda dtype: steady(20, 0.02))  # steady, but under load
    flops.cpu_peak("float32")
    why = flops.peak_too_low(jax.devices()[:1], "float32", 90e9)
    assert "measured while other work held the cores" in why and "JAXTRAIN_CPU_PEAK_FLOPS above 9e+10" in why
    monkeypatch.setattr(flops, "measure_cpu_peak", lambda dtype: steady(200, 0.02))
    assert flops.cpu_peak("float32") == (steady(200, 0.02), False)  # measured again, not read from the cache
    flops.peak_too_low(jax.devices()[:1], "bfloat16", 90e9)  # another dtype's figure is left alone
    assert flops.cpu_peak("float32")[1]


def test_a_given_peak_a_run_exceeded_is_named(monkeypatch):
    monkeypatch.setenv("JAXTRAIN_CPU_PEAK_FLOPS", "1e6")
    assert flops.peak_too_low(jax.devices(), "float32", 5e9).startswith("JAXTRAIN_CPU_PEAK_FLOPS=1e6 is below")
