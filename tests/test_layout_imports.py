"""The layers import one way: protocol <- zo, policies <- daemon, firmware <- lab."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Which packages each package may import (besides itself). zo's single-process trainer
# asks a policy for q, so zo may import policies; policies never import zo.
ALLOWED: dict[str, set[str]] = {
    "protocol": set(),
    "policies": {"protocol"},
    "zo": {"protocol", "policies"},
    "daemon": {"protocol", "zo", "policies"},
    "firmware": {"protocol", "zo", "policies"},
    "lab": {"protocol", "zo", "policies", "daemon", "firmware"},
}
# The `qsched` command (daemon/cli.py) reaches the lab's commands by module name, so
# even the entry point has no import edge against the order.


def _imported_packages(path: Path) -> set[str]:
    """The qsched packages a module imports, at any depth (lazy imports count)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "qsched" and len(parts) > 1 and parts[1] in ALLOWED:
                found.add(parts[1])
    return found


def _edges() -> list[tuple[Path, str, str]]:
    edges = []
    for package in ALLOWED:
        for path in sorted((ROOT / package).rglob("*.py")):
            relative = path.relative_to(ROOT)
            for target in _imported_packages(path) - {package}:
                edges.append((relative, package, target))
    return edges


def test_layout_imports_point_one_way() -> None:
    """No module imports a package of a later layer (or a sibling it may not)."""
    wrong = [
        f"{path}: {package} imports {target}"
        for path, package, target in _edges()
        if target not in ALLOWED[package]
    ]
    assert wrong == []


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("import qsched.lab.demo\n", {"lab"}),
        ("from qsched.daemon import engine\n", {"daemon"}),
        ("def f():\n    from qsched.firmware.virtual.board import BoardAgent\n", {"firmware"}),
        ("from qsched import lab\n", {"lab"}),
        ("from . import sibling\nimport numpy\n", set()),
    ],
)
def test_layout_imports_scanner_sees_every_form(
    source: str, expected: set[str], tmp_path: Path
) -> None:
    """The scanner finds top-level, lazy and from-package imports, and ignores others."""
    module = tmp_path / "module.py"
    module.write_text(source, encoding="utf-8")
    assert _imported_packages(module) == expected
