"""README's way in: the commands of its first screen run, in order, in a fresh clone (slow); it names every extra,
and CI, which must run every test, has every extra installed."""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def first_screen() -> list[str]:
    """The command lines of README's first fenced block, comments and all, as a shell would take them."""
    block = re.search(r"^```bash\n(.*?)^```", README.read_text(), flags=re.M | re.S).group(1)
    return [line for line in block.splitlines() if line.strip()]


def extras() -> dict[str, list[str]]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def missing(requirement: str) -> list[str]:
    """The distributions `requirement` needs that are not installed: itself, and for `jax[tpu]` what its extra adds."""
    req = Requirement(requirement)
    try:
        dist = importlib.metadata.distribution(req.name)
    except importlib.metadata.PackageNotFoundError:
        return [req.name]
    needs = [Requirement(r) for r in dist.requires or []]
    wanted = [r.name for r in needs if r.marker and any(r.marker.evaluate({"extra": e}) for e in req.extras)]
    return [name for name in wanted if not _installed(name)]


def _installed(name: str) -> bool:
    try:
        importlib.metadata.distribution(name)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def test_readme_names_every_extra():
    text = README.read_text()
    unnamed = [name for name in extras() if f"`{name}`" not in text and f".[{name}]" not in text]
    assert not unnamed, f"README.md does not say what the extras {unnamed} are for"


def test_every_extra_is_installed_under_ci():
    """Tests that need an extra skip where it is absent; CI installs every extra (.ci/run), so there a missing one is a
    broken install, which this test turns into a failure instead of a row of skips."""
    absent = {name: m for name, reqs in extras().items() if (m := [d for r in reqs for d in missing(r)])}
    if not absent:
        return
    why = f"extras not installed: {absent}; their tests skip"
    if os.environ.get("CI", "").lower() in ("true", "1"):
        pytest.fail(f"{why}, and CI installs every extra", pytrace=False)
    pytest.skip(why)


@pytest.mark.slow
def test_first_screen_runs_in_a_fresh_clone(tmp_path):
    """Each command of README's first screen, as written, in order, in a fresh clone of this checkout (its committed
    state). Two kinds of line are left out: the install line (this test runs in an environment that already has it:
    the clone's code comes first on PYTHONPATH, this interpreter's bin/ first on PATH, for `python` and `jaxtrain`),
    and the test-suite lines (this test is part of that suite)."""
    clone = tmp_path / "jaxtrain"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": str(clone)}
    lines = first_screen()
    assert "pip install" in lines[0] and any("pytest" in line for line in lines), lines  # what we skip is there
    commands = [line for line in lines[1:] if "pytest" not in line]
    assert len(commands) >= 2, commands
    for command in commands:
        done = subprocess.run(command, shell=True, cwd=clone, env=env, capture_output=True, text=True, timeout=1200)
        assert done.returncode == 0, f"{command}\nexit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
