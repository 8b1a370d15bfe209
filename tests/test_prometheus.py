"""A real Prometheus (Debian's ``prometheus`` package) scrapes a real run; every dashboard query
and every metric selector of every alert must return series.

The run: the pipeline's steps on the ``tiny`` preset (prepare and teacher scoring serving their
metrics, then a 2-rank ``crosskd train --nproc-per-node 2``, one "pod" with two local ranks).
Prometheus scrapes each endpoint every second with the target labels the PodMonitors of
``manifests/monitoring`` give on a cluster (``job`` from the pod label named by ``jobLabel``,
``namespace``, ``pod``, ``container``, ``endpoint`` and the ``podTargetLabels``), derived here
from the PodMonitor objects and the pod labels the PyTorchJob and the compiled pipeline set.
The GPU row's series come from a fake DCGM / kube-state-metrics exporter (no GPU here), named
as such, serving those exporters' metric and label names.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml
from monitoring import alert_rules, metric_selectors, relabel
from prometheus_client import CollectorRegistry, Gauge, start_http_server
from train_workers import free_port, free_ports

from crosskd import steps
from crosskd.data.prepare import PrepareConfig, prepare
from crosskd.distill import checked_tables
from crosskd.k8s.job import JobConfig, job_manifest
from crosskd.metrics.dashboards import build_dashboards, panel_queries, render_query
from crosskd.metrics.steps import PrepareMetrics, ScoringMetrics
from crosskd.steps.config import load_run_config
from crosskd.steps.inputs import model_tokenizer
from crosskd.teacher.scoring import ScoreConfig, merge_cache, score_shards

ROOT = Path(__file__).resolve().parents[1]
MONITORING = ROOT / "manifests" / "monitoring"
NAMESPACE = "crosskd"
TRAIN_JOB = "crosskd-tiny-0123456789"
TRAIN_POD = f"{TRAIN_JOB}-master-0"
RUN_LABEL_VALUE = "5f0c2a8e-41d7-4c1e-9b3a-2d6f8e7c1a90"  # KFP's pipeline/runid
STEPS = 60
SCRAPE_INTERVAL = 0.25
"""Seconds between scrapes (and between the points of a range query)."""


def _prometheus_binary() -> str:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.fail(
            "prometheus is not installed: install Debian's prometheus package "
            "(apt-get install prometheus; .ci/run does it)"
        )
    return binary


def _podmonitors() -> dict[str, dict]:
    docs = [d for d in yaml.safe_load_all((MONITORING / "podmonitors.yaml").read_text()) if d]
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == "PodMonitor"}


def _selects(monitor: dict, pod_labels: dict[str, str]) -> bool:
    selector = monitor["spec"]["selector"]
    if any(pod_labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expression in selector.get("matchExpressions", []):
        value, values = pod_labels.get(expression["key"]), expression.get("values", [])
        if {
            "In": value in values,
            "NotIn": value not in values,
            "Exists": value is not None,
            "DoesNotExist": value is None,
        }[expression["operator"]] is False:
            return False
    return True


def _target_labels(
    pod_labels: dict[str, str], pod: str, container: str, port: str | None
) -> dict[str, str]:
    """The target labels prometheus-operator gives one discovered target (a pod's container,
    and its declared ``port`` name, if any) under the one PodMonitor that selects the pod:
    ``job`` from ``jobLabel``, namespace, pod, container, ``endpoint`` from the endpoint's
    relabelings (which must keep the target) and the ``podTargetLabels`` (names sanitised as
    Prometheus does)."""
    chosen = [m for m in _podmonitors().values() if _selects(m, pod_labels)]
    assert len(chosen) == 1, f"{len(chosen)} PodMonitors select a pod labelled {pod_labels}"
    spec = chosen[0]["spec"]
    (endpoint,) = spec["podMetricsEndpoints"]
    discovered = {
        "__address__": "10.0.0.5",
        "__meta_kubernetes_pod_ip": "10.0.0.5",
        "__meta_kubernetes_pod_container_name": container,
        "__meta_kubernetes_pod_container_init": "false",
    }
    if port is not None:
        discovered["__meta_kubernetes_pod_container_port_name"] = port
    kept = relabel(discovered, endpoint.get("relabelings", []))
    assert kept is not None, f"{chosen[0]['metadata']['name']} drops {discovered}"
    labels = {
        "namespace": NAMESPACE,
        "pod": pod,
        "container": container,
        "endpoint": kept["endpoint"],
    }
    labels["job"] = pod_labels[spec["jobLabel"]]
    for name in spec.get("podTargetLabels", []):
        if name in pod_labels:
            labels[re.sub(r"[^a-zA-Z0-9_]", "_", name)] = pod_labels[name]
    return labels


def _training_pod_labels() -> tuple[dict[str, str], list[str]]:
    """The Master pod's labels (the PyTorchJob's template plus the operator's) and the named
    ports of its container."""
    job = job_manifest(
        JobConfig(run_id="tiny", image="crosskd:test", name=TRAIN_JOB, cpu_procs_per_node=2)
    )
    template = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]
    labels = dict(template["metadata"]["labels"]) | {
        "training.kubeflow.org/operator-name": "pytorchjob-controller",
        "training.kubeflow.org/job-name": TRAIN_JOB,
        "training.kubeflow.org/replica-type": "master",
        "training.kubeflow.org/replica-index": "0",
        "training.kubeflow.org/job-role": "master",
    }
    ports = [
        p["name"]
        for p in template["spec"]["containers"][0]["ports"]
        if p["name"].startswith("metrics-")
    ]
    return labels, ports


def _step_pod_labels(component: str, monitor_job_label: str) -> dict[str, str]:
    """A pipeline step pod's labels: what the compiled pipeline sets on the task
    (kfp-kubernetes ``add_pod_label``) plus the run label KFP's backend sets."""
    compiled = list(yaml.safe_load_all((ROOT / "pipelines" / "distill.yaml").read_text()))
    executors = compiled[1]["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    task = {"prepare": "exec-prepare", "score-teacher": "exec-score-teacher"}[component]
    labels = dict(executors[task]["podMetadata"]["labels"])
    return labels | {monitor_job_label: RUN_LABEL_VALUE}


class _Prometheus:
    """``prometheus`` on a free loopback port over a generated config; stopped by its pid."""

    def __init__(self, folder: Path, scrape_configs: list[dict]) -> None:
        self.port = free_port()
        config = {
            "global": {
                "scrape_interval": f"{SCRAPE_INTERVAL * 1000:.0f}ms",
                # As long as Prometheus allows: on 2 busy cores a rank in
                # the middle of a step can take more than 200 ms to answer.
                "scrape_timeout": f"{SCRAPE_INTERVAL * 1000:.0f}ms",
                "evaluation_interval": "1s",
            },
            "scrape_configs": scrape_configs,
        }
        (folder / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = (folder / "prometheus.log").open("w")
        self.process = subprocess.Popen(
            [
                _prometheus_binary(),
                f"--config.file={folder / 'prometheus.yml'}",
                f"--storage.tsdb.path={folder / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{self.url}/-/ready", timeout=2)
                return
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    pytest.fail(
                        "prometheus did not start: "
                        f"{(folder / 'prometheus.log').read_text()[-2000:]}"
                    )
                time.sleep(0.2)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def api(self, path: str, **params: str) -> dict:
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=30) as reply:
            body = json.loads(reply.read())
        assert body["status"] == "success", body
        return body["data"]

    def series(self, expr: str, start: float, end: float) -> list[dict]:
        """The range query's series over ``start .. end``, one point per scrape interval."""
        return self.api(
            "query_range",
            query=expr,
            start=f"{start:.3f}",
            end=f"{end:.3f}",
            step=str(SCRAPE_INTERVAL),
        )["result"]

    def stop(self) -> None:
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait()
        self.log.close()


def _fake_gpu_exporter(pod: str) -> tuple[int, object]:
    """A FAKE of dcgm-exporter and kube-state-metrics: their metric and label names (dcgm's
    ``namespace``/``pod``/``container`` of the GPU's pod; ``kube_pod_labels`` with the allowed
    ``label_training_kubeflow_org_job_name``), served for the training pod."""
    registry = CollectorRegistry()
    gpu = ["gpu", "UUID", "modelName", "Hostname", "namespace", "pod", "container"]
    for name, value in (
        ("DCGM_FI_DEV_GPU_UTIL", 87.0),
        ("DCGM_FI_DEV_FB_USED", 40960.0),
        ("DCGM_FI_DEV_POWER_USAGE", 512.5),
    ):
        metric = Gauge(name, f"fake {name}", gpu, registry=registry)
        for index in range(2):
            metric.labels(
                str(index), f"GPU-{index}", "NVIDIA H100", "node-1", NAMESPACE, pod, "pytorch"
            ).set(value + index)
    kube = Gauge(
        "kube_pod_labels",
        "fake kube-state-metrics pod labels",
        ["namespace", "pod", "uid", "label_training_kubeflow_org_job_name"],
        registry=registry,
    )
    kube.labels(NAMESPACE, pod, "0f0f", TRAIN_JOB).set(1)
    server, _ = start_http_server(0, addr="127.0.0.1", registry=registry)
    return server.server_port, server


def _wait_scraped(server, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while server.scrapes == 0:
        assert time.monotonic() < deadline, "prometheus never scraped the step's endpoint"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def scraped(tmp_path_factory):
    """The run, scraped: ``(prometheus, start, end, jobs)`` (``jobs``: dashboard name ->
    the ``job`` label value its series carry)."""
    folder = tmp_path_factory.mktemp("prometheus")
    train_labels, train_ports = _training_pod_labels()
    assert train_ports[:2] == ["metrics-0", "metrics-1"]
    step_monitor = _podmonitors()["crosskd-steps"]
    assert not _selects(step_monitor, train_labels)
    job_label = step_monitor["spec"]["jobLabel"]
    step_ports = {"prepare": free_port(), "score-teacher": free_port()}
    base = free_ports(2)
    while {base, base + 1} & set(step_ports.values()):
        base = free_ports(2)
    gpu_port, gpu_server = _fake_gpu_exporter(TRAIN_POD)
    targets = [
        (f"train-{i}", base + i, _target_labels(train_labels, TRAIN_POD, "pytorch", port))
        for i, port in enumerate(train_ports[:2])
    ]
    step_targets = {
        # a KFP task pod: Argo's container `main`, no declared port
        component: _target_labels(
            _step_pod_labels(component, job_label),
            f"crosskd-distill-x7k2p-{component}-1234",
            "main",
            None,
        )
        for component in ("prepare", "score-teacher")
    }
    scrape_configs = (
        [
            {
                "job_name": name,
                "static_configs": [{"targets": [f"127.0.0.1:{port}"], "labels": labels}],
            }
            for name, port, labels in targets
        ]
        + [
            {
                "job_name": f"step-{component}",
                "static_configs": [
                    {"targets": [f"127.0.0.1:{step_ports[component]}"], "labels": labels}
                ],
            }
            for component, labels in step_targets.items()
        ]
        + [
            {
                "job_name": "fake-dcgm-and-kube-state-metrics",
                "honor_labels": True,
                "static_configs": [{"targets": [f"127.0.0.1:{gpu_port}"]}],
            }
        ]
    )
    prometheus = _Prometheus(folder, scrape_configs)
    start = time.time()
    try:
        train_yaml, heldout = _steps_with_metrics(folder / "run", step_ports)
        env = dict(os.environ, OMP_NUM_THREADS="1")
        trained = subprocess.run(
            [
                str(Path(sys.executable).parent / "crosskd"),
                "train",
                "--nproc-per-node",
                "2",
                "--config",
                str(train_yaml),
                f"steps={STEPS}",
                f"metrics_port={base}",
                "checkpoint_every=10",
                "eval_every=20",
                "metrics_host=127.0.0.1",
                "metrics_final_scrape_s=20",
                f"eval_data={heldout}",
            ],
            env=env,
            timeout=600,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        assert trained.returncode == 0, trained.stdout[-3000:]
        end = time.time() + 2
        time.sleep(2)
        jobs = {"crosskd-training.json": TRAIN_JOB, "crosskd-teacher-scoring.json": RUN_LABEL_VALUE}
        yield prometheus, start, end, jobs, step_targets
    finally:
        prometheus.stop()
        gpu_server.shutdown()


def prepared_rows(plan: dict, prepared: dict) -> str:
    """The training rows the plan prepared (its own file, or the split of the training data)."""
    split = Path(prepared["uri"]) / "rows" / "train.jsonl"
    return str(split) if split.exists() else plan["train_data"]


def _steps_with_metrics(root: Path, ports: dict[str, int]) -> tuple[Path, str]:
    """The tiny preset's steps up to the KD run's train config; a preparation and the scoring
    of the training split run with their metrics served on ``ports`` (``prepare``,
    ``score-teacher``); each waits for Prometheus's first scrape, so even these short steps
    show a start and an end. Returns the train config and the prepared held-out data."""
    config = load_run_config(None, "tiny", [f"output={root}", "device=cpu"])
    plan = steps.validate_inputs(config)
    tables = checked_tables(plan, progress=False)
    prepared = steps.prepare_data(plan, max_length=config.max_length, shard_rows=8, progress=False)
    metrics = PrepareMetrics()
    metrics.serve(ports["prepare"], host="127.0.0.1")
    _wait_scraped(metrics)
    prepare(
        PrepareConfig(
            data=prepared_rows(plan, prepared),
            student_tokenizer=model_tokenizer(plan["student"]),
            teacher_tokenizers=[model_tokenizer(t["ref"]) for t in plan["teachers"]],
            output=str(root / "prepared-again"),
            max_length=16,
            teacher_max_length=32,
            shard_rows=8,
        ),
        progress=False,
        on_row=lambda reason: metrics.row("train", reason),
    )
    metrics.close(30)
    caches = []
    for job in steps.plan_scoring(plan, prepared, config.scoring(), 1):
        uri = str(root / f"cache-{job['teacher']['index']}")
        scoring = ScoringMetrics(f"teacher{job['teacher']['index']}")
        scoring.serve(ports["score-teacher"], host="127.0.0.1")
        _wait_scraped(scoring)
        score_shards(
            ScoreConfig(
                data=job["data"],
                teacher=job["teacher"]["ref"],
                output=uri,
                teacher_index=int(job["teacher"]["index"]),
                k=config.k,
                token_budget=config.token_budget,
                device="cpu",
            ),
            progress=False,
            metrics=scoring,
        )
        scoring.close(30)
        merge_cache(uri)
        caches.append({"index": int(job["teacher"]["index"]), "cache": uri})
    item = next(
        i
        for i in steps.plan_training(config, plan, prepared, tables, caches, str(root))
        if i["variant"] == "kd"
    )
    path = root / "kd-train.yaml"
    path.write_text(yaml.safe_dump(item["train"]))
    return path, prepared["heldout"]


def test_prometheus_scrapes_every_endpoint_with_the_podmonitor_labels(scraped):
    prometheus, start, end, _, step_targets = scraped
    up = prometheus.series('up{app_kubernetes_io_name="crosskd"}', start, end)
    by_endpoint = {
        (s["metric"]["app_kubernetes_io_component"], s["metric"]["endpoint"]): s for s in up
    }
    assert {("trainer", "metrics-0"), ("trainer", "metrics-1")} <= set(by_endpoint)
    for (component, _), series in by_endpoint.items():
        assert any(v == "1" for _, v in series["values"]), (component, series)
    steps_values = prometheus.series("crosskd_train_step", start, end)
    ranks = {s["metric"]["rank"]: s["metric"] for s in steps_values}
    assert sorted(ranks) == ["0", "1"]
    for labels in ranks.values():
        assert labels["job"] == TRAIN_JOB and labels["namespace"] == NAMESPACE
        assert labels["pod"] == TRAIN_POD and labels["container"] == "pytorch"
        assert labels["training_kubeflow_org_replica_type"] == "master"
    final = {s["metric"]["rank"]: float(s["values"][-1][1]) for s in steps_values}
    assert final == {"0": STEPS, "1": STEPS}  # the last values were scraped before the end
    tokens = prometheus.series("crosskd_train_tokens_total", start, end)
    assert [s["metric"]["rank"] for s in tokens if float(s["values"][-1][1]) > 0] == ["0"]
    scored = prometheus.series("crosskd_scoring_shards_done", start, end)
    assert scored and all(s["metric"]["job"] == RUN_LABEL_VALUE for s in scored)
    shards = prometheus.series("crosskd_scoring_shards", start, end)
    assert float(scored[0]["values"][-1][1]) == float(shards[0]["values"][-1][1]) >= 1
    assert step_targets["score-teacher"]["app_kubernetes_io_component"] == "score-teacher"
    assert step_targets["score-teacher"]["endpoint"] == "9400"  # the pipeline's metrics_port


def test_every_dashboard_query_returns_series(scraped):
    """Every panel and annotation query returns series labelled with the chosen job (the GPU
    row: with the job's pod); every variable's ``label_values`` series carry its label and
    offer the run's namespace and job."""
    prometheus, start, end, jobs, _ = scraped
    dashboards = build_dashboards()
    assert set(jobs) == set(dashboards)
    checked = []
    for name, dashboard in dashboards.items():
        variables = {"namespace": NAMESPACE, "job": jobs[name], "datasource": "prometheus"}
        for query in panel_queries(dashboard):
            expr = render_query(query.expr, variables)
            assert "$" not in expr, (name, query)
            if query.kind == "variable":
                selector, label = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", expr).groups()
                result = prometheus.series(selector, start, end)
                offered = {s["metric"].get(label) for s in result}
                assert variables[label] in offered, (name, query, offered)
                checked.append((name, query.kind))
                continue
            result = prometheus.series(expr, start, end)
            assert result, f"{name}: {query} returned no series ({expr})"
            for series in result:
                labels = series["metric"]
                if expr.startswith("DCGM_"):
                    assert labels["pod"] == TRAIN_POD, (query, labels)
                else:
                    assert labels["job"] == jobs[name], (query, labels)
            checked.append((name, query.kind))
    assert {kind for _, kind in checked} == {"panel", "annotation", "variable"}
    assert len(checked) == sum(len(panel_queries(d)) for d in dashboards.values())


def test_every_alert_selector_returns_series(scraped):
    prometheus, start, end, _, _ = scraped
    rules = alert_rules()
    assert {r["alert"] for r in rules} == {
        "CrosskdLossNotFinite",
        "CrosskdTrainingStalled",
        "CrosskdTargetDown",
        "CrosskdKdCollapsed",
        "CrosskdThroughputHalved",
    }
    for rule in rules:
        selectors = metric_selectors(rule["expr"])
        assert selectors, rule
        for selector in selectors:
            assert prometheus.series(selector, start, end), (rule["alert"], selector)


def test_a_healthy_run_fires_no_alert(scraped):
    """No alert expression returns a series over the run (their ``for`` aside). The targets
    are down before their process serves and after it ends, so ``CrosskdTargetDown`` is read
    while both training ranks serve: then no training target is down for two scrapes in a row.
    (One scrape of a rank in the middle of a step can time out on 2 cores busy with the rest of
    the suite; the rule holds for 5 minutes before it fires, which absorbs that.)"""
    prometheus, start, end, _, _ = scraped
    serving = [
        [float(t) for t, v in s["values"] if v == "1"]
        for s in prometheus.series('up{app_kubernetes_io_component="trainer"}', start, end)
    ]
    assert len(serving) == 2 and all(serving), serving
    both = (max(times[0] for times in serving), min(times[-1] for times in serving))
    assert both[0] < both[1]
    for rule in alert_rules():
        if rule["alert"] == "CrosskdTargetDown":
            selector = rule["expr"].removesuffix(" == 0")
            assert selector != rule["expr"], rule["expr"]
            window = f"{math.ceil(both[1] - both[0]) + 1}s"
            raw = prometheus.api("query", query=f"{selector}[{window}]", time=f"{both[1]:.3f}")
            scrapes = [
                [v for t, v in s["values"] if both[0] <= float(t)]
                for s in raw["result"]
                if s["metric"]["app_kubernetes_io_component"] == "trainer"
            ]
            assert len(scrapes) == 2 and all(scrapes), scrapes
            fired = [values for values in scrapes if _most_in_a_row(values, "0") >= 2]
        else:
            fired = prometheus.series(rule["expr"], start, end)
        assert not fired, (rule["alert"], fired)


def _most_in_a_row(values: list[str], value: str) -> int:
    """The longest run of ``value`` in ``values`` (a series' raw samples, in time order)."""
    longest = run = 0
    for v in values:
        run = run + 1 if v == value else 0
        longest = max(longest, run)
    return longest


def test_served_metrics_are_all_in_docs_metrics_md(scraped):
    prometheus, start, end, _, _ = scraped
    names = prometheus.api("label/__name__/values", start=f"{start:.3f}", end=f"{end:.3f}")
    ours = set()
    for name in (n for n in names if n.startswith("crosskd_")):
        family = re.sub(r"_(bucket|sum|count|created)$", "", name)  # a histogram's series
        ours.add(f"{family}_total" if f"{family}_total" in names else family)  # a counter's
    page = (ROOT / "docs" / "metrics.md").read_text()
    documented = set(re.findall(r"`(crosskd_[a-z_]+)`", page))
    assert ours, names
    assert ours <= documented, f"served but not in docs/metrics.md: {sorted(ours - documented)}"


def test_a_short_step_serves_its_final_values_to_a_scraper(tmp_path):
    """``close`` waits for one more scrape once the endpoint has been scraped, so a pod's last
    values are read; with no scraper it returns at once."""
    metrics = ScoringMetrics("teacher0")
    port = metrics.serve(0, host="127.0.0.1")
    read = []

    def scraper() -> None:
        while len(read) < 2:
            read.append(
                urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10)
                .read()
                .decode()
            )
            time.sleep(0.3)

    thread = threading.Thread(target=scraper)
    thread.start()
    while not read:
        time.sleep(0.05)
    metrics.samples.inc(7)
    metrics.close(30)
    thread.join()
    assert 'crosskd_scoring_samples_total{teacher="teacher0"} 7.0' in read[-1]
    quiet = PrepareMetrics()
    quiet.serve(0, host="127.0.0.1")
    closing = threading.Thread(target=quiet.close, args=(3600,))
    closing.start()
    closing.join(120)  # a hang guard, not a timing: a wait would last the hour
    assert not closing.is_alive() and quiet.scrapes == 0
