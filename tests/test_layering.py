"""Dependencies point one way: models import only the sharding helper; the library never imports scripts."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_models_know_nothing_of_meshes():
    for path in (ROOT / "models").glob("*.py"):
        ours = {n for n in imports(path) if n.split(".")[0] in ("jaxtrain", "scripts")}
        assert ours <= {"jaxtrain.constraints", "jaxtrain.errors"}, f"{path.name} imports {ours}"
        assert "Mesh" not in path.read_text(), f"{path.name} mentions a mesh"


def test_library_never_imports_scripts():
    for path in (ROOT / "jaxtrain").glob("*.py"):
        assert not {n for n in imports(path) if n.startswith("scripts")}, path.name
