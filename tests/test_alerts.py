"""The alerts of ``manifests/monitoring/prometheusrule.yaml``: ``promtool check rules`` on the
PrometheusRule's ``.spec``, ``promtool test rules`` on ``manifests/monitoring/tests/
alerts.test.yaml`` (each alert fires on its case with its labels and annotations, and stays
silent on a healthy, finished, young or stopped job), the guards each silent case relies on,
every metric an alert reads documented in ``docs/metrics.md``, and the selector parser of
``tests/monitoring.py``."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from monitoring import (
    ROOT,
    RULES_NAME,
    UNIT_TESTS,
    alert_rules,
    metric_selectors,
    rule_file_text,
    selector_name,
)

ALERTS = {
    "CrosskdLossNotFinite",
    "CrosskdTrainingStalled",
    "CrosskdTargetDown",
    "CrosskdKdCollapsed",
    "CrosskdThroughputHalved",
}
METRICS_PAGE = ROOT / "docs" / "metrics.md"


def _promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.fail(
            "promtool is not installed: install Debian's prometheus package "
            "(apt-get install --no-install-recommends prometheus; .ci/run does it)"
        )
    return found


def test_a_missing_promtool_fails_with_the_package_to_install(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(pytest.fail.Exception, match="Debian's prometheus package"):
        _promtool()


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [_promtool(), *args], cwd=cwd, capture_output=True, text=True, timeout=60, check=False
    )


def _unit_test_folder(folder: Path, rules: str) -> Path:
    """``folder`` with ``rules`` as the rule file and a copy of the unit tests; the tests."""
    (folder / RULES_NAME).write_text(rules, encoding="utf-8")
    tests = folder / UNIT_TESTS.name
    shutil.copyfile(UNIT_TESTS, tests)
    return tests


def test_promtool_checks_the_rules(tmp_path):
    rules = tmp_path / RULES_NAME
    rules.write_text(rule_file_text(), encoding="utf-8")
    out = _run("check", "rules", str(rules), cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in out.stdout


def test_promtool_refuses_a_broken_rule(tmp_path):
    """The check is real: a rule whose expression does not parse fails it."""
    spec = yaml.safe_load(rule_file_text())
    spec["groups"][0]["rules"][0]["expr"] = "rate(crosskd_train_loss[5m]"
    rules = tmp_path / RULES_NAME
    rules.write_text(yaml.safe_dump(spec), encoding="utf-8")
    out = _run("check", "rules", str(rules), cwd=tmp_path)
    assert out.returncode != 0 and "FAILED" in out.stdout + out.stderr


def test_alert_unit_tests_pass(tmp_path):
    tests = _unit_test_folder(tmp_path, rule_file_text())
    out = _run("test", "rules", str(tests), cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


def test_unit_tests_cover_every_alert_firing_and_silent():
    """Each alert has a test where it fires (labels and both annotations checked) and one
    where it must stay silent."""
    unit = yaml.safe_load(UNIT_TESTS.read_text(encoding="utf-8"))
    assert unit["rule_files"] == [RULES_NAME]
    fired, silent = set(), set()
    for case in unit["tests"]:
        for check in case["alert_rule_test"]:
            for alert in check["exp_alerts"]:
                assert set(alert["exp_annotations"]) == {"summary", "description"}, alert
                assert alert["exp_labels"]["severity"] in ("warning", "critical")
            (fired if check["exp_alerts"] else silent).add(check["alertname"])
    assert fired == ALERTS and silent == ALERTS


def _unguarded(rule: dict) -> str:
    """The alert's bare condition: its first clause before any ``and``, and ``up`` of any
    application for CrosskdTargetDown."""
    if rule["alert"] == "CrosskdTargetDown":
        return re.sub(r"up\{[^}]*\}", "up", rule["expr"])
    return re.split(r"^\s*and\b", rule["expr"], flags=re.MULTILINE)[0]


def test_the_silent_cases_need_the_guards(tmp_path):
    """With each alert reduced to its bare condition the unit tests fail for every guarded
    alert: the finished, gone, restarted, idle, young and stopped jobs and the other
    application's target would alert."""
    spec = yaml.safe_load(rule_file_text())
    guarded = set()
    for group in spec["groups"]:
        for rule in group["rules"]:
            bare = _unguarded(rule)
            if bare.strip() != rule["expr"].strip():
                guarded.add(rule["alert"])
                rule["expr"] = bare
    assert guarded == ALERTS - {"CrosskdLossNotFinite"}
    tests = _unit_test_folder(tmp_path, yaml.safe_dump(spec, sort_keys=False))
    out = _run("test", "rules", str(tests), cwd=tmp_path)
    assert out.returncode != 0
    text = out.stdout + out.stderr
    assert set(re.findall(r"alertname: (\w+)", text)) == guarded, text
    got = set()  # (alert, eval time, job) of the alerts that fired where none was expected
    for block in text.split("alertname: ")[1:]:
        alert, when = re.match(r"(\w+), time: (\w+)", block).groups()
        got |= {
            (alert, when, job) for job in re.findall(r'\bjob="([^"]+)"', block.partition("got:")[2])
        }
    assert {
        ("CrosskdTrainingStalled", "25m", "finished"),
        ("CrosskdTrainingStalled", "32m", "gone"),
        ("CrosskdTrainingStalled", "32m", "restarted"),
        ("CrosskdTargetDown", "15m", "other"),
        ("CrosskdKdCollapsed", "24m", "idle"),
        ("CrosskdThroughputHalved", "2h5m", "young"),
        ("CrosskdThroughputHalved", "2h5m", "stopped"),
        ("CrosskdThroughputHalved", "2h5m", "finished"),
    } <= got, text


