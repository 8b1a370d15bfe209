"""Grafana dashboards (``crosskd.metrics.dashboards``): both validate against the Grafana 11.6
dashboard JSON schema (vendored outside the repo), panel ids are unique, every data source is
the ``datasource`` variable, every query selects the namespace and job variables and reads only
crosskd, dcgm-exporter or kube-state-metrics series, the committed files under
``manifests/monitoring/dashboards`` are what ``crosskd dashboards`` writes today, the CLI's
errors are one line, and the real ``kubectl kustomize`` turns the folder into ConfigMaps with the
Grafana sidecar's label. Whether the queries return data is the real-Prometheus test's job."""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from kube_tools import kustomize

from crosskd.cli import main
from crosskd.metrics.dashboards import (
    SCORING_FILE,
    SELECTOR,
    TRAINING_FILE,
    Query,
    build_dashboards,
    dashboard_text,
    panel_queries,
    render_query,
    write_dashboards,
)

REPO = Path(__file__).resolve().parents[1]
FOLDER = REPO / "manifests/monitoring/dashboards"
VENDOR = Path(__file__).resolve().parents[2] / "shared/vendor"
SCHEMA = VENDOR / "grafana-dashboard-v11.6.jsonschema.json"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
FILES = (TRAINING_FILE, SCORING_FILE)
VARIABLES = {"namespace": "crosskd", "job": "(run-a|run-b)", "__range": "6h"}
# What the issue asks each dashboard to show (the real-Prometheus test proves the names exist).
REQUIRED = {
    TRAINING_FILE: {
        "crosskd_train_loss",
        "crosskd_train_ce_loss",
        "crosskd_train_kd_loss",
        "crosskd_train_kd_scale",
        "crosskd_train_learning_rate",
        "crosskd_train_grad_norm",
        "crosskd_train_tokens_total",
        "crosskd_train_step_seconds_bucket",
        "crosskd_train_chunks_total",
        "crosskd_train_heldout_bits_per_byte",
        "crosskd_train_step",
        "crosskd_train_planned_steps",
        "crosskd_train_start_time_seconds",
        "crosskd_train_checkpoint_seconds_sum",
        "crosskd_train_last_checkpoint_step",
        "DCGM_FI_DEV_GPU_UTIL",
        "DCGM_FI_DEV_FB_USED",
        "DCGM_FI_DEV_POWER_USAGE",
        "kube_pod_labels",
    },
    SCORING_FILE: {
        "crosskd_scoring_samples_total",
        "crosskd_scoring_tokens_total",
        "crosskd_scoring_bytes_written_total",
        "crosskd_scoring_shards_done",
        "crosskd_scoring_shards",
        "crosskd_scoring_shard_seconds_sum",
    },
}
_KEYWORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "and",
    "or",
    "unless",
    "bool",
    "offset",
    "inf",
    "nan",
}


@functools.cache
def _dashboards() -> dict[str, dict[str, Any]]:
    return build_dashboards()


def _all_panels(panels: list[dict]) -> list[dict]:
    out = []
    for panel in panels:
        out.append(panel)
        out += _all_panels(panel.get("panels") or [])
    return out


