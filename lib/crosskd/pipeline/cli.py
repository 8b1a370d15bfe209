"""``crosskd pipeline compile|graph|run-local|submit``.

* ``graph [--package FILE] [--output FILE]``: the compiled pipeline's graph as SVG (default
  ``docs/pipeline.svg``).
* ``compile [--output FILE] [--image IMAGE] [--params FILE] [--teacher-serving cache|server]``:
  the pipeline of ``pipelines/distill.py`` as KFP YAML (default ``pipelines/distill.yaml`` of the
  checkout; with ``--teacher-serving server``, the teacher-server pipeline ``distill_served``,
  default ``distill-served.yaml`` here); ``--params`` makes a parameter set (YAML mapping) the
  compiled defaults.
* ``run-local (--preset NAME | --config FILE) [--FIELD VALUE ...] [key=value ...]
  [--local-root DIR] [--no-cache] [--job-kind pytorchjob|trainjob]``: the whole DAG on this
  machine under ``kfp.local``, the training step through the local executor (as a PyTorchJob,
  or a TrainJob: the pipeline's ``job_kind``); prints the held-out bits-per-byte table
  and the report path. The options of :class:`crosskd.steps.config.RunConfig`'s fields are
  ``crosskd distill``'s (:func:`crosskd.config.add_config_options`).
* ``submit --host URL [--namespace NS] [--experiment NAME] [--run-name NAME] [--package FILE]
  [--no-cache] [--wait [--timeout S]] [param=value ...]``: a run of the compiled package on a
  Kubeflow Pipelines server with the kfp client. The token comes from ``$KFP_TOKEN`` or the
  service-account token file ``$KF_PIPELINES_SA_TOKEN_PATH`` (never from the command line).
  Prints the run's URL; with ``--wait`` exits 1 when the run does not succeed.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import yaml

from crosskd.config import CommandParser, config_flags
from crosskd.errors import ConfigError
from crosskd.k8s import JOB_KINDS
from crosskd.pipeline.graph import pipeline_svg
from crosskd.pipeline.progress import steps_to_log
from crosskd.pipeline.submit import run_failed, submit_pipeline


def add_pipeline_commands(commands: argparse._SubParsersAction) -> None:
    """Add ``crosskd pipeline compile|run-local|submit`` to the ``crosskd`` parser."""
    pipeline = commands.add_parser("pipeline", help="the Kubeflow pipeline (compile, run, submit)")
    actions = pipeline.add_subparsers(dest="action", required=True, parser_class=CommandParser)
    comp = actions.add_parser("compile", help="compile pipelines/distill.py to KFP YAML")
    comp.add_argument("--output", help="default: pipelines/distill.yaml of the checkout")
    comp.add_argument("--image", help="the components' image (default: components/__init__.py)")
    comp.add_argument("--params", help="YAML mapping of pipeline parameters: compiled defaults")
    comp.add_argument(
        "--teacher-serving",
        choices=("cache", "server"),
        default="cache",
        help="cache: teachers scored into caches (default); server: a teacher server per "
        "teacher for training (default output: distill-served.yaml)",
    )
    graph = actions.add_parser("graph", help="draw the compiled pipeline's graph as SVG")
    graph.add_argument("--package", help="compiled YAML (default: pipelines/distill.yaml)")
    graph.add_argument("--output", help="default: docs/pipeline.svg of the checkout")
    local = actions.add_parser(
        "run-local",
        help="run the whole pipeline here under kfp.local",
        config="crosskd.steps.config:RunConfig",
    )
    local.add_argument(
        "--preset", help="a shipped run preset: tiny, demo, scratch, chat-demo, transfer"
    )
    local.add_argument(
        "--local-root",
        help="kfp.local's own files (default: <output>/kfp-local for a local output)",
    )
    local.add_argument("--no-cache", action="store_true", help="run every step again")
    local.add_argument(
        "--job-kind",
        choices=JOB_KINDS,
        default=JOB_KINDS[0],
        help="the training runs as this job, through the local executor: pytorchjob (the "
        "Training Operator's) or trainjob (Kubeflow Trainer v2's, on its crosskd-torch runtime)",
    )
    local.add_argument(
        "--log",
        help="the steps' whole output goes here; the terminal gets a "
        "line per step (default: <local root>/logs/<time>.log); - : all of it "
        "on the terminal",
    )
    sub = actions.add_parser("submit", help="submit the compiled pipeline to a KFP server")
    sub.add_argument("--host", required=True, help="the KFP API URL (http[s]://...)")
    sub.add_argument("--namespace", help="the Kubeflow profile namespace (multi-user KFP)")
    sub.add_argument("--experiment", default="crosskd", help="default: %(default)s")
    sub.add_argument("--run-name", help="the run's display name")
    sub.add_argument("--package", help="compiled YAML (default: pipelines/distill.yaml)")
    sub.add_argument("--wait", action="store_true", help="wait; exit 1 unless it succeeds")
    sub.add_argument(
        "--no-cache",
        action="store_true",
        help="run every step again (KFP's cache off for this run)",
    )
    sub.add_argument("--timeout", type=float, metavar="SECONDS", help="with --wait: give up")
    sub.add_argument(
        "arguments",
        nargs="*",
        metavar="param=value",
        help="pipeline parameters, e.g. steps=2000 'teachers=[s3://b/qwen3]'",
    )


def run_pipeline_command(args: argparse.Namespace) -> int:
    """Run a ``crosskd pipeline`` subcommand parsed by :func:`add_pipeline_commands`."""
    if args.action == "compile":
        return _compile(args)
    if args.action == "graph":
        return _graph(args)
    if args.action == "run-local":
        return _run_local(args)
    return _submit(args)


def _graph(args: argparse.Namespace) -> int:
    # lazy: pipeline.run and steps import torch (through the configs); `crosskd` builds this
    # parser for every command
    from crosskd.pipeline.run import COMPILED_FILE, source_root

    package = args.package or str(source_root() / COMPILED_FILE)
    output = args.output or str(source_root() / "docs" / "pipeline.svg")
    Path(output).write_text(pipeline_svg(package), encoding="utf-8")
    sys.stdout.write(f"wrote {output}\n")
    return 0


def _compile(args: argparse.Namespace) -> int:
    # lazy: pipeline.run and steps import torch (through the configs); `crosskd` builds this
    # parser for every command
    from crosskd.pipeline.run import COMPILED_FILE, compile_pipeline, source_root

    parameters = None
    if args.params:
        parameters = yaml.safe_load(Path(args.params).read_text(encoding="utf-8")) or {}
        if not isinstance(parameters, dict):
            raise ConfigError(
                f"--params {args.params}: expected a mapping of pipeline parameters to values."
            )
    if args.output:
        output = args.output
    elif args.teacher_serving == "cache":
        output = str(source_root() / COMPILED_FILE)
    else:
        output = "distill-served.yaml"
    compile_pipeline(
        output, image=args.image, parameters=parameters, teacher_serving=args.teacher_serving
    )
    sys.stdout.write(f"compiled {output}\n")
    return 0


def _run_local(args: argparse.Namespace) -> int:
    # lazy: pipeline.run and steps import torch (through the configs); `crosskd` builds this
    # parser for every command
    from crosskd.pipeline.run import local_root_of, preset_arguments, run_local
    from crosskd.steps.config import RunConfig, load_run_config
    from crosskd.steps.evaluate import bits_per_byte_table

    if not args.preset and not args.config:
        raise ConfigError("run-local needs --preset NAME or --config FILE (and output=DIR).")
    given = config_flags(args, RunConfig)
    config = load_run_config(args.config, args.preset, args.overrides, flags=given)
    arguments = {**preset_arguments(config), "job_kind": args.job_kind}
    local_root = args.local_root or local_root_of(arguments["output_root"])
    if args.log == "-":
        result = run_local(arguments, local_root=local_root, cache=not args.no_cache)
    else:
        log = Path(args.log or f"{local_root}/logs/{time.strftime('%Y%m%d-%H%M%S')}.log")
        sys.stdout.write(f"log: {log}\n")
        with steps_to_log(log):
            result = run_local(arguments, local_root=local_root, cache=not args.no_cache)
    lines = [
        f"report: {result['report']}",
        *bits_per_byte_table(result["bits_per_byte"], result.get("ood_bits_per_byte")),
    ]
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


def _submit(args: argparse.Namespace) -> int:
    # lazy: pipeline.run and steps import torch (through the configs); `crosskd` builds this
    # parser for every command
    from crosskd.pipeline.run import COMPILED_FILE, source_root

    arguments = {}
    for item in args.arguments:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"argument {item!r}: write it as param=value.")
        arguments[key] = value
    package = args.package or str(source_root() / COMPILED_FILE)
    run = submit_pipeline(
        package,
        host=args.host,
        arguments=arguments,
        namespace=args.namespace,
        experiment=args.experiment,
        run_name=args.run_name,
        wait=args.wait,
        timeout_s=args.timeout,
        enable_caching=False if args.no_cache else None,
    )
    state = f" {run.state}" if run.state else ""
    sys.stdout.write(f"run {run.run_id}{state}: {run.url}\n")
    if run_failed(run):
        sys.stderr.write(
            f"crosskd: error: run {run.run_id} ended {run.state}"
            f"{f': {run.error}' if run.error else ''}\n"
        )
        return 1
    return 0
