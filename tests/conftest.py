"""Tests run on 8 simulated CPU devices, set up here before JAX starts a backend."""

import os
import tempfile
from pathlib import Path

import jax
import pytest

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)
# A per-run compilation cache: repeated compiles of the same step inside one run come back in milliseconds.
jax.config.update(
    "jax_compilation_cache_dir", os.environ.get("JAXTRAIN_TEST_XLA_CACHE", tempfile.mkdtemp(prefix="xla-"))
)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)

SHARED_DATA = Path(__file__).resolve().parent.parent.parent / "shared" / "data"


def shared_file(name: str) -> Path:
    """A file from ../shared/data, or skip the test saying why."""
    path = SHARED_DATA / name
    if not path.is_file():
        pytest.skip(f"{path} is absent (it ships beside the project checkout, not with it)")
    return path
