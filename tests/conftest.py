"""Tests run on 8 simulated CPU devices, set up here before JAX starts a backend."""

import os
import shutil
import tempfile
from pathlib import Path

import jax
import pytest
from jax.experimental.compilation_cache import compilation_cache

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)
# One compilation cache per test run: repeated compiles of a program come back in milliseconds, for every process of
# the run: pytest-xdist's workers (they inherit this environment from the process that starts them), the CLI run in
# process (which would otherwise turn JAX to the user's ~/.cache/jaxtrain/xla) and the processes tests start. No
# run's time depends on what an earlier run left behind.
MADE_CACHE = "JAXTRAIN_TEST_XLA_CACHE" not in os.environ
if MADE_CACHE:
    os.environ["JAXTRAIN_TEST_XLA_CACHE"] = tempfile.mkdtemp(prefix="jaxtrain-test-xla-")
XLA_CACHE = os.environ["JAXTRAIN_TEST_XLA_CACHE"]
os.environ["JAXTRAIN_COMPILATION_CACHE"] = XLA_CACHE
jax.config.update("jax_compilation_cache_dir", XLA_CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)

# MFU is not what tests check, and a peak timed under the suite's own load would differ between runs: runs take this
# figure instead of measuring (tests/test_flops.py measures it).
os.environ.setdefault("JAXTRAIN_CPU_PEAK_FLOPS", "1e11")

# Ray's local sessions (the tests' own and those of the processes they start) run their workers at the tests'
# priority, not at Ray's default nice 15: beside the other pytest-xdist worker a niced Ray worker got a few percent
# of a core, and a Ray test of 15 s alone took 120 s in the suite. Nor does Ray prestart idle workers for them: the
# engine's actors ask for their own environment, so those workers would only take CPU.
os.environ.setdefault("RAY_worker_niceness", "0")
os.environ.setdefault("RAY_prestart_worker_first_driver", "0")

SHARED_DATA = Path(__file__).resolve().parent.parent.parent / "shared" / "data"
if SHARED_DATA.is_dir():  # `data.source=digits` names a file in this folder
    os.environ.setdefault("JAXTRAIN_DATA_DIR", str(SHARED_DATA))


def shared_file(name: str) -> Path:
    """A file from ../shared/data. Where it is absent the test skips saying why, except under CI (CI=true), where
    ../shared is present: there a missing file is a broken path, and a skip would hide it."""
    path = SHARED_DATA / name
    if not path.is_file():
        why = f"{path} is absent (it ships beside the project checkout, not with it)"
        if os.environ.get("CI", "").lower() in ("true", "1"):
            pytest.fail(f"{why}; under CI=true it must be there", pytrace=False)
        pytest.skip(why)
    return path


BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"  # each compile JAX hands to the backend, or its cache
CACHE_HIT = "/jax/compilation_cache/cache_hits"


@pytest.fixture
def fresh_compiles():
    """Compiles inside the test bypass the persistent compilation cache, so XLA really compiles and prints what it
    prints only then (e.g. its rematerialization warnings). Yields {"compiles": n, "cache_hits": n} counted during
    the test, for it to prove that its compiles happened."""
    counts = {"compiles": 0, "cache_hits": 0}

    def on_compile(event: str, _secs: float, **_) -> None:
        counts["compiles"] += event == BACKEND_COMPILE

    def on_event(event: str, **_) -> None:
        counts["cache_hits"] += event == CACHE_HIT

    # The cache decides once per process whether it is in use: reset it around the change, both ways.
    enabled = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    jax.monitoring.register_event_duration_secs_listener(on_compile)
    jax.monitoring.register_event_listener(on_event)
    try:
        yield counts
    finally:
        jax.monitoring.unregister_event_duration_listener(on_compile)
        jax.monitoring.unregister_event_listener(on_event)
        jax.config.update("jax_enable_compilation_cache", enabled)
        compilation_cache.reset_cache()


# XLA:CPU's code generation at LLVM -O0 for the default suite, whose time is compiling small programs, not running
# them: tests/test_llama.py and tests/test_pipeline.py took 55 s instead of 87 s with -n 2 (-O1: 84 s). What the tests
# check (HLO, collectives, numerics within float32 tolerance) is decided before LLVM. The slow set's learning runs
# are the other way round (a 500-step run: 63 s at -O0 against 35 s), so `-m slow` keeps XLA's default. Set here, in
# each test process before its backend starts, and inherited by the processes the tests start.
FAST_COMPILE = "--xla_backend_optimization_level=0"


def pytest_configure(config) -> None:
    if config.option.markexpr == "not slow" and FAST_COMPILE not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE}".strip()


@pytest.fixture
def optimized_subprocesses(monkeypatch):
    """The processes this test starts build XLA:CPU's code at its default level: they run hundreds of steps (the
    bring-your-own notebook's kernel: 94 s at -O0 against 63 s)."""
    flags = os.environ.get("XLA_FLAGS", "").replace(FAST_COMPILE, "").strip()
    monkeypatch.setenv("XLA_FLAGS", flags)


def pytest_unconfigure(config) -> None:
    """The run's compilation cache goes with the run, once, from the process that made it (not an xdist worker)."""
    if MADE_CACHE and not hasattr(config, "workerinput"):
        shutil.rmtree(XLA_CACHE, ignore_errors=True)
