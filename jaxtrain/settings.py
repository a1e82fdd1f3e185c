"""The declared checks of config fields: what each accepts, checked when a config is made.

A config dataclass derives from `Settings` and declares what each field accepts with `setting` (choices, bounds, a
one-line help); every instance checks its fields against their types and those declarations when it is made, so a
value is refused where it enters, with the key, the value and what was expected:

>>> @dataclasses.dataclass(frozen=True)
... class Example(Settings):
...     section: ClassVar[str] = "example"
...     steps: int = setting(10, "optimizer steps", at_least=1)
>>> Example(steps=0)
Traceback (most recent call last):
jaxtrain.errors.ConfigError: example.steps=0: expected an integer >= 1 (optimizer steps).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
import typing
from collections.abc import Callable
from typing import Any, ClassVar

from jaxtrain.errors import ConfigError

# The compute dtypes a model may name (params stay float32).
COMPUTE_DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class Accepts:
    """What one config field accepts beyond its type: one of `choices`, or a number within the bounds (`at_least`
    and `at_most` inclusive, `above` and `below` exclusive). Floats must always be finite."""

    help: str = ""
    choices: tuple[str, ...] = ()
    at_least: float | None = None
    above: float | None = None
    at_most: float | None = None
    below: float | None = None

    def expected(self, kind: type) -> str:
        """What a valid value is, in words: "an integer >= 1", "a finite number >= 0 and < 1", "one of a, b"."""
        if self.choices:
            return f"one of {', '.join(self.choices)}"
        noun = {int: "an integer", float: "a finite number", bool: "true or false", str: "a string"}[kind]
        return " ".join([noun, " and ".join(f"{symbol} {bound:g}" for symbol, _, bound in self._bounds())]).strip()

    def summary(self, kind: type) -> str:
        """What a valid value is, tersely, for a listing: "int >= 1", "float >= 0, < 1", "str: one of a, b"."""
        if self.choices:
            return f"{kind.__name__}: one of {', '.join(self.choices)}"
        return " ".join(
            [kind.__name__, ", ".join(f"{symbol} {bound:g}" for symbol, _, bound in self._bounds())]
        ).strip()

    def accepts(self, value: Any, kind: type) -> bool:
        if kind is bool or isinstance(value, bool):  # a bool is an int to Python, never a size to us
            return kind is bool and isinstance(value, bool)
        if kind is str:
            return isinstance(value, str) and (not self.choices or value in self.choices)
        if not isinstance(value, int if kind is int else (int, float)) or not math.isfinite(value):
            return False
        return all(within(value, bound) for _, within, bound in self._bounds())

    def _bounds(self) -> list[tuple[str, Callable[[Any, Any], bool], float]]:
        bounds = [(">=", operator.ge, self.at_least), (">", operator.gt, self.above)]
        bounds += [("<=", operator.le, self.at_most), ("<", operator.lt, self.below)]
        return [(symbol, within, bound) for symbol, within, bound in bounds if bound is not None]


def setting(default: Any, help: str = "", **accepts: Any) -> Any:
    """A dataclass field with a default and what it accepts (see `Accepts`), for `Settings` classes."""
    if "choices" in accepts:
        accepts["choices"] = tuple(accepts["choices"])
    return dataclasses.field(default=default, metadata={"accepts": Accepts(help, **accepts)})


def accepts_of(field: dataclasses.Field) -> Accepts:
    """The declared `Accepts` of a field (a field declared without `setting` accepts any value of its type)."""
    return field.metadata.get("accepts", Accepts())


def problem(key: str, shown: str, accepts: Accepts, kind: type) -> str:
    """What is wrong with one value, shown as `shown`: "key=shown: expected ... (help)", or for a choice "key=shown
    is not one of ... (help)"."""
    wrong = (
        f" is not one of {', '.join(accepts.choices)}" if accepts.choices else f": expected {accepts.expected(kind)}"
    )
    return f"{key}={shown}{wrong}" + (f" ({accepts.help})" if accepts.help else "")


def describe_field(cls: type, field: dataclasses.Field) -> str:
    """A line on field `field` of dataclass `cls`: its type, what it accepts, its help ("int >= 1 · transformer
    blocks"); a field of another type than int, float, bool or str shows its annotation."""
    accepts = accepts_of(field)
    kind = scalar_types(cls).get(field.name)
    what = accepts.summary(kind) if kind else str(_type_hints(cls).get(field.name, type(field.default).__name__))
    return f"{what} · {accepts.help}" if accepts.help else what


def _type_hints(cls: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(cls)
    except (NameError, TypeError):  # annotations that do not resolve here
        return {}


@functools.cache
def scalar_types(cls: type) -> dict[str, type]:
    """The fields of dataclass `cls` whose declared type is int, float, bool or str, with that type."""
    fields = dataclasses.fields(cls)
    # Annotations that do not resolve here: go by the defaults' types.
    hints = _type_hints(cls) or {f.name: type(f.default) for f in fields if f.default is not dataclasses.MISSING}
    return {f.name: hints[f.name] for f in fields if hints.get(f.name) in (int, float, bool, str)}


class Settings:
    """The base of config dataclasses: each instance checks every int, float, bool and str field against its type
    and its `setting` declaration when it is made (also by `dataclasses.replace`), and raises a `ConfigError` that
    names every offending `section.field` and value. A subclass with checks across fields overrides
    `__post_init__` and calls `super().__post_init__()` first."""

    section: ClassVar[str] = ""

    def __post_init__(self) -> None:
        problems = []
        for name, kind in scalar_types(type(self)).items():
            value, accepts = getattr(self, name), accepts_of(self.__dataclass_fields__[name])
            if not accepts.accepts(value, kind):
                problems.append(problem(self.key(name), repr(value), accepts, kind))
        if problems:
            raise ConfigError("; ".join(problems) + ".")

    @classmethod
    def key(cls, name: str) -> str:
        """The dotted config key of field `name`, as overrides spell it."""
        return f"{cls.section}.{name}" if cls.section else name

    def refuse_when_off(self, switch: str, off: bool, what: str, fix: str) -> None:
        """A section that a field switches on (lora.rank, preference.loss, grpo.group_size): where it is `off`, any
        other field set away from its default is a `ConfigError` naming them, since nothing would read it."""
        changed = [
            f"{self.key(f.name)}={getattr(self, f.name)!r}"
            for f in dataclasses.fields(self)
            if f.name != switch and getattr(self, f.name) != f.default
        ]
        if off and changed:
            raise ConfigError(
                f"{', '.join(changed)} set with {self.key(switch)}={getattr(self, switch)}, which {what}: {fix}, or "
                "drop those keys."
            )