def test_alerts_are_the_catalogue_with_severity_for_and_annotations():
    rules = alert_rules()
    assert [r["alert"] for r in rules] == [r["name"] for r in rules]
    assert {r["alert"] for r in rules} == ALERTS and len(rules) == len(ALERTS)
    for rule in rules:
        assert re.fullmatch(r"\d+m", rule["for"]), rule
        assert rule["labels"]["severity"] in ("warning", "critical")
        assert set(rule["annotations"]) == {"summary", "description"}
        for text in rule["annotations"].values():
            assert "$labels.namespace" in text, (rule["alert"], text)


def _documented_metrics() -> set[str]:
    """The metric names of the tables in docs/metrics.md."""
    if not METRICS_PAGE.is_file():
        pytest.fail(f"{METRICS_PAGE} is missing: it is the metric catalogue the alerts use")
    names = set(
        re.findall(r"^\| `([a-z_:][a-z0-9_:]*)` \|", METRICS_PAGE.read_text(), flags=re.MULTILINE)
    )
    assert len(names) >= 20, names
    return names


def test_alerts_read_only_documented_metrics():
    documented = _documented_metrics() | {"up"}
    used = set()
    for rule in alert_rules():
        selectors = metric_selectors(rule["expr"])
        assert selectors, rule
        names = {re.sub(r"_(bucket|sum|count)$", "", selector_name(s) or "") for s in selectors}
        assert names <= documented, (rule["alert"], names - documented)
        used |= names
    assert {
        "up",
        "crosskd_train_loss",
        "crosskd_train_steps_total",
        "crosskd_train_tokens_total",
        "crosskd_train_kd_loss",
    } <= used


def test_alert_selectors_are_what_each_alert_reads():
    by_name = {r["alert"]: metric_selectors(r["expr"]) for r in alert_rules()}
    assert by_name["CrosskdTargetDown"] == ['up{app_kubernetes_io_name="crosskd"}']
    assert by_name["CrosskdLossNotFinite"] == [
        "crosskd_train_loss",
        "crosskd_train_nonfinite_stops_total",
    ]
    assert set(by_name["CrosskdThroughputHalved"]) == {
        "crosskd_train_tokens_total",
        "crosskd_train_start_time_seconds",
        "crosskd_train_planned_steps",
        "crosskd_train_step",
    }


@pytest.mark.parametrize(
    ("expr", "expected"),
    [
        ("crosskd_train_loss", ["crosskd_train_loss"]),
        ("rate(x_total[10m] offset 5m) / rate(x_total[1h] offset -5m)", ["x_total"]),
        (
            'sum by (namespace, job) (rate(x{a="b", c=~"d|e"}[1h] offset 10m)) < 0.5 * y',
            ['x{a="b", c=~"d|e"}', "y"],
        ),
        ('up{app_kubernetes_io_name="crosskd"} == 0', ['up{app_kubernetes_io_name="crosskd"}']),
        ("(x != x) or abs(x) == +Inf or x == NaN", ["x"]),
        ('label_replace(x, "dst", "$1 and y{z}", "src", "(.*)")', ["x"]),
        ("max_over_time(abs(x{a='}'})[10m:1m])", ["x{a='}'}"]),
        ('{__name__="x", job="j"}', ['{__name__="x", job="j"}']),
        ('count_values("v", x) by (le) > 1e-6', ["x"]),
        ("x and on (namespace, job) group_left (pod) y unless ignoring(a) z", ["x", "y", "z"]),
        ("max without (rank) (x) > bool 0.5e+3", ["x"]),
        ("time() - start_time_seconds > 600 and x @ 1609746000", ["start_time_seconds", "x"]),
        ("rate(x[1h30m])  # comment with y\n", ["x"]),
        ('x{a="b"} offset 1h', ['x{a="b"}']),
        ("vector(1) + scalar(sum(x))", ["x"]),
        ("x offset", ["x"]),
    ],
)
def test_metric_selectors(expr, expected):
    assert metric_selectors(expr) == expected


def test_metric_selectors_refuses_an_unclosed_bracket():
    with pytest.raises(ValueError, match="unclosed"):
        metric_selectors('x{a="b"')


def test_selector_name():
    assert selector_name('up{a="b"}') == "up"
    assert selector_name('{__name__="x", job="j"}') == "x"
    assert selector_name('{job="j"}') is None
