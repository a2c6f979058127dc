"""Imports run one way (docs/design.md): api → admission → core ← engines; core → wire.

Each package may import only what its layer allows, read from the source, so a new import
that breaks the direction fails here, not in a reader's head."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "firsttoken"

# What each layer must not import (prefixes of module names), and the exceptions it may.
FORBIDDEN: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    # The corridor knows engines only by their interface, and nothing above it.
    "core": (("firsttoken.api", "firsttoken.admission", "firsttoken.engines"),
             ("firsttoken.engines.base",)),
    # Engines implement the interface; of the core they use the one timer schedule, of the
    # wire the SSE decoder (a relay reads an upstream's stream).
    "engines": (("firsttoken.api", "firsttoken.admission", "firsttoken.core", "firsttoken.wire"),
                ("firsttoken.core.schedule", "firsttoken.wire.sse")),
    # Bytes and formats only: the event writer, the reader side of core's log, is in core.
    "wire": (("firsttoken.api", "firsttoken.admission", "firsttoken.core"), ()),
    "admission": (("firsttoken.api", "firsttoken.engines"), ()),
    "resume": (("firsttoken.api", "firsttoken.admission", "firsttoken.engines"), ()),
}  # fmt: skip


def imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_imports_run_one_way(layer: str) -> None:
    forbidden, allowed = FORBIDDEN[layer]
    wrong = []
    for path in sorted((PACKAGE / layer).glob("*.py")):
        for module in imports(path):
            own = module == f"firsttoken.{layer}" or module.startswith(f"firsttoken.{layer}.")
            if own or module.startswith(allowed):
                continue
            if module.startswith(forbidden):
                wrong.append(f"{path.relative_to(PACKAGE.parent)} imports {module}")
    assert not wrong, "\n".join(wrong)
