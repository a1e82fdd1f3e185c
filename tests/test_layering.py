"""Dependencies point one way, read from the source's import statements (those inside functions included):

    base (errors, settings, files, formatting, registry, devices)
      < analysis, sharding, data  < parallel  < run_config, placement, posttrain.adapters  < training
      < planner, asynchronous, posttrain, inference, interop, evaluation  < cli and the public API

No module imports one of a higher layer, no two modules import each other through any chain, the library never
imports `jaxtrain_models` (models/), `scripts`, `benchmarks` or `tests`, models import only the sharding helpers, the
kernels of `jaxtrain.ops` and the config field checks, and the planner never imports the training loop or what only
the loop uses.
"""

import ast
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYERS = {
    "jaxtrain.errors": 0,
    "jaxtrain.settings": 0,
    "jaxtrain.files": 0,
    "jaxtrain.formatting": 0,
    "jaxtrain.registry": 0,
    "jaxtrain.devices": 0,
    "jaxtrain.analysis": 1,
    "jaxtrain.aot": 1,
    "jaxtrain.sharding": 1,
    "jaxtrain.data": 1,
    "jaxtrain.parallel": 2,
    "jaxtrain.ops": 2,
    "jaxtrain.run_config": 3,
    "jaxtrain.placement": 3,  # a model on a mesh: spec, rules, split model, shardings; every product places through it
    "jaxtrain.posttrain.adapters": 3,  # LoRA: a placed model's weights with adapters, which the step composition takes
    "jaxtrain.posttrain.quantized": 3,  # QLoRA: the adapters' quantized base weights (qwix), which adapters stores
    "jaxtrain.posttrain.preference": 3,  # preference losses on pairs, which the step composition takes
    "jaxtrain.posttrain.grpo": 3,  # the GRPO loss on a batch of rollouts, which the step composition takes
    "jaxtrain.posttrain": 5,  # post-training built on training and inference (SFT, DPO, GRPO as they land)
    "jaxtrain.training": 4,
    "jaxtrain.planner": 5,
    "jaxtrain.inference": 5,
    "jaxtrain.interop": 5,  # Hugging Face import/export: checkpoints, plans, the run config
    "jaxtrain.evaluation": 5,  # lm-eval's tasks on a trained model and inside the loop, built on inference
    "jaxtrain.asynchronous": 5,  # the Ray parameter-server engine: the run built per worker, checkpoints, metrics
    "jaxtrain.cli": 6,
    "jaxtrain": 6,  # the public API, jaxtrain/__init__.py
}
MODEL_IMPORTS = {
    "jaxtrain.sharding.constraints",
    "jaxtrain.settings",
    "jaxtrain.errors",
    "jaxtrain.ops.attention",
    "jaxtrain.ops.cross_entropy",
    "jaxtrain.ops.embedding",
    "jaxtrain.ops.expert_dispatch",
    "jaxtrain.ops.plain",
    "jaxtrain.ops.projection",
    "jaxtrain.ops.sequence",
}
LOOP_ONLY = {  # what the planner must not reach: the loop and the runtime around it
    "jaxtrain.training.loop",
    "jaxtrain.training.recovery",
    "jaxtrain.training.checkpoint",
    "jaxtrain.training.metrics",
    "jaxtrain.training.run_lock",
    "jaxtrain.training.profiling",
    "jaxtrain.training.tracking",
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


LIBRARY = {module_name(p): p for p in (ROOT / "jaxtrain").rglob("*.py")}


def imports(path: Path) -> set[str]:
    """The modules `path` imports; `from package import module` counts as importing the module."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            submodules = {f"{node.module}.{alias.name}" for alias in node.names} & LIBRARY.keys()
            names.update(submodules or {node.module})
    return names


def ours(path: Path) -> set[str]:
    # `models`: the folder's name, never an import name (it installs as jaxtrain_models); importing it is an error.
    top = ("jaxtrain", "jaxtrain_models", "models", "scripts", "benchmarks", "tests")
    return {n for n in imports(path) if n.split(".")[0] in top}


def layer(module: str) -> int:
    for prefix in sorted(LAYERS, key=len, reverse=True):
        if module == prefix or module.startswith(prefix + "."):
            return LAYERS[prefix]
    raise AssertionError(f"{module} is in no layer: add it to LAYERS in {Path(__file__).name}")


@pytest.mark.parametrize("module", sorted(LIBRARY))
def test_no_upward_import(module):
    for imported in ours(LIBRARY[module]):
        assert imported.split(".")[0] == "jaxtrain", f"{module} imports {imported}"
        assert layer(imported) <= layer(module), f"{module} (layer {layer(module)}) imports {imported} (higher)"


def test_no_import_cycles():
    graph = {m: {i for i in ours(p) if i in LIBRARY} for m, p in LIBRARY.items()}
    done, on_path = set(), []

    def visit(module):
        if module in on_path:
            cycle = on_path[on_path.index(module) :] + [module]
            raise AssertionError("import cycle: " + " -> ".join(cycle))
        if module in done:
            return
        on_path.append(module)
        for imported in sorted(graph[module]):
            visit(imported)
        on_path.pop()
        done.add(module)

    for module in sorted(graph):
        visit(module)


def test_planner_never_reaches_the_loop():
    reached, todo = set(), [m for m in LIBRARY if m.startswith("jaxtrain.planner")]
    while todo:
        module = todo.pop()
        for imported in ours(LIBRARY[module]) & LIBRARY.keys():
            if imported not in reached:
                reached.add(imported)
                todo.append(imported)
    assert not reached & LOOP_ONLY, f"the planner reaches {sorted(reached & LOOP_ONLY)}"


def test_models_know_nothing_of_meshes():
    for path in (ROOT / "models").glob("*.py"):
        allowed = MODEL_IMPORTS | ({"jaxtrain.registry"} if path.name == "__init__.py" else set())
        library = {n for n in ours(path) if n.split(".")[0] != "jaxtrain_models"}  # its siblings
        assert library <= allowed, f"{path.name} imports {library - allowed}"
        assert "Mesh" not in path.read_text(), f"{path.name} mentions a mesh"
        private = [n.names for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ImportFrom)]
        assert not [a.name for names in private for a in names if a.name.startswith("_")], f"{path.name}"


def test_every_package_ships():
    packages = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    in_tree = {module_name(p.parent / "__init__.py") for p in ROOT.glob("jaxtrain/**/__init__.py")}
    assert in_tree | {"jaxtrain_models", "jaxtrain.meshes"} == packages
