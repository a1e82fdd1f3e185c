"""Execute a notebook on a fresh kernel and save it with its outputs (figures included), so that a reader on the web
sees them; tests/test_notebook.py re-executes it and compares its figures with the saved ones.

    python scripts/run_notebook.py notebooks/quickstart.ipynb

The kernel runs as the test runs it: a fixed CPU peak (no measurement), an empty compilation cache.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parent.parent
KERNEL_ENV = {"JAXTRAIN_CPU_PEAK_FLOPS": "1e11"}  # the figures must not depend on a timing of this machine


def execute(path: Path) -> nbformat.NotebookNode:
    """The notebook at `path`, executed top to bottom on a fresh kernel in the repository root."""
    nb = nbformat.read(path, as_version=4)
    with tempfile.TemporaryDirectory() as cache:
        env = {**KERNEL_ENV, "JAXTRAIN_COMPILATION_CACHE": cache}
        saved = {k: os.environ.get(k) for k in (*env, "MPLBACKEND")}
        os.environ.update(env)
        os.environ.pop("MPLBACKEND", None)  # the kernel's inline backend draws the figures
        try:
            NotebookClient(
                nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}
            ).execute()
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
    return nb


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("notebooks", nargs="+", type=Path)
    args = parser.parse_args(argv)
    for path in args.notebooks:
        nb = execute(path)
        partial = path.with_name(f".{path.name}.partial")
        nbformat.write(nb, partial)
        partial.replace(path)  # a failed run leaves the committed notebook as it was
        print(f"executed and saved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
