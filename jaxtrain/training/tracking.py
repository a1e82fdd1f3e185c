"""Weights & Biases as a metrics sink, beside the JSONL file and TensorBoard (`tracking.wandb_project`,
`--wandb-project`).

The W&B run's id is the run's fingerprint (`run_identity.fingerprint`), so a resumed run continues the same W&B run;
its config is the run's resolved config, logged once. Without W&B credentials (`WANDB_API_KEY`, or `wandb login`'s)
or with `tracking.wandb_mode=offline` the run is written offline into `<dir>/wandb/offline-run-*`: `wandb sync` on that
directory uploads it later. W&B keeps the first value it is given for a step: after a rollback the JSONL holds the
trajectory as trained, W&B the values first logged (its own rule). Needs `pip install -e ".[wandb]"`.
"""

from __future__ import annotations

import netrc
import numbers
import os
from pathlib import Path
from typing import Any

from jaxtrain.errors import UserInputError
from jaxtrain.run_config import WANDB_MODES


class TrackingError(UserInputError):
    """An experiment tracker that cannot be used as asked."""


def wandb_module() -> Any:
    """The `wandb` package (an optional dependency, imported only when asked for)."""
    try:
        import wandb
    except ImportError:
        raise TrackingError(
            "tracking.wandb_project is set, but wandb is not installed: pip install 'jaxtrain[wandb]' (or pip install "
            "wandb), or leave tracking.wandb_project empty."
        ) from None
    return wandb


def resolved_mode(mode: str) -> str:
    """`auto`: online where W&B credentials are found, else offline."""
    if mode not in WANDB_MODES:
        raise TrackingError(f"tracking.wandb_mode={mode!r}: use one of {', '.join(WANDB_MODES)}.")
    if mode != "auto":
        return mode
    return "online" if os.environ.get("WANDB_API_KEY") or _netrc_has_wandb() else "offline"


def _netrc_has_wandb() -> bool:
    try:
        hosts = netrc.netrc().hosts
    except (OSError, netrc.NetrcParseError):
        return False
    return any("wandb" in host for host in hosts)


class WandbSink:
    """Logs each record's numbers to a W&B run of `project` under `directory`, identified by `run`."""

    def __init__(self, project: str, directory: str | Path, run: str, config: dict[str, Any], mode: str = "auto"):
        wandb = wandb_module()
        self.mode = resolved_mode(mode)
        Path(directory).mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=project,
            dir=str(directory),
            id=run or None,
            resume="allow",
            mode=self.mode,
            config=config,
            settings=wandb.Settings(silent=True, console="off"),
        )

    @property
    def files(self) -> Path:
        """The directory the run's local files are in (for offline runs: what `wandb sync` uploads)."""
        return Path(self.run.dir).parent

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        values = {k: float(v) for k, v in metrics.items() if isinstance(v, numbers.Real) and not isinstance(v, bool)}
        self.run.log(values, step=step)

    def close(self) -> None:
        """Finish the run and wait until its files are written. `finish()` returns once the W&B service has the
        run's data, and the service writes the run file's last block only when it closes the run, later: on a busy
        machine a reader (`wandb sync`, a test) found it empty. Shutting the service down waits for that; it is
        skipped while another W&B run of this process is still open (it would end that run too), and the next
        `wandb.init` starts a new service."""
        self.run.finish()
        wandb = wandb_module()
        if wandb.run is None:
            wandb.teardown()
