"""The ``crosskd`` command line.

``crosskd tables build|validate|inspect``, ``crosskd projection build|validate|inspect``
(X-Token's projection matrix), ``crosskd prepare`` (and ``prepare-merge``),
``crosskd inspect pair``, ``crosskd score``, ``crosskd serve`` (the teacher answering online
over HTTP), ``crosskd train``, ``crosskd evaluate``,
``crosskd distill``,
``crosskd generate`` (a conversation set sampled from an instruct model), ``crosskd transplant``
(a pretrained model moved onto another tokenizer), ``crosskd dashboards``
(the Grafana dashboards as JSON). The options of the commands that build a config are its
fields (:func:`crosskd.config.add_config_options`: ``--max-length N`` for ``max_length``), over
the ``--config`` file and under ``key=value`` overrides. Bad input (a config, data or artifact
error, a training run stopped by a non-finite loss) exits with status 2 and one line on stderr
that says what is wrong and what to do; a table that fails validation exits 1.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from crosskd.config import (
    CommandParser,
    config_flags,
    config_from_args,
    flag_overrides,
    load_config,
)
from crosskd.errors import CrosskdError, Stopped

if TYPE_CHECKING:
    from crosskd.projection import Projection
    from crosskd.tables import SubTokenTable
    from crosskd.tokenization import LoadedTokenizer

log = logging.getLogger("crosskd")

SHOW_ROWS = 8
"""Rows spelt out by ``crosskd projection inspect`` with tokenizers, and fan-in columns listed."""


def _tokenizer_args(parser: argparse.ArgumentParser, *sides: str) -> None:
    for side in sides:
        parser.add_argument(
            f"--{side}-tokenizer",
            required=True,
            help="folder, tokenizer.json, zoo:NAME, fsspec URI, or a Hugging Face id in the "
            "local cache",
        )
        parser.add_argument(
            f"--{side}-vocab-size",
            type=int,
            default=None,
            help="rows of the model's output layer (default: config.json next to the "
            "tokenizer, else the largest token id + 1)",
        )


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``crosskd``."""
    parser = argparse.ArgumentParser(prog="crosskd", description=__doc__.split("\n")[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=CommandParser)

    tables = commands.add_parser("tables", help="sub-token tables").add_subparsers(
        dest="action", required=True
    )
    build = tables.add_parser("build", help="build one direction source -> destination")
    _tokenizer_args(build, "source", "destination")
    build.add_argument("--output", required=True, help="output .safetensors path or URI")

    validate = tables.add_parser("validate", help="validate a table pair; exit 1 on violation")
    _tokenizer_args(validate, "student", "teacher")
    validate.add_argument("--student-to-teacher", required=True, help="table path or URI")
    validate.add_argument("--teacher-to-student", required=True, help="table path or URI")
    validate.add_argument("--json", action="store_true", help="print the reports as JSON")

    inspect = tables.add_parser("inspect", help="summarise a table (or a pair: common tokens)")
    inspect.add_argument("tables", nargs="+", metavar="URI", help="one table, or S->T and T->S")
    inspect.add_argument("--json", action="store_true", help="print the summary as JSON")

    inspect_cmd = commands.add_parser("inspect", help="reports").add_subparsers(
        dest="action", required=True
    )
    pair = inspect_cmd.add_parser(
        "pair", help="how well a student and a teacher tokenizer can be compared (CSD)"
    )
    _tokenizer_args(pair, "student", "teacher")
    pair.add_argument(
        "--data",
        help="JSONL/Parquet/datasets rows (default: the built-in ~1 MB benchmark corpus of this "
        "machine's Python sources and translations)",
    )
    pair.add_argument("--text-column", default="text")
    pair.add_argument("--messages-column", default="messages")
    pair.add_argument("--limit", type=int, default=None, help="use at most this many rows")
    pair.add_argument("--json", action="store_true", help="print the report as JSON")

    commands.add_parser(
        "prepare",
        help="clip, align and lockstep-pack data into Parquet shards + manifest",
        config="crosskd.data.prepare:PrepareConfig",
    )
    merge = commands.add_parser(
        "prepare-merge", help="write the manifest of prepared data from its splits' shards"
    )
    merge.add_argument("output", help="the prepare output folder or URI")

    commands.add_parser(
        "score",
        help="write the teacher's top-K signal of prepared data to a cache (local/S3)",
        config="crosskd.teacher.scoring:ScoreConfig",
    )

    commands.add_parser(
        "serve",
        help="answer the teacher's top-K signal online over HTTP (dynamic batching, bearer "
        "token from CROSSKD_SERVE_TOKEN, /healthz, /readyz, /metrics; SIGTERM drains)",
        config="crosskd.serve.config:ServeConfig",
    )

    tr = commands.add_parser(
        "train",
        help="train the student (one process, or every process under torchrun); a "
        "restarted run resumes from its last checkpoint",
        config="crosskd.train.config:TrainConfig",
    )
    tr.add_argument(
        "--nproc-per-node",
        type=int,
        default=None,
        metavar="N",
        help="run N worker processes under torch's elastic agent (a training pod's "
        "entry point; exit codes in docs/kubernetes.md); default: train in this "
        "process",
    )

    commands.add_parser(
        "evaluate",
        help="held-out bits per byte of models and teachers on prepared data",
        config="crosskd.evaluate:EvaluateConfig",
    )

    dist = commands.add_parser(
        "distill",
        help="the whole run: tables, prepare, score, train, evaluate, report",
        config="crosskd.steps.config:RunConfig",
    )
    dist.add_argument(
        "--preset",
        help="a shipped preset to start from: tiny, demo, scratch, chat-demo, transfer, "
        "on-policy-demo",
    )

    commands.add_parser(
        "generate",
        help="a conversation set: an instruct model's sampled answers to prompts "
        "(JSONL; a rerun resumes)",
        config="crosskd.generate:GenerateConfig",
    )

    commands.add_parser(
        "transplant",
        help="move a pretrained model onto another tokenizer (its new embeddings made from the "
        "old ones through the sub-token tables), the student of tokenizer transfer",
        config="crosskd.transplant:TransplantConfig",
    )

    dashboards = commands.add_parser(
        "dashboards", help="write the Grafana dashboards (training, teacher scoring) as JSON"
    )
    dashboards.add_argument(
        "--output",
        required=True,
        metavar="DIR",
        help="folder for the crosskd-*.json files (created if missing)",
    )

    from crosskd.k8s.cli import add_job_commands
    from crosskd.pipeline.cli import add_pipeline_commands

    _add_projection_commands(commands)
    add_job_commands(commands)
    add_pipeline_commands(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``crosskd``; returns the exit status."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not args.verbose:  # transformers' per-load progress bars (read when it is imported)
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        return _run(args)
    except (CrosskdError, Stopped) as exc:
        sys.stderr.write(f"crosskd: {'error: ' if isinstance(exc, CrosskdError) else ''}{exc}\n")
        return exc.exit_code


def _run(args: argparse.Namespace) -> int:
    if args.command == "job":
        from crosskd.k8s.cli import run_job_command

        return run_job_command(args)
    if args.command == "pipeline":
        from crosskd.pipeline.cli import run_pipeline_command

        return run_pipeline_command(args)
    if args.command == "projection":
        return _projection(args)
    if args.command == "prepare":
        return _prepare(args)
    if args.command == "prepare-merge":
        from crosskd.data.merge import merge_prepared

        return _prepared_summary(merge_prepared(args.output), args.output)
    if args.command == "inspect":
        return _inspect_pair(args)
    if args.command == "score":
        return _score(args)
    if args.command == "serve":
        return _serve(args)
    if args.command == "distill":
        return _distill(args)
    if args.command == "train":
        return _train(args)
    if args.command == "evaluate":
        return _evaluate(args)
    if args.command == "dashboards":
        return _dashboards(args)
    if args.command == "generate":
        return _generate(args)
    if args.command == "transplant":
        return _transplant(args)
    from crosskd import tables

    if args.action == "build":
        src, dst = _load(args, "source"), _load(args, "destination")
        table = tables.build_table(src, dst)
        table = tables.save_table(table, args.output)
        log.info("wrote %s", args.output)
        _write(_summary(table))
        return 0
    if args.action == "validate":
        student, teacher = _load(args, "student"), _load(args, "teacher")
        reports = tables.validate_pair(
            student,
            teacher,
            tables.load_table(args.student_to_teacher),
            tables.load_table(args.teacher_to_student),
        )
        if args.json:
            _write(json.dumps([vars(r) | {"ok": r.ok} for r in reports], indent=2))
        else:
            for report in reports:
                status = "ok" if report.ok else f"{len(report.violations)} violation(s)"
                lines = [f"{report.direction} {report.source}: {status}"]
                lines += [f"  - {v}" for v in report.violations]
                _write("\n".join(lines))
        return 0 if all(r.ok for r in reports) else 1
    loaded = [tables.load_table(uri) for uri in args.tables]
    summary = {t.source: _summary_dict(t) for t in loaded}
    if len(loaded) == 2:
        pair = tables.TablePair(*loaded)
        summary["common_tokens"] = len(pair.common)
    elif len(loaded) > 2:
        raise CrosskdError("tables inspect takes one table or a pair (S->T then T->S).")
    _write(json.dumps(summary, indent=2) if args.json else _format(summary))
    return 0


def _add_projection_commands(commands: argparse._SubParsersAction) -> None:
    """``crosskd projection build|validate|inspect``: X-Token's projection matrix (module
    docstring of :mod:`crosskd.projection`)."""
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
    _tokenizer_args(validate, "student", "teacher")
    validate.add_argument("projection", metavar="URI", help="the projection")
    validate.add_argument("--json", action="store_true", help="print the report as JSON")
    inspect = actions.add_parser("inspect", help="summarise W")
    inspect.add_argument("projection", metavar="URI", help="the projection")
    inspect.add_argument("--student-tokenizer", help="spell out a few rows with these")
    inspect.add_argument("--teacher-tokenizer", help="(both tokenizers are needed)")
    inspect.add_argument("--json", action="store_true", help="print the summary as JSON")


def _projection(args: argparse.Namespace) -> int:
    """Run a ``crosskd projection`` action: ``build`` writes ``W`` from a table pair, ``validate``
    exits 1 on a violation, ``inspect`` summarises; returns the exit status."""
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
        _write(_projection_format(_projection_summary(projection)))
        return 0
    projection = load_projection(args.projection)
    if args.action == "validate":
        report = validate_projection(projection, _load(args, "student"), _load(args, "teacher"))
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
    info = _projection_summary(projection, tokenizers)
    _write(json.dumps(info, indent=2) if args.json else _projection_format(info))
    return 0


def _projection_summary(
    projection: Projection, tokenizers: tuple[LoadedTokenizer, LoadedTokenizer] | None = None
) -> dict[str, Any]:
    """What ``inspect`` prints: both sides, the build's settings, rows by kind, entries per
    row, the mean weight of a spread row's first entry, the teacher ids with the most student
    tokens (with tokenizers: their bytes, and the first spread rows spelt out)."""
    import numpy as np

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


def _projection_format(info: dict[str, Any]) -> str:
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


def _prepare(args: argparse.Namespace) -> int:
    from crosskd.data.prepare import PrepareConfig, prepare

    config = config_from_args(PrepareConfig, args)
    manifest = prepare(config)
    if manifest is None:
        _write(
            f"split {config.split_index} of {config.split_count} done at {config.output}; "
            f"the manifest is written when every split is done (or `crosskd prepare-merge "
            f"{config.output}`)"
        )
        return 0
    return _prepared_summary(manifest, config.output)


def _prepared_summary(manifest: dict, output: str) -> int:
    shapes = manifest["chunk_shapes"]
    lines = [
        f"prepared {manifest['rows']} rows ({manifest['clipped_rows']} clipped) into "
        f"{manifest['packing']['bins']} packed rows at {output}",
        *(
            f"  {m['name']}: {m['tokens']} tokens, packing efficiency "
            f"{manifest['packing']['efficiency'][m['name']]:.1%}"
            for m in manifest["models"]
        ),
        *(
            f"  chunks {name}: " + ", ".join(f"{k} {v}" for k, v in counts.items())
            for name, counts in shapes.items()
        ),
    ]
    _write("\n".join(lines))
    return 0


def _score(args: argparse.Namespace) -> int:
    from crosskd.teacher.scoring import ScoreConfig
    from crosskd.teacher.sharded import score

    config = config_from_args(ScoreConfig, args)
    manifest = score(config)
    bpb = manifest["bits_per_byte"]
    _write(
        f"scored {manifest['samples']} samples ({manifest['tokens']} tokens) into "
        f"{len(manifest['shards'])} shards at {config.output}: top-{manifest['k']} at tau "
        f"{manifest['tau']}, {manifest['encoding']}, {manifest['bytes_per_token']:.0f} "
        f"bytes/token; teacher bits per byte {'n/a' if bpb is None else f'{bpb:.3f}'}"
    )
    return 0


def _serve(args: argparse.Namespace) -> int:
    from crosskd.serve.config import ServeConfig
    from crosskd.serve.server import serve

    return serve(config_from_args(ServeConfig, args))


def _train(args: argparse.Namespace) -> int:
    from crosskd.train import TrainConfig, Trainer, finished_model

    given = config_flags(args, TrainConfig)
    config = load_config(TrainConfig, args.config, args.overrides, flags=given)
    done = finished_model(config)
    if done is not None:
        _write(f"{config.output} is complete (final/ holds step {done['step']}); nothing to do")
        return 0
    if args.nproc_per_node is not None:
        from crosskd.train.launch import launch

        if args.nproc_per_node < 1:
            raise CrosskdError(f"--nproc-per-node is {args.nproc_per_node}; it must be >= 1.")
        worker_args = [
            *(["--config", args.config] if args.config else []),
            *flag_overrides(given),  # the options as overrides, before the command line's own
            *args.overrides,
        ]
        return launch(config, worker_args, args.nproc_per_node)
    trainer = Trainer(config)
    try:
        trainer.setup()
        history = trainer.train()
        final = trainer.save()
    finally:
        trainer.close()
    if trainer.rank == 0:
        if not history:
            _write(f"{config.output}: every step was in its last checkpoint; wrote {final}")
            return 0
        last = history[-1]
        summary = ", ".join(f"{k} {last[k]:.4f}" for k in ("loss", "ce", "kd"))
        _write(f"trained steps {trainer.start + 1}..{config.steps} into {final}: {summary}")
    return 0


def _evaluate(args: argparse.Namespace) -> int:
    from crosskd.evaluate import EvaluateConfig, evaluate

    config = config_from_args(EvaluateConfig, args)
    result = evaluate(config)
    lines = [f"held-out bits per byte on {config.data}:"]
    for name, row in result["models"].items():
        value = "n/a" if row["bits_per_byte"] is None else f"{row['bits_per_byte']:.4f}"
        lines.append(f"  {name:14} {value}  ({row['prepared_model']} tokens)")
    if config.output:
        lines.append(f"wrote {config.output}")
    _write("\n".join(lines))
    return 0


def _distill(args: argparse.Namespace) -> int:
    from crosskd.distill import DistillConfig, distill, load_distill_config
    from crosskd.steps.evaluate import bits_per_byte_table

    given = config_flags(args, DistillConfig)
    config = load_distill_config(args.config, args.preset, args.overrides, flags=given)
    metrics = distill(config)
    lines = [
        f"report: {metrics['report']}",
        *bits_per_byte_table(metrics["bits_per_byte"], metrics.get("ood_bits_per_byte")),
    ]
    _write("\n".join(lines))
    return 0


def _generate(args: argparse.Namespace) -> int:
    from crosskd.generate import GenerateConfig, generate

    config = config_from_args(GenerateConfig, args)
    result = generate(config)
    _write(
        f"wrote {result['output']}: {result['conversations']} conversations "
        f"({result['generated']} new, {result['dropped']} empty answers dropped, "
        f"{result['unfinished']} cut at max_new_tokens)"
    )
    return 0


def _transplant(args: argparse.Namespace) -> int:
    from crosskd.transplant import TransplantConfig, transplant

    config = config_from_args(TransplantConfig, args)
    _write(transplant(config).line())
    return 0


def _dashboards(args: argparse.Namespace) -> int:
    from crosskd.metrics.dashboards import write_dashboards

    paths = write_dashboards(args.output)
    _write("\n".join(f"wrote {path}" for path in paths))
    return 0


def _inspect_pair(args: argparse.Namespace) -> int:
    import unicodedata
    from itertools import islice

    from crosskd.alignment.corpus import benchmark_corpus
    from crosskd.alignment.report import pair_report
    from crosskd.alignment.report_text import format_report
    from crosskd.data.records import read_records

    student, teacher = _load(args, "student"), _load(args, "teacher")
    if args.data is None:
        texts = benchmark_corpus()
    else:
        records = read_records(
            args.data,
            text_column=args.text_column,
            messages_column=args.messages_column,
            id_column=None,
        )
        texts = [
            r.text
            if r.text is not None
            else "\n".join(m.get("reasoning_content", "") + m["content"] for m in r.messages)
            for r in records
        ]
    texts = list(islice(texts, args.limit))
    if student.normalizes_nfc or teacher.normalizes_nfc:  # as `crosskd prepare` does
        texts = [unicodedata.normalize("NFC", text) for text in texts]
    report = pair_report(student, teacher, texts)
    _write(json.dumps(report.to_dict(), indent=2) if args.json else format_report(report))
    return 0


def _load(args: argparse.Namespace, side: str) -> LoadedTokenizer:
    from crosskd.tokenization import load_tokenizer

    return load_tokenizer(
        getattr(args, f"{side}_tokenizer"), vocab_size=getattr(args, f"{side}_vocab_size")
    )


def _summary_dict(table: SubTokenTable) -> dict:
    meta = table.meta
    return {
        "source": f"{meta.src_name} (len {meta.src_len}, V {meta.src_vocab_size})",
        "destination": f"{meta.dst_name} (len {meta.dst_len}, V {meta.dst_vocab_size})",
        "flags": table.flag_counts(),
        "chain_lengths": table.length_histogram(),
    }


def _summary(table: SubTokenTable) -> str:
    return _format({table.source: _summary_dict(table)})


def _format(summary: dict) -> str:
    lines = []
    for key, value in summary.items():
        if key == "common_tokens":
            lines.append(f"common tokens (one-to-one, normal): {value}")
            continue
        lines.append(f"table {key}")
        lines.append(f"  source:      {value['source']}")
        lines.append(f"  destination: {value['destination']}")
        flags = ", ".join(f"{k} {v}" for k, v in value["flags"].items())
        lines.append(f"  rows by flag: {flags}")
        hist = ", ".join(f"{k}: {v}" for k, v in value["chain_lengths"].items())
        lines.append(f"  chain lengths: {hist}")
    return "\n".join(lines)


def _write(text: str) -> None:
    sys.stdout.write(text + "\n")


if __name__ == "__main__":
    sys.exit(main())
