"""Choosing weight matrices by logical dims or by name, and standing in for them where the model reads them.

Two features change how a model multiplies some of its weights without the model changing: low-rank adapters
(`lora.targets`, `jaxtrain.posttrain.adapters`) and low-precision matmuls (`precision.targets`,
`jaxtrain.placement.precision`). Both choose weights the same way (`chosen`: groups by logical dims, weight names,
whole paths) and both put an object where the chosen weight's array stands, which computes the projection itself
when the model calls `jaxtrain.ops.projection.project` with it (`StandIn`); any other reading of it is refused,
since it would compute without the feature.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from jaxtrain.errors import UserInputError
from jaxtrain.placement.model import path_str
from jaxtrain.sharding.rules import is_logical_names

PyTree = Any
Path = tuple  # a parameter's place in the params: its dict keys, ("blocks", "w_q")

# Groups by logical dims: what a decoder's attention and MLP weights are named, whatever the model calls them.
GROUPS: dict[str, Callable[[tuple], bool]] = {
    "attention": lambda names: "embed" in names and bool({"heads", "kv_heads"} & set(names)),
    "mlp": lambda names: "embed" in names and "mlp" in names,
}


class StandIn:
    """What stands where a weight's array stands in the model: only `project` may read it (`projected`). A model that
    reads the weight another way (an einsum of its own, a gather, arithmetic) would compute without the feature, so
    each such reading raises `refusal` naming the weight and the option (`option`) that chose it."""

    name: str
    option: str = ""  # the setting that chose the weight, e.g. "lora.targets"
    refusal: type[UserInputError] = UserInputError

    def _refuse(self, *_: Any, **__: Any) -> Any:
        raise self.refusal(read_otherwise(self.name, self.option))

    def __getitem__(self, index: Any) -> Any:
        if index is Ellipsis:  # nnx's `param[...]`: the value itself
            return self
        return self._refuse()

    __jax_array__ = __array__ = astype = reshape = _refuse
    __matmul__ = __rmatmul__ = __mul__ = __rmul__ = __add__ = __radd__ = _refuse
    # A model asking for the shape is about to compute with the array itself (e.g. a grouped matmul's own kernel).
    T = shape = ndim = property(_refuse)


def read_otherwise(name: str, option: str) -> str:
    return (
        f"{option}: weight '{name}' is read without jaxtrain.ops.projection.project, so what {option} asks for "
        "would be left out of what the model computes; choose only weights the model multiplies through project "
        f"(drop it from {option}, or change the model to call project)."
    )


def chosen(logical_names: PyTree, targets: str, option: str, error: type[UserInputError]) -> list[Path]:
    """The paths of the weights `targets` (the value of setting `option`) names, in the params' order: groups by
    logical dims (`GROUPS`), weight names (the last part of a path) and whole paths, among the weight matrices (two
    or more dims besides `layers`). A group may match nothing (a model without attention), a name must match a
    weight; either miss raises `error`, listing what can be chosen."""
    matrices = [(path, names) for path, names in flat(logical_names) if len(matrix_dims(names)) >= 2]
    picked_paths: dict[Path, None] = {}
    for entry in filter(None, (part.strip() for part in targets.split(","))):
        if entry in GROUPS:
            picked = [path for path, names in matrices if GROUPS[entry](names)]
        else:
            picked = [path for path, _ in matrices if entry in (name_of(path), str(path[-1]))]
            if not picked:
                raise error(_no_target(entry, targets, option, matrices))
        picked_paths.update(dict.fromkeys(picked))
    if not picked_paths:
        raise error(_no_target("", targets, option, matrices))
    return [path for path, _ in matrices if path in picked_paths]


def matrix_dims(names: tuple) -> list:
    return [n for n in names if n != "layers"]


def _no_target(entry: str, targets: str, option: str, matrices: list[tuple[Path, tuple]]) -> str:
    groups = [name for name, member in GROUPS.items() if any(member(names) for _, names in matrices)]
    weights = ", ".join(f"{path[-1]} ({name_of(path)})" for path, _ in matrices)
    what = f"'{entry}' names no weight matrix of this model" if entry else "names no weight matrix of this model"
    return (
        f"{option}='{targets}': {what}. Choose among the groups {', '.join(groups) or '(none here)'} and the "
        f"weights {weights or '(none)'}, comma-separated."
    )


def flat(tree: PyTree) -> list[tuple[Path, Any]]:
    """(path as dict keys, leaf) of params or of logical names (whose leaves are tuples)."""
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_logical_names)[0]
    return [(tuple(getattr(k, "key", getattr(k, "idx", k)) for k in path), leaf) for path, leaf in leaves]


def name_of(path: Path) -> str:
    return path_str(path)


def get_at(tree: PyTree, path: Path) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def set_at(tree: dict, path: Path, value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def replace_at(tree: PyTree, paths: Any, replace: Callable[[Path, Any], Any]) -> PyTree:
    """A copy of nested dicts `tree` with the subtree at each of `paths` replaced by `replace(path, subtree)`; the
    rest is shared, not copied."""
    out = tree
    for path in paths:
        out = _replaced(out, path, replace(path, get_at(tree, path)))
    return out


def _replaced(tree: Any, path: Path, value: Any) -> Any:
    if not path:
        return value
    copy = dict(tree)
    copy[path[0]] = _replaced(tree[path[0]], path[1:], value)
    return copy
