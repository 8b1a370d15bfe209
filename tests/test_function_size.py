"""The Kubernetes layer stays readable: no function in ``lib/crosskd/k8s`` is longer than 80
lines, its ``def`` line to its last line, docstring included (issue 28: ``submit`` was 201)."""

from __future__ import annotations

import ast
from pathlib import Path

K8S = Path(__file__).resolve().parents[1] / "lib" / "crosskd" / "k8s"
LIMIT = 80


def long_functions(folder: Path, limit: int) -> list[str]:
    """``path:line name (N lines)`` of every function or method in ``folder``'s modules longer
    than ``limit`` lines."""
    found = []
    for path in sorted(folder.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = node.end_lineno - node.lineno + 1
                if length > limit:
                    found.append(f"{path.name}:{node.lineno} {node.name} ({length} lines)")
    return found


def test_no_function_in_k8s_is_longer_than_80_lines():
    assert long_functions(K8S, LIMIT) == []


def test_the_check_finds_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(LIMIT))
    (tmp_path / "m.py").write_text(f"def short():\n    pass\n\n\ndef long():\n{body}\n")
    assert long_functions(tmp_path, LIMIT) == [f"m.py:5 long ({LIMIT + 1} lines)"]
