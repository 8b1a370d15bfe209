"""Grafana dashboards as code: "crosskd training" and "crosskd teacher scoring".

Both dashboards are built with ``grafana-foundation-sdk`` (the build that targets the Grafana
11.6 dashboard schema, ``schemaVersion`` 41) from the metric catalogue of issue 15 and written as
JSON by ``crosskd dashboards --output DIR``; ``manifests/monitoring/dashboards/`` holds the
generated files and a kustomization that wraps each in a ConfigMap for Grafana's sidecar.

Every query reads the data source of the ``datasource`` variable (type ``prometheus``) and
selects ``namespace="$namespace", job=~"$job"``: ``job`` is the scrape's job label (the
PyTorchJob's name on training pods). The GPU row joins dcgm-exporter's series to the job's pods
through kube-state-metrics' ``kube_pod_labels`` (see :func:`build_dashboards`).

:func:`panel_queries` lists every query of a dashboard (panel targets, annotations, template
variables) and :func:`render_query` substitutes the dashboard variables the way Grafana does, so
a test can run the queries against a real Prometheus.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

from grafana_foundation_sdk.builders import common as common_builders
from grafana_foundation_sdk.builders import dashboard as dash
from grafana_foundation_sdk.builders import prometheus, stat, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models.dashboard import (
    DashboardCursorSync,
    DashboardLinkType,
    DataSourceRef,
    VariableRefresh,
    VariableSort,
)

from crosskd.errors import CrosskdError

TRAINING_FILE = "crosskd-training.json"
SCORING_FILE = "crosskd-teacher-scoring.json"
DATASOURCE_VARIABLE = "${datasource}"
SELECTOR = 'namespace="$namespace", job=~"$job"'
"""The label matchers of every crosskd series a panel reads."""

QueryKind = Literal["panel", "annotation", "variable"]
_P = TypeVar("_P", timeseries.Panel, stat.Panel)


@dataclass(frozen=True)
class Query:
    """One query of a dashboard.

    ``kind`` says where it sits: ``"panel"`` (a panel target: ``title`` is the panel's title,
    ``ref_id`` the target's refId), ``"annotation"`` (``title`` is the annotation's name,
    ``ref_id`` is empty) or ``"variable"`` (a template variable's query, e.g.
    ``label_values(crosskd_train_step{namespace="$namespace"}, job)``: Grafana's function, not
    PromQL; ``title`` is the variable's name, ``ref_id`` is empty). ``expr`` is the query as the
    dashboard holds it, with variables unsubstituted (see :func:`render_query`).
    """

    kind: QueryKind
    title: str
    ref_id: str
    expr: str


def build_dashboards() -> dict[str, dict[str, Any]]:
    """The dashboards as JSON-ready dicts, keyed by file name (``crosskd-training.json``, ...).

    Units shown: losses in nats/token (cross-entropy; the total and KD terms as the loss
    computes them), learning rate and ``kd_scale`` unitless, tokens and samples per second,
    step, shard and checkpoint times in seconds, bits per byte, progress as a 0-1 ratio shown in
    percent, GPU utilisation in percent (``DCGM_FI_DEV_GPU_UTIL``), framebuffer in MiB
    (``DCGM_FI_DEV_FB_USED``) and power in watts (``DCGM_FI_DEV_POWER_USAGE``).

    The GPU row assumes dcgm-exporter's series carry the ``namespace`` and ``pod`` of the pod
    that holds the GPU (dcgm-exporter's Kubernetes mode, scraped with ``honorLabels: true``) and
    that kube-state-metrics exports the PyTorchJob's pod label
    (``--metric-labels-allowlist=pods=[training.kubeflow.org/job-name]``).
    """
    return {
        TRAINING_FILE: _to_json(_training()),
        SCORING_FILE: _to_json(_scoring()),
    }


def write_dashboards(folder: str | Path) -> list[Path]:
    """Write every dashboard of :func:`build_dashboards` into ``folder`` (created if missing).

    Each file is the dashboard's JSON, indented by two spaces with sorted keys and a final
    newline, so the output is byte-for-byte stable. Returns the paths written, in file-name
    order. Raises :class:`~crosskd.errors.CrosskdError` when ``folder`` is an existing file or
    cannot be created or written.
    """
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise CrosskdError(
            f"{folder} is an existing file, not a folder; give a folder to write the dashboards "
            "into (it is created if missing)."
        )
    written = []
    try:
        folder.mkdir(parents=True, exist_ok=True)
        for name, model in sorted(build_dashboards().items()):
            path = folder / name
            path.write_text(dashboard_text(model), encoding="utf-8")
            written.append(path)
    except OSError as exc:
        raise CrosskdError(f"cannot write the dashboards into {folder}: {exc}") from exc
    return written


def dashboard_text(model: Mapping[str, Any]) -> str:
    """The file text of a dashboard dict: JSON, 2-space indent, sorted keys, final newline."""
    return json.dumps(model, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def panel_queries(dashboard: Mapping[str, Any]) -> list[Query]:
    """Every query of a dashboard dict: panel targets (rows' nested panels included), then
    annotation queries, then template-variable queries; see :class:`Query`."""
    queries = [
        Query("panel", panel.get("title", ""), target.get("refId", ""), target["expr"])
        for panel in _panels(dashboard.get("panels", []))
        for target in panel.get("targets") or []
        if target.get("expr")
    ]
    for annotation in dashboard.get("annotations", {}).get("list", []):
        expr = annotation.get("expr") or (annotation.get("target") or {}).get("expr")
        if expr:
            queries.append(Query("annotation", annotation.get("name", ""), "", expr))
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") != "query":
            continue
        query = variable.get("query")
        expr = query.get("query", "") if isinstance(query, Mapping) else query
        if expr:
            queries.append(Query("variable", variable["name"], "", expr))
    return queries


_VARIABLE = re.compile(r"\$\{(\w+)(?::[^}]*)?\}|\[\[(\w+)\]\]|\$(\w+)")


def render_query(expr: str, variables: Mapping[str, str], rate_interval: str = "1m") -> str:
    """``expr`` with its dashboard variables substituted, as Grafana sends it to Prometheus.

    Replaces ``$name``, ``${name}``, ``${name:format}`` and ``[[name]]`` with
    ``variables[name]`` (give a multi-value variable as the regex Grafana would send, e.g.
    ``"(a|b)"``). The built-ins ``$__rate_interval``, ``$__interval`` and ``$__range`` are
    Prometheus durations and default to ``rate_interval``; ``variables`` may set them too (e.g.
    ``{"__range": "6h"}``). Raises :class:`ValueError` for a variable neither gives.
    """
    values = {
        "__rate_interval": rate_interval,
        "__interval": rate_interval,
        "__range": rate_interval,
        **variables,
    }

    def substitute(match: re.Match[str]) -> str:
        name = next(group for group in match.groups() if group)
        if name not in values:
            raise ValueError(f"{expr!r} uses the variable ${name}, which variables does not give")
        return values[name]

    return _VARIABLE.sub(substitute, expr)


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels") or [])


def _to_json(builder: dash.Dashboard) -> dict[str, Any]:
    return json.loads(json.dumps(builder.build(), cls=JSONEncoder))


# --- building blocks -------------------------------------------------------------------------


def _datasource() -> DataSourceRef:
    return DataSourceRef(type_val="prometheus", uid=DATASOURCE_VARIABLE)


def _m(name: str, selector: str = SELECTOR) -> str:
    """A series selector: ``name{namespace="$namespace", job=~"$job"}``."""
    return f"{name}{{{selector}}}"


def _target(ref_id: str, expr: str, legend: str, *, instant: bool = False) -> prometheus.Dataquery:
    query = (
        prometheus.Dataquery()
        .ref_id(ref_id)
        .expr(expr)
        .legend_format(legend)
        .datasource(_datasource())
    )
    return query.instant() if instant else query.range()


def _legend() -> common_builders.VizLegendOptions:
    return (
        common_builders.VizLegendOptions()
        .display_mode(common.LegendDisplayMode.LIST)
        .placement(common.LegendPlacement.BOTTOM)
        .show_legend(True)
    )


def _basics(
    panel: _P,
    panel_id: int,
    title: str,
    description: str,
    unit: str,
    targets: list[prometheus.Dataquery],
) -> _P:
    """What every panel sets: id, title, description, data source, unit and targets."""
    return (
        panel.id(panel_id)
        .title(title)
        .description(description)
        .datasource(_datasource())
        .unit(unit)
        .targets(targets)
    )


def _timeseries(
    panel_id: int,
    title: str,
    description: str,
    unit: str,
    targets: list[prometheus.Dataquery],
    *,
    width: int = 12,
    height: int = 8,
    ratio: bool = False,
    minimum: float | None = None,
) -> timeseries.Panel:
    panel = _basics(timeseries.Panel(), panel_id, title, description, unit, targets)
    panel = panel.span(width).height(height).legend(_legend())
    if ratio:  # a 0-1 fraction
        panel = panel.min(0).max(1)
    elif minimum is not None:
        panel = panel.min(minimum)
    return panel


def _stat(
    panel_id: int,
    title: str,
    description: str,
    unit: str,
    targets: list[prometheus.Dataquery],
    *,
    width: int = 6,
    height: int = 8,
    graph: bool = True,
) -> stat.Panel:
    return (
        _basics(stat.Panel(), panel_id, title, description, unit, targets)
        .span(width)
        .height(height)
        .graph_mode(common.BigValueGraphMode.AREA if graph else common.BigValueGraphMode.NONE)
        .color_mode(common.BigValueColorMode.VALUE)
        .reduce_options(common_builders.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
    )


def _variables(board: dash.Dashboard, metric: str) -> dash.Dashboard:
    """The ``datasource``, ``namespace`` and ``job`` variables; ``metric`` lists the values."""
    namespace = (
        dash.QueryVariable("namespace")
        .label("Namespace")
        .datasource(_datasource())
        .query(f"label_values({metric}, namespace)")
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(VariableSort.ALPHABETICAL_ASC)
    )
    job = (
        dash.QueryVariable("job")
        .label("Job")
        .description("the scrape's job label: the PyTorchJob's name on training pods")
        .datasource(_datasource())
        .query(f'label_values({metric}{{namespace="$namespace"}}, job)')
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(VariableSort.ALPHABETICAL_ASC)
        .multi(True)
        .include_all(True)  # "All" sends (a|b|...): the values seen, never .*
    )
    return (
        board.with_variable(
            dash.DatasourceVariable("datasource").label("Data source").type("prometheus")
        )
        .with_variable(namespace)
        .with_variable(job)
    )


def _board(uid: str, title: str, description: str) -> dash.Dashboard:
    return (
        dash.Dashboard(title)
        .uid(uid)
        .description(description)
        .tags(["crosskd"])
        .editable()
        .tooltip(DashboardCursorSync.CROSSHAIR)
        .time("now-6h", "now")
        .refresh("30s")
        .link(
            dash.DashboardLink("crosskd")
            .type(DashboardLinkType.DASHBOARDS)
            .tags(["crosskd"])
            .as_dropdown(True)
            .include_vars(True)
            .keep_time(True)
        )
    )


# --- the dashboards --------------------------------------------------------------------------


def _training() -> dash.Dashboard:
    ids = itertools.count(1)
    rate = "[$__rate_interval]"
    by_job = "max by (job)"
    board = _variables(
        _board(
            "crosskd-training",
            "crosskd training",
            "Student training (PyTorchJob): losses, optimizer, throughput, progress, "
            "checkpoints and the job's GPUs.",
        ),
        "crosskd_train_step",
    ).annotation(
        dash.AnnotationQuery()
        .name("Checkpoints")
        .datasource(_datasource())
        .enable(True)
        .icon_color("#5794F2")
        .expr(f"{by_job} (changes({_m('crosskd_train_last_checkpoint_step')}{rate})) > 0")
    )

    board = board.with_row(dash.Row("Losses").id(next(ids)))
    board = (
        board.with_panel(
            _timeseries(
                next(ids),
                "Loss",
                "Total loss of the last optimizer step "
                "(reduced over ranks: every rank reports it).",
                "none",
                [_target("A", f"{by_job} ({_m('crosskd_train_loss')})", "{{job}}")],
            )
        )
        .with_panel(
            _timeseries(
                next(ids),
                "Student cross-entropy",
                "Student cross-entropy of the last step, nats/token, per rank.",
                "none",
                [_target("A", _m("crosskd_train_ce_loss"), "{{job}} rank {{rank}}")],
            )
        )
        .with_panel(
            _timeseries(
                next(ids),
                "KD loss per teacher and rank",
                "Each teacher's CSD knowledge-distillation term of the last step, before kd_scale.",
                "none",
                [_target("A", _m("crosskd_train_kd_loss"), "{{job}} {{teacher}} rank {{rank}}")],
            )
        )
        .with_panel(
            _timeseries(
                next(ids),
                "kd_scale",
                "kd_scale of the last micro-batch, per rank (unitless).",
                "none",
                [_target("A", _m("crosskd_train_kd_scale"), "{{job}} rank {{rank}}")],
            )
        )
    )

    board = board.with_row(dash.Row("Optimizer").id(next(ids)))
    board = board.with_panel(
        _timeseries(
            next(ids),
            "Learning rate",
            "Learning rate of the last step.",
            "none",
            [_target("A", f"{by_job} ({_m('crosskd_train_learning_rate')})", "{{job}}")],
        )
    ).with_panel(
        _timeseries(
            next(ids),
            "Gradient norm",
            "L2 norm of the gradient before clipping, last step (largest over ranks).",
            "none",
            [_target("A", f"{by_job} ({_m('crosskd_train_grad_norm')})", "{{job}}")],
            minimum=0,
        )
    )

    step_buckets = f"sum by (job, le) (rate({_m('crosskd_train_step_seconds_bucket')}{rate}))"
    chunks = f"rate({_m('crosskd_train_chunks_total')}{rate})"
    board = board.with_row(dash.Row("Throughput").id(next(ids)))
    board = (
        board.with_panel(
            _timeseries(
                next(ids),
                "Tokens/s",
                "Student cross-entropy tokens trained on per second "
                "(rank 0 counts the run's total).",
                "none",
                [
                    _target(
                        "A",
                        f"sum by (job) (rate({_m('crosskd_train_tokens_total')}{rate}))",
                        "{{job}}",
                    )
                ],
                width=8,
                minimum=0,
            )
        )
        .with_panel(
            _timeseries(
                next(ids),
                "Step time p50 / p95",
                "Wall seconds per optimizer step, quantiles over the rate interval and all ranks.",
                "s",
                [
                    _target("A", f"histogram_quantile(0.5, {step_buckets})", "{{job}} p50"),
                    _target("B", f"histogram_quantile(0.95, {step_buckets})", "{{job}} p95"),
                ],
                width=8,
                minimum=0,
            )
        )
        .with_panel(
            _timeseries(
                next(ids),
                "KD chunk shapes per teacher",
                "Fraction of the KD chunks counted in the rate interval by shape, per teacher "
                "(each "
                "teacher's shapes add up to 100%).",
                "percentunit",
                [
                    _target(
                        "A",
                        f"sum by (job, teacher, shape) ({chunks}) / on (job, teacher) "
                        f"group_left () sum by (job, teacher) ({chunks})",
                        "{{job}} {{teacher}} {{shape}}",
                    )
                ],
                width=8,
                ratio=True,
            )
        )
    )

    checkpoint = "crosskd_train_checkpoint_seconds"
    board = board.with_row(dash.Row("Progress and checkpoints").id(next(ids)))
    board = (
        board.with_panel(
            _stat(
                next(ids),
                "Progress",
                "Optimizer steps done in the run over its planned steps.",
                "percentunit",
                [
                    _target(
                        "A",
                        f"{by_job} ({_m('crosskd_train_step')}) / {by_job} "
                        f"({_m('crosskd_train_planned_steps')})",
                        "{{job}}",
                    )
                ],
            )
        )
        .with_panel(
            _stat(
                next(ids),
                "Steps done",
                "Optimizer steps done in the run (survives resume).",
                "none",
                [_target("A", f"{by_job} ({_m('crosskd_train_step')})", "{{job}}")],
            )
        )
        .with_panel(
            _stat(
                next(ids),
                "Restarts in range",
                "How often a rank started training in the dashboard's time range "
                "(the largest count "
                "over ranks): changes of the processes' start time.",
                "none",
                [
                    _target(
                        "A",
                        f"{by_job} (changes(max by (job, rank) "
                        f"({_m('crosskd_train_start_time_seconds')})[$__range:]))",
                        "{{job}}",
                        instant=True,
                    )
                ],
                graph=False,
            )
        )
        .with_panel(
            _stat(
                next(ids),
                "Last checkpoint step",
                "Step of the last complete checkpoint.",
                "none",
                [_target("A", f"{by_job} ({_m('crosskd_train_last_checkpoint_step')})", "{{job}}")],
            )
        )
        .with_panel(
            _timeseries(
                next(ids),
                "Held-out bits per byte",
                "Student bits per byte on held-out data at the last evaluation.",
                "none",
                [
                    _target(
                        "A", f"{by_job} ({_m('crosskd_train_heldout_bits_per_byte')})", "{{job}}"
                    )
                ],
            )
        )
        .with_panel(
            _timeseries(
                next(ids),
                "Checkpoint duration",
                "Wall seconds to write one checkpoint since the process started: the mean (slowest "
                "rank) and the p95 over all ranks.",
                "s",
                [
                    _target(
                        "A",
                        f"{by_job} ({_m(checkpoint + '_sum')} / ({_m(checkpoint + '_count')} > 0))",
                        "{{job}} mean",
                    ),
                    _target(
                        "B",
                        f"histogram_quantile(0.95, sum by (job, le) "
                        f"({_m(checkpoint + '_bucket')}))",
                        "{{job}} p95",
                    ),
                ],
                minimum=0,
            )
        )
    )

    pods = (
        "on (namespace, pod) group_left () max by (namespace, pod) "
        '(kube_pod_labels{namespace="$namespace", '
        'label_training_kubeflow_org_job_name=~"$job"})'
    )
    gpu = 'namespace="$namespace"'
    board = board.with_row(dash.Row("GPUs (dcgm-exporter)").id(next(ids)))
    board = (
        board.with_panel(
            _timeseries(
                next(ids),
                "GPU utilisation",
                "DCGM_FI_DEV_GPU_UTIL of the job's pods' GPUs, percent.",
                "percent",
                [
                    _target(
                        "A", f"{_m('DCGM_FI_DEV_GPU_UTIL', gpu)} * {pods}", "{{pod}} GPU {{gpu}}"
                    )
                ],
                width=8,
                minimum=0,
            )
        )
        .with_panel(
            _timeseries(
                next(ids),
                "GPU memory used",
                "DCGM_FI_DEV_FB_USED (framebuffer memory used) of the job's pods' GPUs, MiB.",
                "mbytes",
                [_target("A", f"{_m('DCGM_FI_DEV_FB_USED', gpu)} * {pods}", "{{pod}} GPU {{gpu}}")],
                width=8,
                minimum=0,
            )
        )
        .with_panel(
            _timeseries(
                next(ids),
                "GPU power",
                "DCGM_FI_DEV_POWER_USAGE of the job's pods' GPUs, watts.",
                "watt",
                [
                    _target(
                        "A", f"{_m('DCGM_FI_DEV_POWER_USAGE', gpu)} * {pods}", "{{pod}} GPU {{gpu}}"
                    )
                ],
                width=8,
                minimum=0,
            )
        )
    )
    return board


def _scoring() -> dash.Dashboard:
    ids = itertools.count(1)
    rate = "[$__rate_interval]"
    per = "sum by (job, teacher)"
    board = _variables(
        _board(
            "crosskd-teacher-scoring",
            "crosskd teacher scoring",
            "The score_teacher step: teacher top-K signal written to the cache.",
        ),
        "crosskd_scoring_shards",
    )
    tokens = f"{per} (rate({_m('crosskd_scoring_tokens_total')}{rate}))"
    board = board.with_row(dash.Row("Throughput").id(next(ids)))
    board = board.with_panel(
        _timeseries(
            next(ids),
            "Teacher tokens/s",
            "Teacher tokens scored per second.",
            "none",
            [_target("A", tokens, "{{job}} {{teacher}}")],
            minimum=0,
        )
    ).with_panel(
        _timeseries(
            next(ids),
            "Samples/s",
            "Samples scored per second.",
            "none",
            [
                _target(
                    "A",
                    f"{per} (rate({_m('crosskd_scoring_samples_total')}{rate}))",
                    "{{job}} {{teacher}}",
                )
            ],
            minimum=0,
        )
    )

    shard = "crosskd_scoring_shard_seconds"
    board = board.with_row(dash.Row("Progress and cache").id(next(ids)))
    board = (
        board.with_panel(
            _stat(
                next(ids),
                "Progress",
                "Shards complete over the shards of the pods' ranges.",
                "percentunit",
                [
                    _target(
                        "A",
                        f"{per} ({_m('crosskd_scoring_shards_done')}) / {per} "
                        f"({_m('crosskd_scoring_shards')})",
                        "{{job}} {{teacher}}",
                    )
                ],
                width=8,
            )
        )
        .with_panel(
            _timeseries(
                next(ids),
                "Cache bytes per token",
                "Cache bytes written per teacher token scored, over the rate interval.",
                "bytes",
                [
                    _target(
                        "A",
                        f"{per} (rate({_m('crosskd_scoring_bytes_written_total')}{rate})) / "
                        f"{tokens}",
                        "{{job}} {{teacher}}",
                    )
                ],
                width=8,
                minimum=0,
            )
        )
        .with_panel(
            _timeseries(
                next(ids),
                "Seconds per shard",
                "Wall seconds per shard scored since the pods started: the mean and the p95.",
                "s",
                [
                    _target(
                        "A",
                        f"{per} ({_m(shard + '_sum')}) / ({per} ({_m(shard + '_count')}) > 0)",
                        "{{job}} {{teacher}} mean",
                    ),
                    _target(
                        "B",
                        f"histogram_quantile(0.95, sum by (job, teacher, le) "
                        f"({_m(shard + '_bucket')}))",
                        "{{job}} {{teacher}} p95",
                    ),
                ],
                width=8,
                minimum=0,
            )
        )
    )
    return board
