"""With several processes, a failed save ends every process of the job within seconds, each with exit status 74.

Left alone, a job whose save failed on one process hangs: its peers wait in Orbax's barriers for a process that will
never arrive (a device collective without a timeout while the step directory is created, JAX's distributed barrier
with AsyncOptions' 20 minutes while the background write is committed), and the failing process, exiting, waits in
JAX's shutdown barrier for them (5 minutes). So the failing process publishes the failure in JAX's coordination
service (its key-value store) before it raises; every other process watches that key from a thread and, when it
appears, says why, joins JAX's shutdown (so the failing process exits cleanly, as the command line makes it) and exits
at once with the same status (its own main thread is blocked in a barrier that no exception can reach).
"""

from __future__ import annotations

import os
import sys
import threading

import jax
from jax._src import distributed  # the coordination service's client, as Orbax's own signalling uses it

from jaxtrain.errors import CHECKPOINT_WRITE_FAILED_EXIT

_KEY = "jaxtrain/checkpoint_write_failed"
_POLL_MS = 500


class SaveFailureBroadcast:
    """Publish this process's failed save to the job, and end this process when another's is published. Does
    nothing with one process."""

    def __init__(self):
        self.client = distributed.global_state.client if jax.process_count() > 1 else None
        self.failed_here = threading.Event()
        self.stopped = threading.Event()
        self.watcher = None
        if self.client is not None:
            self.watcher = threading.Thread(target=self._watch, name="jaxtrain-save-failure", daemon=True)
            self.watcher.start()

    def publish(self, message: str) -> None:
        """Tell every process of the job that a save failed here, with `message`; this process raises it itself."""
        self.failed_here.set()
        if self.client is not None:
            self.client.key_value_set(_KEY, f"process {jax.process_index()}: {message}", allow_overwrite=True)

    def close(self) -> None:
        self.stopped.set()
        if self.watcher is not None:
            self.watcher.join(timeout=2 * _POLL_MS / 1000)

    def _watch(self) -> None:
        while not self.stopped.is_set():
            try:
                message = self.client.blocking_key_value_get(_KEY, _POLL_MS)
            except Exception:  # noqa: BLE001 - the wait timed out (or the client is shutting down): look again
                continue
            if self.failed_here.is_set() or self.stopped.is_set():
                return  # this process raises its own error and exits as the command line says
            print(f"error: {message}", file=sys.stderr, flush=True)
            distributed.shutdown()  # meets the failing process in JAX's shutdown barrier
            os._exit(CHECKPOINT_WRITE_FAILED_EXIT)
