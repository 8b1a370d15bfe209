"""The local pipeline against ``crosskd distill`` on the same preset: the same steps, once as
the KFP DAG under ``kfp.local`` (each step its own process, training through the local
PyTorchJob executor, kd and ce trained at once) and once in one process. Prints both wall times
and their ratio, and checks the two runs give the same held-out bits per byte.

    python benchmarks/pipeline.py [--preset tiny|demo|scratch] [key=value ...]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CROSSKD = [sys.executable, "-m", "crosskd.cli"]


def run(command: list[str]) -> tuple[float, dict[str, float]]:
    """Wall seconds of ``command`` and the bits-per-byte table it printed."""
    start = time.perf_counter()
    done = subprocess.run(
        command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    wall = time.perf_counter() - start
    if done.returncode:
        sys.exit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    table = dict(re.findall(r"^  (\w+)\s+([0-9.]+)$", done.stdout, re.M))
    return wall, {name: float(value) for name, value in table.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny", choices=["tiny", "demo", "scratch"])
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="crosskd-bench-") as tmp:
        common = ["--preset", args.preset, *args.overrides]
        base, base_bpb = run([*CROSSKD, "distill", *common, f"output={Path(tmp) / 'distill'}"])
        pipe, pipe_bpb = run(
            [*CROSSKD, "pipeline", "run-local", *common, f"output={Path(tmp) / 'pipeline'}"]
        )
    print(
        f"preset {args.preset}: crosskd distill {base:.1f} s, crosskd pipeline run-local "
        f"{pipe:.1f} s, ratio {pipe / base:.2f}"
    )
    same = base_bpb == pipe_bpb
    print(f"held-out bits per byte {'identical' if same else 'DIFFER'}: {pipe_bpb}")
    if not same:
        sys.exit(f"distill gave {base_bpb}")


if __name__ == "__main__":
    main()
