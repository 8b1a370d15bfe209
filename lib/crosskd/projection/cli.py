"""``crosskd projection build|validate|inspect``: X-Token's projection ``W`` on the command line.

``crosskd projection build --student-to-teacher S2T --teacher-to-student T2S --output W
[--top-k 4] [--chain-cut 4]`` builds ``W`` from a table pair (``crosskd tables build``) and
writes it as safetensors; ``crosskd projection validate --student-tokenizer ...
--teacher-tokenizer ... W`` checks it against the two tokenizers and exits 1 on a violation;
``crosskd projection inspect W`` summarises it (rows by kind, entries per row, the teacher ids
that gather the most student tokens, with ``--student-tokenizer`` / ``--teacher-tokenizer`` a
few rows spelt out). ``--json`` prints the report or summary as JSON.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

import numpy as np

log = logging.getLogger("crosskd")

SHOW_ROWS = 8
"""Rows spelt out by ``inspect`` with tokenizers, and fan-in columns listed."""


def add_projection_commands(commands: argparse._SubParsersAction) -> None:
    """Add ``crosskd projection build|validate|inspect`` to the ``crosskd`` parser's
    subcommands."""
    from crosskd.cli import tokenizer_args

    actions = commands.add_parser(
        "projection", help="X-Token's projection matrix student -> teacher"
    ).add_subparsers(dest="action", required=True)
    build = actions.add_parser("build", help="build W from a sub-token table pair")
    build.add_argument("--student-to-teacher", required=True, help="S->T table path or URI")
    build.add_argument("--teacher-to-student", required=True, help="T->S table path or URI")
    build.add_argument("--output", required=True, help="output .safetensors path or URI")
    build.add_argument("--top-k", type=int, default=4, help="entries kept per row (4)")
    build.add_argument(
        "--chain-cut", type=int, default=4, help="chain pieces that get a weight (4)"
    )
    validate = actions.add_parser(
        "validate", help="validate W against both tokenizers; exit 1 on violation"
    )
    tokenizer_args(validate, "student", "teacher")
    validate.add_argument("projection", metavar="URI", help="the projection")
    validate.add_argument("--json", action="store_true", help="print the report as JSON")
    inspect = actions.add_parser("inspect", help="summarise W")
    inspect.add_argument("projection", metavar="URI", help="the projection")
    inspect.add_argument("--student-tokenizer", help="spell out a few rows with these")
    inspect.add_argument("--teacher-tokenizer", help="(both tokenizers are needed)")
    inspect.add_argument("--json", action="store_true", help="print the summary as JSON")


def run_projection_command(args: argparse.Namespace) -> int:
    """Run a ``crosskd projection`` action; returns the exit status."""
    from crosskd.cli import load_side
    from crosskd.projection import (
        build_projection,
        load_projection,
        save_projection,
        validate_projection,
    )
    from crosskd.tables import load_table_pair

    if args.action == "build":
        pair = load_table_pair(args.student_to_teacher, args.teacher_to_student)
        projection = build_projection(pair, top_k=args.top_k, chain_cut=args.chain_cut)
        projection = save_projection(projection, args.output)
        log.info("wrote %s", args.output)
        _write(_format(summary(projection)))
        return 0
    projection = load_projection(args.projection)
    if args.action == "validate":
        report = validate_projection(
            projection, load_side(args, "student"), load_side(args, "teacher")
        )
        if args.json:
            _write(json.dumps(vars(report) | {"ok": report.ok}, indent=2))
        else:
            status = "ok" if report.ok else f"{len(report.violations)} violation(s)"
            _write(
                "\n".join(
                    [f"projection {report.source}: {status}"]
                    + [f"  - {v}" for v in report.violations]
                )
            )
        return 0 if report.ok else 1
    tokenizers = None
    if args.student_tokenizer or args.teacher_tokenizer:
        from crosskd.errors import CrosskdError
        from crosskd.tokenization import load_tokenizer

        if not (args.student_tokenizer and args.teacher_tokenizer):
            raise CrosskdError(
                "projection inspect spells rows out with both tokenizers; give "
                "--student-tokenizer and --teacher-tokenizer, or neither."
            )
        tokenizers = (
            load_tokenizer(args.student_tokenizer),
            load_tokenizer(args.teacher_tokenizer),
        )
    info = summary(projection, tokenizers)
    _write(json.dumps(info, indent=2) if args.json else _format(info))
    return 0


def summary(projection: Any, tokenizers: tuple[Any, Any] | None = None) -> dict[str, Any]:
    """What ``inspect`` prints: both sides, the build's settings, rows by kind, entries per
    row, the mean weight of a spread row's first entry, the teacher ids with the most student
    tokens (with tokenizers: their bytes, and the first spread rows spelt out)."""
    from crosskd.projection import summarize

    meta = projection.meta
    counts, entries = summarize(projection)
    spread = np.flatnonzero(projection.lengths > 1)
    first = projection.weights[projection.offsets[spread]]
    offsets, _, _ = projection.by_teacher
    fan_in = np.diff(offsets)
    widest = np.argsort(-fan_in, kind="stable")[:SHOW_ROWS]
    info: dict[str, Any] = {
        "source": projection.source,
        "student": f"{meta.student_name} (V {meta.student_vocab_size})",
        "teacher": f"{meta.teacher_name} (V {meta.teacher_vocab_size})",
        "top_k": meta.top_k,
        "chain_cut": meta.chain_cut,
        "rows": counts,
        "entries_per_row": entries,
        "spread_rows_first_weight": round(float(first.mean()), 4) if len(first) else None,
        "widest_columns": {str(int(t)): int(fan_in[t]) for t in widest},
    }
    if tokenizers is not None:
        student, teacher = tokenizers

        def spell(tok: Any, i: int) -> str:
            return repr(tok.bytes.token_bytes(int(i)).decode("utf-8", "backslashreplace"))

        info["widest_columns"] = {
            spell(teacher, t): n
            for t, n in zip(widest.tolist(), fan_in[widest].tolist(), strict=True)
        }
        info["spread_rows"] = {
            spell(student, s): {
                spell(teacher, t): round(float(w), 4)
                for t, w in zip(*projection.row(s), strict=True)
            }
            for s in spread[:SHOW_ROWS].tolist()
        }
    return info


def _format(info: dict[str, Any]) -> str:
    lines = [f"projection {info['source']}"]
    for key in ("student", "teacher", "top_k", "chain_cut"):
        lines.append(f"  {key}: {info[key]}")
    lines.append("  rows: " + ", ".join(f"{k} {v}" for k, v in info["rows"].items()))
    lines.append(
        "  entries per row: " + ", ".join(f"{k}: {v}" for k, v in info["entries_per_row"].items())
    )
    lines.append(f"  mean first weight of a spread row: {info['spread_rows_first_weight']}")
    lines.append(
        "  teacher ids gathering the most student tokens: "
        + ", ".join(f"{k} ({v})" for k, v in info["widest_columns"].items())
    )
    for student, row in info.get("spread_rows", {}).items():
        lines.append(f"  {student} -> " + ", ".join(f"{t} {w}" for t, w in row.items()))
    return "\n".join(lines)


def _write(text: str) -> None:
    sys.stdout.write(text + "\n")
