"""Running a document's commands as written: its fenced blocks, each block's commands
(continuation lines joined, comments dropped), and a command run in a shell with this
environment's ``crosskd`` first on the PATH (``tests/test_docs_kubernetes.py``,
``tests/test_docs_readme.py``)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def blocks(text: str, lang: str) -> list[tuple[str, str]]:
    """(the paragraph before, the block) for each ``lang`` block of ``text``."""
    out = []
    for match in BLOCK.finditer(text):
        if match.group(1) == lang:
            before = text[: match.start()].rstrip().rsplit("\n\n", 1)[-1]
            out.append((before, match.group(2)))
    return out


def commands(block: str) -> list[str]:
    """The block's commands: continuation lines joined, comments dropped."""
    joined = block.replace("\\\n", " ")
    return [line.split("  #")[0].strip() for line in joined.splitlines() if line.strip()]


def run(command: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """``command`` in bash in ``cwd``; asserts it exits 0 (its output's tails in the message)."""
    done = subprocess.run(
        ["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, (command, done.stdout[-2000:], done.stderr[-3000:])
    return done


def env(**extra: str) -> dict[str, str]:
    """This process's environment, one thread, ``extra`` set, this Python's scripts first on
    the PATH."""
    out = dict(os.environ, OMP_NUM_THREADS="1", **extra)
    out["PATH"] = str(Path(sys.executable).parent) + os.pathsep + out.get("PATH", "")
    return out
