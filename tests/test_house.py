"""The package's shape, read from its source: small modules and functions, private names kept to
their module, and engines that read the stage table instead of comparing stage numbers."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = sorted((ROOT / "zerojax").rglob("*.py"))
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60


def _rel(path: pathlib.Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name


def _tree(path: pathlib.Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def test_no_module_over_400_lines():
    long = {_rel(p): n for p in PACKAGE if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, long


def test_no_function_over_60_lines():
    long = {
        f"{_rel(p)}:{node.name}": node.end_lineno - node.lineno + 1
        for p in PACKAGE
        for node in ast.walk(_tree(p))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    }
    assert not long, long


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _private_uses(path: pathlib.Path) -> list[str]:
    """`from zerojax.x import _name` and `module._name` on a zerojax module this file imported."""
    tree, found, modules = _tree(path), [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and ((node.module or "").startswith("zerojax") or node.level):
            for alias in node.names:
                if _private(alias.name):
                    found.append(f"{_rel(path)}:{node.lineno} imports {alias.name}")
                modules.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            modules |= {(a.asname or a.name).split(".")[0] for a in node.names if a.name.startswith("zerojax")}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            base = node.value
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(base, ast.Name) and base.id in modules:
                found.append(f"{_rel(path)}:{node.lineno} reads {ast.unparse(node)}")
    return found


def test_no_private_name_is_used_outside_its_module():
    files = PACKAGE + sorted((ROOT / "tests").rglob("*.py")) + sorted((ROOT / "experiments").rglob("*.py"))
    uses = [use for path in files for use in _private_uses(path)]
    assert not uses, uses


@pytest.mark.parametrize("path", sorted((ROOT / "zerojax" / "engines").glob("*.py")), ids=_rel)
def test_engines_read_the_stage_table_instead_of_comparing_stage_numbers(path):
    compare = re.compile(r"\bstage(\.index)?\s*(==|!=|<=|>=|<|>)|(==|!=|<=|>=|<|>)\s*stage(\.index)?\b")
    lines = [f"{i}: {line.strip()}" for i, line in enumerate(path.read_text().splitlines(), 1) if compare.search(line)]
    assert not lines, lines


def test_the_private_use_check_finds_a_private_import_and_a_private_attribute(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("from zerojax.wrap import _key\nimport zerojax.engines as e\n\ne._REGISTRY\n")
    assert len(_private_uses(sample)) == 2
