"""The docs keep step with the tree: README's package table names every package of the library and every folder of
the checkout; docs/layout.md names every module, every `jaxtrain` command and every script; the notebooks use the
public API only; no doc names a path that exists on one machine only. The tree is read as it is when the test runs."""

from __future__ import annotations

import ast
import fnmatch
import json
import re
import subprocess
from pathlib import Path

import pytest

import jaxtrain

ROOT = Path(__file__).resolve().parent.parent
LAYOUT = ROOT / "docs" / "layout.md"
README = ROOT / "README.md"
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
SCRIPT_FOLDERS = ("scripts", "benchmarks")
# A path of one machine: a home, this project's own work area, or a named temporary file (a bare `/tmp` is fine).
MACHINE_PATH = re.compile(r"(?<![\w.~$-])/(?:work|root|home|Users|tmp/\w|var/folders|opt/pypi)[\w./-]*")


def tracked_paths() -> list[Path]:
    """Files of the checkout: git's tracked and not-ignored untracked files that exist (a move in progress counts as
    its new place); without git, every file outside hidden and build folders."""
    try:
        listing = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        files = [Path(name) for name in listing]
    except (OSError, subprocess.CalledProcessError):
        files = [p.relative_to(ROOT) for p in ROOT.rglob("*") if p.is_file()]
    junk = {"__pycache__", "build", "dist", "runs"}
    return [f for f in files if (ROOT / f).is_file() and not any(p.startswith(".") or p in junk for p in f.parts)]


def top_folders() -> list[str]:
    return sorted({f.parts[0] for f in tracked_paths() if len(f.parts) > 1} - {"jaxtrain"})


def library_packages() -> dict[str, list[str]]:
    """Each folder of jaxtrain/ that holds Python modules ("" for jaxtrain/ itself) -> its module file names."""
    packages: dict[str, list[str]] = {}
    for f in tracked_paths():
        if f.parts[0] == "jaxtrain" and f.suffix == ".py":
            packages.setdefault("/".join(f.parts[1:-1]), []).append(f.name)
    return packages


def readme_table_rows() -> list[str]:
    """The first column of README's package table (the table whose header is `| package |`)."""
    lines = README.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| package |"))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append(line.split("|")[1].strip().strip("`"))
    return rows


def layout_sections() -> dict[str, str]:
    """docs/layout.md's `## ` sections by the folder their heading names (`jaxtrain/sharding/` -> "sharding",
    `jaxtrain/` -> ""); other sections under their own heading."""
    sections: dict[str, str] = {}
    for part in re.split(r"^## ", LAYOUT.read_text(), flags=re.M)[1:]:
        heading, _, body = part.partition("\n")
        match = re.match(r"`?jaxtrain/([\w/]*?)/?`?(?::|$| )", heading)
        sections[match.group(1) if match else heading.strip()] = body
    return sections


def named(name: str, text: str) -> bool:
    """`name` appears in `text` in backticks, alone or as the last part of a path, or matched by a backticked
    pattern (`xla_cpu_*.py`)."""
    quoted = re.findall(r"`([^`\n]+)`", text)
    return any(q == name or q.endswith("/" + name) or fnmatch.fnmatch(name, q) for q in quoted)


def test_readme_package_table_names_every_package_and_folder():
    rows = readme_table_rows()
    missing = [f"jaxtrain/{p}/" for p in library_packages() if p and f"jaxtrain/{p}/" not in rows]
    missing += [f"{folder}/" for folder in top_folders() if f"{folder}/" not in rows]
    assert not missing, f"README.md's package table lacks rows for {missing}"
    gone = [r for r in rows if r.endswith("/") and not (ROOT / r).is_dir()]
    assert not gone, f"README.md's package table names folders that do not exist: {gone}"


def test_layout_names_every_module():
    sections = layout_sections()
    missing = []
    for package, modules in sorted(library_packages().items()):
        if package not in sections:
            missing.append(f"a section for jaxtrain/{package}/")
            continue
        wanted = [m for m in modules if m != "__init__.py" or not package]  # jaxtrain/__init__.py is the API
        missing += [f"jaxtrain/{package}/{m}".replace("//", "/") for m in wanted if not named(m, sections[package])]
    assert not missing, f"docs/layout.md lacks {missing}"
    stale = [p for p in sections if re.fullmatch(r"[\w/]+", p) and p not in library_packages()]
    assert not stale, f"docs/layout.md has sections for packages that do not exist: {stale}"


def test_layout_names_every_command_and_script():
    from jaxtrain.cli import COMMANDS

    text = LAYOUT.read_text()
    missing = [f"jaxtrain {c}" for c in COMMANDS if not named(c, text)]
    for folder in SCRIPT_FOLDERS:
        entries = {f.parts[1] for f in tracked_paths() if f.parts[0] == folder and len(f.parts) > 1}
        for entry in sorted(entries):
            is_dir = (ROOT / folder / entry).is_dir()
            if is_dir and not named(f"{entry}/", text) or not is_dir and not named(entry, text):
                missing.append(f"{folder}/{entry}")
    assert not missing, f"docs/layout.md lacks {missing}"


def notebook_imports(path: Path) -> list[str]:
    """Every module a notebook's code cells import (`import a.b`, `from a.b import c` -> "a.b")."""
    found = []
    for cell in json.loads(path.read_text())["cells"]:
        if cell["cell_type"] != "code":
            continue
        for node in ast.walk(ast.parse("".join(cell["source"]))):
            if isinstance(node, ast.Import):
                found += [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                found.append(node.module or "")
    return found


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebooks_use_the_public_api_only(path):
    private = [m for m in notebook_imports(path) if m.startswith("jaxtrain.") or m.startswith("models")]
    assert not private, f"{path.name} imports {private}: use `import jaxtrain` and the names in jaxtrain/__init__.py"
    used = set(re.findall(r"\bjaxtrain\.(\w+)", "".join(c for c in _code(path))))
    unknown = sorted(n for n in used if n not in jaxtrain.__all__)
    assert not unknown, f"{path.name} uses jaxtrain.{unknown}, which jaxtrain/__init__.py does not export"


def _code(path: Path) -> list[str]:
    return ["".join(c["source"]) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]


def test_no_doc_names_a_path_of_one_machine():
    found = []
    for doc in [README, *sorted((ROOT / "docs").rglob("*.md")), *NOTEBOOKS]:
        text = doc.read_text()
        if doc.suffix == ".ipynb":  # what the cells say; outputs record the temporary directories of the run
            text = "\n".join("".join(c["source"]) for c in json.loads(text)["cells"])
        for number, line in enumerate(text.splitlines(), 1):
            found += [f"{doc.relative_to(ROOT)}:{number}: {m}" for m in MACHINE_PATH.findall(line)]
    assert not found, "docs name paths of one machine (write them relative to the checkout):\n" + "\n".join(found)
