"""The library's shape: short functions (the median under 15 lines), and a reason written above any over 60.

A function's length runs from its `def` line to its last line (decorators aside), nested functions included and
counted on their own as well. The reason is a comment block directly above the `def` (or above its decorators)
whose first line starts with `# Long:` and says why.
"""

from __future__ import annotations

import ast
import dataclasses
import statistics
from pathlib import Path

import pytest

LIBRARY = Path(__file__).resolve().parent.parent / "jaxtrain"
LONG = 60  # lines; a longer function needs a "# Long:" comment
MEDIAN_UNDER = 15  # lines
REASON_MARK = "# Long:"


@dataclasses.dataclass(frozen=True)
class Function:
    where: str  # file:qualified.name
    lines: int
    reason: str | None  # the text after "# Long:" above it, if any


def functions(source: str, filename: str) -> list[Function]:
    """Every function defined in `source`, methods and nested functions included, in source order."""
    source_lines = source.splitlines()
    found = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = prefix
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                lines = child.end_lineno - child.lineno + 1
                found.append(Function(f"{filename}:{name}", lines, reason_above(source_lines, child)))
                name += "."
            elif isinstance(child, ast.ClassDef):
                name = f"{prefix}{child.name}."
            visit(child, name)

    visit(ast.parse(source, filename), "")
    return found


def reason_above(source_lines: list[str], node: ast.FunctionDef | ast.AsyncFunctionDef) -> str | None:
    """The reason given in the comment block directly above `node` (and its decorators), or None."""
    above = min([node.lineno, *(d.lineno for d in node.decorator_list)]) - 2  # 0-based index of the line above
    block = []
    while above >= 0 and source_lines[above].lstrip().startswith("#"):
        block.insert(0, source_lines[above].strip())
        above -= 1
    if not block or not block[0].startswith(REASON_MARK):
        return None
    words = " ".join([block[0][len(REASON_MARK) :], *(line.lstrip("#") for line in block[1:])]).split()
    return " ".join(words) or None


def long_without_reason(found: list[Function]) -> list[str]:
    return [
        f"{f.where} is {f.lines} lines (over {LONG}) with no '{REASON_MARK} <why>' comment directly above its def"
        for f in found
        if f.lines > LONG and f.reason is None
    ]


@pytest.fixture(scope="module")
def library() -> list[Function]:
    files = sorted(LIBRARY.rglob("*.py"))
    assert files, f"no Python files under {LIBRARY}"
    root = LIBRARY.parent
    return [f for path in files for f in functions(path.read_text(), str(path.relative_to(root)))]


def test_functions_over_60_lines_say_why(library):
    offenders = long_without_reason(library)
    assert not offenders, "split these functions, or say why they are long:\n" + "\n".join(offenders)


def test_median_function_is_short(library):
    median = statistics.median(f.lines for f in library)
    longest = ", ".join(f"{f.where} ({f.lines})" for f in sorted(library, key=lambda f: -f.lines)[:5])
    assert median < MEDIAN_UNDER, (
        f"median function length {median} lines over {len(library)} functions; longest: {longest}"
    )


EXAMPLE = """
def short():
    return 1


def outer():
    def inner():
{inner_body}
    return inner


# Long: one table, read top to bottom,
# is clearer than pieces.
@decorator
def explained():
{body}


# Long:
def no_reason_given():
{body}


# Not a reason.
def other_comment():
{body}


# Long: a blank line breaks the link.

def detached_comment():
{body}


class Holder:
    # Long: methods may explain themselves too.
    def method(self):
{method_body}
"""


def test_the_check_reads_nested_functions_decorators_and_comments():
    body = "\n".join(["    x = 1"] * LONG)
    indented = body.replace("    ", "        ")
    source = EXAMPLE.format(body=body, inner_body=indented, method_body=indented)
    found = {f.where.split(":")[1]: f for f in functions(source, "example.py")}
    assert found["short"].lines == 2 and found["outer.inner"].lines == LONG + 1
    assert found["explained"].reason == "one table, read top to bottom, is clearer than pieces."
    assert found["Holder.method"].reason == "methods may explain themselves too."
    offenders = long_without_reason(list(found.values()))
    flagged = sorted(line.split(" is ")[0].removeprefix("example.py:") for line in offenders)
    # outer is long too: its nested function's lines are its own as well.
    assert flagged == ["detached_comment", "no_reason_given", "other_comment", "outer", "outer.inner"]
    assert f"example.py:outer.inner is {LONG + 1} lines" in "\n".join(offenders)