def _walk(node: object, path: str = ""):
    """Every (path, key, value) of a JSON tree."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield path, key, value
            yield from _walk(value, f"{path}/{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _walk(value, f"{path}/{i}")


def metric_names(query: Query) -> set[str]:
    """The series names a query reads (``label_values(X, label)``: those of X)."""
    text = query.expr
    if query.kind == "variable":
        match = re.fullmatch(r"label_values\((.*),\s*\w+\)", text.strip())
        assert match, f"variable {query.title}: {text!r} is not label_values(series, label)"
        text = match[1]
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)  # strings
    text = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", text)  # label matchers, ranges, subqueries
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    names = re.findall(r"(?<![\w:.])([A-Za-z_:][\w:]*)(?![\w:])(?!\s*\()", text)
    return {name for name in names if name.lower() not in _KEYWORDS}


# --- the dashboards' JSON ----------------------------------------------------------------------


def test_both_dashboards_are_built():
    dashboards = _dashboards()
    assert set(dashboards) == set(FILES)
    assert dashboards[TRAINING_FILE]["title"] == "crosskd training"
    assert dashboards[SCORING_FILE]["title"] == "crosskd teacher scoring"
    assert len({d["uid"] for d in dashboards.values()}) == 2


@pytest.mark.parametrize("name", FILES)
def test_dashboard_validates_against_the_grafana_11_6_schema(name):
    if not SCHEMA.is_file():
        pytest.skip(
            f"{SCHEMA} is absent (the vendored Grafana dashboard schema lives outside "
            "the repo, in ../shared/vendor)"
        )
    validator = jsonschema.Draft7Validator(json.loads(SCHEMA.read_text()))
    errors = [
        f"{'/'.join(map(str, e.absolute_path))}: {e.message[:200]}"
        for e in validator.iter_errors(_dashboards()[name])
    ]
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("name", FILES)
def test_panel_ids_are_unique_and_every_panel_has_options(name):
    panels = _all_panels(_dashboards()[name]["panels"])
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids)), ids
    for panel in panels:
        if panel["type"] != "row":
            assert isinstance(panel.get("options"), dict), panel["title"]
            assert panel.get("targets"), panel["title"]
            assert panel.get("description"), panel["title"]


@pytest.mark.parametrize("name", FILES)
def test_every_data_source_is_the_variable(name):
    dashboard = _dashboards()[name]
    refs = [(path, value) for path, key, value in _walk(dashboard) if key == "datasource"]
    targets = [t for p in _all_panels(dashboard["panels"]) for t in p.get("targets") or []]
    assert len(refs) >= len(targets) + 2  # every target, annotation and query variable
    for path, value in refs:
        assert value == DATASOURCE, path
    (variable,) = [v for v in dashboard["templating"]["list"] if v["name"] == "datasource"]
    assert variable["type"] == "datasource" and variable["query"] == "prometheus"


@pytest.mark.parametrize("name", FILES)
def test_template_variables(name):
    variables = {v["name"]: v for v in _dashboards()[name]["templating"]["list"]}
    assert list(variables) == ["datasource", "namespace", "job"]
    metric = "crosskd_train_step" if name == TRAINING_FILE else "crosskd_scoring_shards"
    assert variables["namespace"]["query"] == f"label_values({metric}, namespace)"
    assert variables["job"]["query"] == f'label_values({metric}{{namespace="$namespace"}}, job)'
    assert variables["job"]["multi"] and variables["job"]["includeAll"]
    assert "allValue" not in variables["job"]  # All is the values seen, never .*


def test_training_has_the_checkpoint_annotation_and_the_gpu_row():
    dashboard = _dashboards()[TRAINING_FILE]
    (annotation,) = dashboard["annotations"]["list"]
    assert "changes(crosskd_train_last_checkpoint_step{" in annotation["expr"]
    rows = [p["title"] for p in dashboard["panels"] if p["type"] == "row"]
    assert rows == [
        "Losses",
        "Optimizer",
        "Throughput",
        "Progress and checkpoints",
        "GPUs (dcgm-exporter)",
    ]
    gpu = [q for q in panel_queries(dashboard) if "DCGM_" in q.expr]
    assert len(gpu) == 3
    for query in gpu:
        assert (
            " * on (namespace, pod) group_left () max by (namespace, pod) (kube_pod_labels{"
            'namespace="$namespace", label_training_kubeflow_org_job_name=~"$job"})' in query.expr
        )


# --- the queries -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", FILES)
def test_panel_queries_cover_every_target_annotation_and_variable(name):
    dashboard = _dashboards()[name]
    queries = panel_queries(dashboard)
    panels = _all_panels(dashboard["panels"])
    targets = [(p["title"], t["refId"], t["expr"]) for p in panels for t in p.get("targets") or []]
    assert [(q.title, q.ref_id, q.expr) for q in queries if q.kind == "panel"] == targets
    assert [q.expr for q in queries if q.kind == "annotation"] == [
        a["expr"] for a in dashboard["annotations"].get("list", [])
    ]
    assert [q.title for q in queries if q.kind == "variable"] == ["namespace", "job"]
    for title in {t for t, _, _ in targets}:  # refIds unique within a panel
        refs = [r for t, r, _ in targets if t == title]
        assert len(refs) == len(set(refs)), title


@pytest.mark.parametrize("name", FILES)
def test_every_query_selects_the_namespace_and_the_job(name):
    for query in panel_queries(_dashboards()[name]):
        assert 'job="$job"' not in query.expr, query  # multi-value: always =~
        if query.kind == "variable":
            continue
        assert '"$namespace"' in query.expr and '=~"$job"' in query.expr, query
        names = re.findall(r"crosskd_\w+", query.expr)
        selectors = re.findall(r"(crosskd_\w+)\{([^}]*)\}", query.expr)
        assert len(selectors) == len(names), query  # no bare crosskd_ name
        assert {matchers for _, matchers in selectors} <= {SELECTOR}, query


@pytest.mark.parametrize("name", FILES)
def test_queries_read_only_crosskd_dcgm_and_kube_state_metrics_series(name):
    used = set()
    for query in panel_queries(_dashboards()[name]):
        names = metric_names(query)
        assert names, query
        for metric in names:
            assert metric.startswith(("crosskd_", "DCGM_", "kube_")), (metric, query)
        used |= names
    own = "crosskd_train_" if name == TRAINING_FILE else "crosskd_scoring_"
    assert {m for m in used if m.startswith("crosskd_")} <= {m for m in used if m.startswith(own)}
    assert REQUIRED[name] <= used, REQUIRED[name] - used


def test_metric_names_parser():
    query = Query(
        "panel",
        "t",
        "A",
        "histogram_quantile(0.95, sum by (job, le) (rate("
        'x_bucket{a="b{c}", job=~"$job"}[$__rate_interval]))) / on (job) group_left () '
        "max by (job) (changes(y[5m:])) > bool 0",
    )
    assert metric_names(query) == {"x_bucket", "y"}
    assert metric_names(Query("variable", "v", "", 'label_values(z{n="$n"}, job)')) == {"z"}


def test_render_query_substitutes_every_variable():
    expr = (
        'rate(m{namespace="$namespace", job=~"${job}", x="${job:regex}", y="[[namespace]]"}'
        "[$__rate_interval]) + m offset $__interval + changes(m[$__range:])"
    )
    assert render_query(expr, {"namespace": "ns", "job": "(a|b)"}) == (
        'rate(m{namespace="ns", job=~"(a|b)", x="(a|b)", y="ns"}[1m]) + m offset 1m + '
        "changes(m[1m:])"
    )
    given = {"__range": "6h", "__rate_interval_x": "z"}
    rendered = render_query("changes(m[$__range:]) > $__rate_interval_x", given, "2m")
    assert rendered == "changes(m[6h:]) > z"
    assert render_query('m{a=~"b$"}', {}) == 'm{a=~"b$"}'  # a regex anchor is no variable
    with pytest.raises(ValueError, match=r"\$job"):
        render_query('m{job=~"$job"}', {"namespace": "ns"})


@pytest.mark.parametrize("name", FILES)
def test_every_query_renders_without_a_variable_left(name):
    for query in panel_queries(_dashboards()[name]):
        rendered = render_query(query.expr, VARIABLES)
        assert "$" not in rendered and "[[" not in rendered, rendered
        if query.title != "namespace":
            assert 'namespace="crosskd"' in rendered, rendered


# --- files, CLI, kustomize ---------------------------------------------------------------------


def test_committed_files_are_fresh(tmp_path):
    """Regenerate with `crosskd dashboards --output manifests/monitoring/dashboards`."""
    written = write_dashboards(tmp_path)
    assert [p.name for p in written] == sorted(FILES)
    committed = sorted(p.name for p in FOLDER.glob("*.json"))
    assert committed == sorted(FILES), "run crosskd dashboards --output " + str(FOLDER)
    for path in written:
        assert (FOLDER / path.name).read_text() == path.read_text(), (
            f"{FOLDER / path.name} is stale: run crosskd dashboards --output {FOLDER}"
        )
        assert json.loads(path.read_text()) == _dashboards()[path.name]
        assert path.read_text() == dashboard_text(_dashboards()[path.name])


def test_cli_writes_the_dashboards(tmp_path, capsys):
    out = tmp_path / "new" / "folder"
    assert main(["dashboards", "--output", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(FILES)
    assert capsys.readouterr().out.splitlines() == [f"wrote {out / n}" for n in sorted(FILES)]
    assert main(["dashboards", "--output", str(out)]) == 0  # an existing folder is fine


@pytest.mark.parametrize("where", ["file", "under_a_file"])
def test_cli_error_is_one_line(tmp_path, capsys, where):
    afile = tmp_path / "afile"
    afile.write_text("x")
    target = afile if where == "file" else afile / "sub"
    assert main(["dashboards", "--output", str(target)]) == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("crosskd: error: "), captured.err
    assert str(afile) in lines[0] and "Traceback" not in captured.err
    assert afile.read_text() == "x"


def test_kustomize_builds_one_labelled_configmap_per_dashboard():
    docs = kustomize(FOLDER)
    assert {d["kind"] for d in docs} == {"ConfigMap"}
    by_file = {}
    for doc in docs:
        assert doc["metadata"]["labels"]["grafana_dashboard"] == "1", doc["metadata"]
        (key,) = doc["data"]
        by_file[key] = doc
    assert set(by_file) == set(FILES)
    assert by_file[TRAINING_FILE]["metadata"]["name"] == "crosskd-dashboard-training"
    assert by_file[SCORING_FILE]["metadata"]["name"] == "crosskd-dashboard-teacher-scoring"
    for name, doc in by_file.items():
        assert doc["data"][name] == (FOLDER / name).read_text()
        # `kubectl apply` (client side) keeps the whole object in an annotation of 256 KiB.
        assert len(doc["data"][name].encode()) < 200_000, name
