"""The CPU peak behind MFU: measured as a plain jitted matmul reaches it, cached only when the machine was quiet."""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain.analysis import flops

SIZES = (1024, 2048)  # the test's sizes: enough to find the rate, short enough for the default suite


def plain_matmul_rate(size: int, repeats: int = 5) -> float:
    """The best FLOP/s of `a @ a` written the plainest way, timed here (not with the library's helper)."""
    a = jnp.asarray(np.random.default_rng(1).standard_normal((size, size)), jnp.float32)
    matmul = jax.jit(jnp.matmul)
    matmul(a, a).block_until_ready()
    best = float("inf")
    for _ in range(repeats + 1):
        start = time.perf_counter()
        matmul(a, a).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2.0 * size**3 / best


@pytest.mark.slow  # a timing: 10 s on a quiet machine, and only meaningful on one
def test_the_measured_cpu_peak_is_a_plain_matmul_rate():
    # Alternated, best of each: a burst of other work on the machine lowers one round, not the comparison.
    ours, plain = [], []
    for _ in range(4):
        ours.append(flops.measure_cpu_peak("float32", sizes=SIZES).flops)
        plain.append(max(plain_matmul_rate(size) for size in SIZES))
    ratio = max(ours) / max(plain)
    print(f"\nmeasured peak {max(ours) / 1e9:.1f} GFLOP/s, plain matmul {max(plain) / 1e9:.1f}: ratio {ratio:.3f}")
    assert ratio == pytest.approx(1.0, abs=0.15)


def steady(gflops: float, spread: float) -> flops.CpuPeak:
    return flops.CpuPeak(flops=gflops * 1e9, dtype="float32", size=2048, spread=spread, measured="2026-12-02")


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
    assert figure == 200e9 and "2048x2048 matmul, best of 5, spread 2%" in source and source.endswith("cached")


def test_a_busy_machine_is_measured_again_and_its_figure_not_kept(cache, monkeypatch):
    tries = iter([steady(90, 0.4), steady(150, 0.25), steady(120, 0.3)])
    monkeypatch.setattr(flops, "measure_cpu_peak", lambda dtype: next(tries))
    figure, source = flops.peak_flops(jax.devices()[:1], "float32")
    assert figure == 150e9  # the steadiest of the tries
    assert "not cached: the machine was busy" in source and not cache.exists()
    assert flops.peak_flops(jax.devices()[:1], "float32")[0] == 150e9  # once per process, not once per run


def test_the_environment_gives_the_peak_without_measuring(monkeypatch):
    monkeypatch.setenv("JAXTRAIN_CPU_PEAK_FLOPS", "3e11")
    monkeypatch.setattr(flops, "measure_cpu_peak", lambda dtype: pytest.fail("measured"))
    assert flops.peak_flops(jax.devices(), "bfloat16") == (3e11, "JAXTRAIN_CPU_PEAK_FLOPS")
