"""The package's parts import one way. Each part is a subpackage (the base is the top-level modules);
every import of a zerojax module, inside functions too, must name a part its importer may use, and no
two modules may import each other, however far round.

    cli -> interop, accounting, train, data, models -> engines -> adapt -> core -> base
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "zerojax"

# What each part may import (itself and the base always). Read with docs/architecture.md.
MAY_IMPORT = {
    "core": set(),
    "adapt": {"core"},
    "engines": {"core", "adapt"},
    "data": {"core"},
    "models": {"core"},
    "train": {"core", "adapt", "engines", "data"},
    "accounting": {"core", "adapt", "models"},
    "interop": {"core", "train", "data", "models"},
    "cli": {"core", "adapt", "engines", "data", "models", "train", "accounting", "interop"},
}


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def part(module: str) -> str:
    """The part a zerojax module belongs to: its subpackage, or "base"."""
    pieces = module.split(".")
    return pieces[1] if len(pieces) > 2 or (len(pieces) == 2 and pieces[1] in MAY_IMPORT) else "base"


def imports(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, zerojax module) of every import in the file, at any depth."""
    found = []
    package = module_name(path).rsplit(".", 1)[0] if path.name != "__init__.py" else module_name(path)
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("zerojax")]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            if not base.startswith("zerojax"):
                continue
            for alias in node.names:  # `from zerojax.core import mesh` imports zerojax.core.mesh
                sub = f"{base}.{alias.name}"
                found.append(
                    (node.lineno, sub if (PACKAGE.parent / (sub.replace(".", "/") + ".py")).exists() else base)
                )
    return found


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _allowed(importer: str, target: str) -> bool:
    mine, theirs = part(importer), part(target)
    if mine == "base":  # errors, log and folders stand alone: they may name only the errors
        return target == "zerojax.errors"
    return target != "zerojax" and (theirs in ("base", mine) or theirs in MAY_IMPORT[mine])


def _violations(modules: dict[str, pathlib.Path]) -> list[str]:
    return [
        f"{path.relative_to(ROOT)}:{line} ({part(name)}) imports {target} ({part(target)})"
        for name, path in modules.items()
        if name != "zerojax"  # the public names, loaded lazily by their dotted paths
        for line, target in imports(path)
        if not _allowed(name, target)
    ]


def test_every_import_runs_one_way():
    assert not _violations(MODULES)


def test_no_two_modules_import_each_other():
    graph = {name: {t for _, t in imports(path) if t in MODULES and t != name} for name, path in MODULES.items()}
    cycles, state = [], {}

    def visit(node, trail):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(trail[trail.index(nxt) :] + [nxt]))
            elif nxt not in state:
                visit(nxt, trail + [nxt])
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not cycles


@pytest.mark.parametrize(
    "source, expected",
    [
        (
            "from zerojax.train.trainer import Trainer\n",
            "zerojax/core/x.py:1 (core) imports zerojax.train.trainer (train)",
        ),
        (
            "def f():\n    from zerojax.cli import config\n",
            "zerojax/core/x.py:2 (core) imports zerojax.cli.config (cli)",
        ),
    ],
)
def test_the_check_finds_an_import_against_the_order_even_inside_a_function(tmp_path, source, expected, monkeypatch):
    fake = ROOT / "zerojax" / "core" / "x.py"
    monkeypatch.setattr(pathlib.Path, "read_text", lambda self, encoding=None: source)
    assert _violations({"zerojax.core.x": fake}) == [expected]
