"""Setting JAX up before it starts: simulated CPU devices and the compilation cache.

Importing this module imports no JAX (the command line parses its flags first); each function imports it when called.

>>> import jaxtrain
>>> jaxtrain.use_simulated_devices(8)   # first thing in a script or notebook, before JAX runs anything
>>> import jax
>>> jax.device_count()
8
"""

from __future__ import annotations

import os
from pathlib import Path

from jaxtrain.errors import UserInputError


class DeviceSetupError(UserInputError):
    """Simulated devices asked for after JAX started with other devices."""


def use_simulated_devices(count: int) -> None:
    """Make JAX's CPU backend expose `count` devices, before JAX runs anything. Calling it again with the same
    count is harmless (a re-run notebook cell); another count once JAX has started is a `DeviceSetupError`."""
    import jax

    jax.config.update("jax_platforms", "cpu")
    try:
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError:  # the backend already exists (e.g. a notebook that ran JAX code first)
        have = jax.devices()
        if len(have) != count or have[0].platform != "cpu":
            raise DeviceSetupError(
                f"{count} simulated CPU devices were asked for, but JAX already started with {len(have)} "
                f"{have[0].platform} devices; their number is fixed once JAX has run anything. Restart the "
                f"process (or notebook kernel) and set up the devices first."
            ) from None


def enable_compilation_cache() -> None:
    """Reuse compiled steps across runs (a small model's compile drops from seconds to a fraction of one), in
    `$JAXTRAIN_COMPILATION_CACHE` or else `~/.cache/jaxtrain/xla`."""
    import jax

    cache = os.environ.get("JAXTRAIN_COMPILATION_CACHE", str(Path.home() / ".cache" / "jaxtrain" / "xla"))
    jax.config.update("jax_compilation_cache_dir", cache)
