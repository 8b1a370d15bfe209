"""Submitting a compiled pipeline (:mod:`crosskd.pipeline.submit`) with the real ``kfp.Client``
against FakeKfpApi (``tests/kfp_fake.py``, a fake speaking the subset of the KFP v2beta1 REST API
the client uses; no KFP server runs in the tests).

No ``from __future__ import annotations`` here: kfp reads the component's annotations as types.
"""

import logging
import time
from pathlib import Path

import pytest
import yaml
from kfp import compiler, dsl
from kfp_fake import FakeKfpApi

from crosskd.errors import ConfigError, CrosskdError
from crosskd.pipeline.submit import SubmittedRun, run_failed, submit_pipeline

TOKEN = "s3cr3t-token-abc123"


@dsl.component(base_image="python:3.11-slim")
def _echo(steps: int, name: str, flag: bool, layers: list, lr: float) -> str:
    return f"{steps} {name} {flag} {layers} {lr}"


@dsl.pipeline(name="tiny-crosskd")
def _tiny(
    name: str,
    steps: int = 10,
    flag: bool = False,
    layers: list = [1, 2],  # noqa: B006 - a pipeline default, compiled into the spec
    lr: float = 0.5,
):
    _echo(steps=steps, name=name, flag=flag, layers=layers, lr=lr)


@pytest.fixture(scope="module")
def package(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny pipeline compiled to YAML (parameters: name str required; steps int, flag bool,
    layers list, lr float with defaults)."""
    path = tmp_path_factory.mktemp("kfp") / "tiny.yaml"
    compiler.Compiler().compile(_tiny, str(path))
    return path


@pytest.fixture(autouse=True)
def _hermetic_client(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No user KFP context, no ambient token or kfp settings from the environment."""
    import kfp.client.client as kfp_client_module

    monkeypatch.setattr(
        kfp_client_module.Client, "_LOCAL_KFP_CONTEXT", str(tmp_path / "kfp-context.json")
    )
    for name in (
        "KFP_TOKEN",
        "KF_PIPELINES_ENDPOINT",
        "KF_PIPELINES_UI_ENDPOINT",
        "KF_PIPELINES_IAP_OAUTH2_CLIENT_ID",
        "KF_PIPELINES_APP_OAUTH2_CLIENT_ID",
        "KF_PIPELINES_APP_OAUTH2_CLIENT_SECRET",
        "KF_PIPELINES_DEFAULT_EXPERIMENT_NAME",
        "KF_PIPELINES_OVERRIDE_EXPERIMENT_NAME",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("KF_PIPELINES_SA_TOKEN_PATH", str(tmp_path / "no-token-file"))


@pytest.fixture
def fake():
    with FakeKfpApi() as api:
        yield api
        assert api.errors == []


ARGS = {"name": "run-1", "steps": "50", "flag": "true", "layers": "[3, 4]", "lr": "1e-4"}


def test_submit_sends_spec_and_typed_parameters(
    fake: FakeKfpApi, package: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = submit_pipeline(str(package), host=fake.host, arguments=ARGS, run_name="first")

    (created,) = fake.requests_to("POST", "/runs")
    assert isinstance(run, SubmittedRun)
    assert run.run_id in fake.runs
    assert run.url == f"{fake.host}/#/runs/details/{run.run_id}"
    assert run.state is None and run.error is None and not run_failed(run)
    compiled = next(yaml.safe_load_all(package.read_text()))
    assert created.body["pipeline_spec"] == compiled
    assert created.body["display_name"] == "first"
    assert created.body["experiment_id"] == run.experiment_id
    params = created.body["runtime_config"]["parameters"]
    assert params == {"name": "run-1", "steps": 50, "flag": True, "layers": [3, 4], "lr": 1e-4}
    assert type(params["steps"]) is int and type(params["lr"]) is float
    # No credentials were there to send; kfp's printed links went to the log, not stdout.
    assert "authorization" not in created.headers
    assert capsys.readouterr().out == ""


def test_health_check_at_construction_unless_a_namespace_is_given(
    fake: FakeKfpApi, package: Path
) -> None:
    submit_pipeline(str(package), host=fake.host, arguments={"name": "x"})
    assert [r.path for r in fake.requests][:1] == ["/apis/v2beta1/healthz"]

    fake.requests.clear()
    submit_pipeline(str(package), host=fake.host, arguments={"name": "x"}, namespace="team-a")
    assert fake.requests_to("GET", "/healthz") == []


def test_bearer_token_from_env_reaches_server_and_never_the_log(
    fake: FakeKfpApi,
    package: Path,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("KFP_TOKEN", TOKEN)
    # A service-account token file is there too: the environment variable wins.
    (tmp_path / "sa-token").write_text("file-token")
    monkeypatch.setenv("KF_PIPELINES_SA_TOKEN_PATH", str(tmp_path / "sa-token"))
    caplog.set_level(logging.DEBUG)
    fake.run_states = ["RUNNING", "SUCCEEDED"]
    run = submit_pipeline(
        str(package), host=fake.host, arguments={"name": "x"}, wait=True, poll_s=0.01, timeout_s=10
    )

    assert run.state == "SUCCEEDED"
    paths = {r.path for r in fake.requests}
    assert {
        "/apis/v2beta1/healthz",
        "/apis/v2beta1/experiments",
        "/apis/v2beta1/runs",
        f"/apis/v2beta1/runs/{run.run_id}",
    } <= paths
    for request in fake.requests:
        assert request.headers.get("authorization") == f"Bearer {TOKEN}", request.path
    assert caplog.records, "nothing was logged at all"
    assert TOKEN not in caplog.text
    out, err = capsys.readouterr()
    assert TOKEN not in out and TOKEN not in err


def test_token_env_name_is_configurable(
    fake: FakeKfpApi, package: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MY_KFP_TOKEN", TOKEN)
    submit_pipeline(str(package), host=fake.host, arguments={"name": "x"}, token_env="MY_KFP_TOKEN")
    (created,) = fake.requests_to("POST", "/runs")
    assert created.headers["authorization"] == f"Bearer {TOKEN}"


def test_service_account_token_file_reaches_server(
    fake: FakeKfpApi,
    package: Path,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("sa-token-from-file\n")
    monkeypatch.setenv("KF_PIPELINES_SA_TOKEN_PATH", str(token_file))
    monkeypatch.setenv("KFP_TOKEN", "")  # set but empty: not a token
    caplog.set_level(logging.DEBUG)
    submit_pipeline(str(package), host=fake.host, arguments={"name": "x"})
    (created,) = fake.requests_to("POST", "/runs")
    assert created.headers["authorization"] == "Bearer sa-token-from-file"
    # The file is read again before every request (the kubelet rotates it).
    token_file.write_text("rotated-token")
    submit_pipeline(str(package), host=fake.host, arguments={"name": "x"})
    assert fake.requests_to("POST", "/runs")[-1].headers["authorization"] == (
        "Bearer rotated-token"
    )
    assert "sa-token-from-file" not in caplog.text and "rotated-token" not in caplog.text


def test_wait_running_then_succeeded(fake: FakeKfpApi, package: Path) -> None:
    fake.run_states = ["RUNNING", "RUNNING", "SUCCEEDED"]
    run = submit_pipeline(
        str(package), host=fake.host, arguments={"name": "x"}, wait=True, poll_s=0.01, timeout_s=10
    )
    assert run.state == "SUCCEEDED" and run.error is None
    assert not run_failed(run)
    assert len(fake.requests_to("GET", f"/runs/{run.run_id}")) == 3


def test_wait_running_then_failed(
    fake: FakeKfpApi, package: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fake.run_states = ["PENDING", "RUNNING", "FAILED"]
    fake.run_error = "task train failed: exit code 1"
    run = submit_pipeline(
        str(package), host=fake.host, arguments={"name": "x"}, wait=True, poll_s=0.01
    )
    assert run.state == "FAILED"
    assert run.error == "task train failed: exit code 1"
    assert run_failed(run)
    assert "task train failed" in caplog.text


def test_wait_canceled_is_final(fake: FakeKfpApi, package: Path) -> None:
    fake.run_states = ["RUNNING", "CANCELING", "CANCELED"]
    run = submit_pipeline(
        str(package), host=fake.host, arguments={"name": "x"}, wait=True, poll_s=0.01, timeout_s=10
    )
    assert run.state == "CANCELED" and run_failed(run)


def test_wait_timeout_says_still_running_with_url(fake: FakeKfpApi, package: Path) -> None:
    fake.run_states = ["RUNNING"]
    start = time.monotonic()
    with pytest.raises(CrosskdError, match="still running") as caught:
        submit_pipeline(
            str(package),
            host=fake.host,
            arguments={"name": "x"},
            wait=True,
            poll_s=0.01,
            timeout_s=0.1,
        )
    assert time.monotonic() - start < 2
    (run_id,) = fake.runs
    assert f"{fake.host}/#/runs/details/{run_id}" in str(caught.value)
    assert "\n" not in str(caught.value)


def test_wait_retries_transient_errors_but_not_403(fake: FakeKfpApi, package: Path) -> None:
    fake.run_states = ["RUNNING", "SUCCEEDED"]
    fake.fail("GET", "/runs/*", 503, times=2)
    run = submit_pipeline(
        str(package), host=fake.host, arguments={"name": "x"}, wait=True, poll_s=0.01, timeout_s=10
    )
    assert run.state == "SUCCEEDED"

    fake.run_states = ["RUNNING"]
    fake.fail("GET", "/runs/*", 403, "token expired", times=1)
    with pytest.raises(CrosskdError, match=r"403 Forbidden on get run") as caught:
        submit_pipeline(
            str(package),
            host=fake.host,
            arguments={"name": "x"},
            wait=True,
            poll_s=0.01,
            timeout_s=10,
        )
    assert "keeps going: http://" in str(caught.value)


def test_unknown_argument_refused_before_any_request(fake: FakeKfpApi, package: Path) -> None:
    with pytest.raises(ConfigError, match=r"unknown pipeline argument.*stepz") as caught:
        submit_pipeline(str(package), host=fake.host, arguments={"name": "x", "stepz": 5})
    for known in ("flag", "layers", "lr", "name", "steps"):
        assert known in str(caught.value)
    assert fake.requests == []


def test_missing_required_argument_refused(fake: FakeKfpApi, package: Path) -> None:
    with pytest.raises(ConfigError, match=r"required pipeline argument.*name"):
        submit_pipeline(str(package), host=fake.host, arguments={"steps": 3})
    assert fake.requests == []


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("steps", "fifty"),
        ("steps", "2.5"),
        ("steps", True),
        ("flag", "maybe"),
        ("flag", 1),
        ("layers", "3,4"),
        ("lr", "fast"),
        ("lr", "nan"),
        ("name", 5),
    ],
)
def test_wrong_typed_value_refused(
    fake: FakeKfpApi, package: Path, key: str, value: object
) -> None:
    with pytest.raises(ConfigError, match=f"pipeline argument {key}="):
        submit_pipeline(str(package), host=fake.host, arguments={"name": "x", key: value})
    assert fake.requests == []


def test_native_values_pass_and_none_keeps_default(fake: FakeKfpApi, package: Path) -> None:
    submit_pipeline(
        str(package), host=fake.host, arguments={"name": "yes", "steps": 7, "lr": 2, "flag": None}
    )
    (created,) = fake.requests_to("POST", "/runs")
    # A STRING parameter is never read as YAML ("yes" stays a string); an int for a double
    # becomes a float; None leaves the compiled default.
    assert created.body["runtime_config"]["parameters"] == {"name": "yes", "steps": 7, "lr": 2.0}


@pytest.mark.parametrize("what", ["missing", "directory", "not-a-pipeline", "suffix"])
def test_bad_package_refused(fake: FakeKfpApi, tmp_path: Path, what: str) -> None:
    path = {
        "missing": tmp_path / "nope.yaml",
        "directory": tmp_path,
        "not-a-pipeline": tmp_path / "other.yaml",
        "suffix": tmp_path / "pipeline.json",
    }[what]
    if what == "not-a-pipeline":
        path.write_text("a: 1\n")
    if what == "suffix":
        path.write_text("{}")
    with pytest.raises(ConfigError, match="pipeline package") as caught:
        submit_pipeline(str(path), host=fake.host, arguments={})
    assert str(path) in str(caught.value)
    assert fake.requests == []


def test_403_on_run_creation(
    fake: FakeKfpApi,
    package: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setenv("KFP_TOKEN", TOKEN)
    fake.fail("POST", "/runs", 403, "RBAC: access denied")
    with pytest.raises(CrosskdError) as caught:
        submit_pipeline(str(package), host=fake.host, arguments={"name": "x"})
    message = str(caught.value)
    assert message.startswith(f"KFP at {fake.host}: 403 Forbidden on create run")
    assert "RBAC: access denied" in message and "check the token" in message
    assert "\n" not in message and "Traceback" not in message and TOKEN not in message
    assert caught.value.__cause__ is None and caught.value.__suppress_context__
    assert TOKEN not in caplog.text
    assert fake.runs == {}


def test_health_check_refused(
    fake: FakeKfpApi, package: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # kfp.Client retries its construction-time health check 5 times, 5 s apart (not skipped here).
    import kfp.client.client as kfp_client_module

    monkeypatch.setattr(kfp_client_module.time, "sleep", lambda s: None)
    fake.fail("GET", "/healthz", 401, "Jwt is missing", times=5)
    with pytest.raises(CrosskdError, match=r"health check failed .*5 attempts.*token") as caught:
        submit_pipeline(str(package), host=fake.host, arguments={"name": "x"})
    assert "\n" not in str(caught.value)
    assert len(fake.requests_to("GET", "/healthz")) == 5
    assert fake.requests_to("POST", "/runs") == []


def test_server_unreachable(package: Path) -> None:
    with FakeKfpApi() as api:
        host = api.host
    with pytest.raises(CrosskdError, match=r"cannot reach the server on health check") as caught:
        submit_pipeline(str(package), host=host, arguments={"name": "x"})
    assert host in str(caught.value) and "\n" not in str(caught.value)


def test_bad_host_refused(package: Path) -> None:
    with pytest.raises(ConfigError, match="scheme"):
        submit_pipeline(str(package), host="kubeflow.example.com", arguments={"name": "x"})


def test_experiment_created_when_absent_then_reused(fake: FakeKfpApi, package: Path) -> None:
    first = submit_pipeline(
        str(package), host=fake.host, arguments={"name": "x"}, experiment="distill"
    )
    assert [e["display_name"] for e in fake.experiments.values()] == ["distill"]
    assert len(fake.requests_to("POST", "/experiments")) == 1
    (listed,) = fake.requests_to("GET", "/experiments")
    assert '"stringValue": "distill"' in listed.query["filter"][0]

    second = submit_pipeline(
        str(package), host=fake.host, arguments={"name": "x"}, experiment="distill"
    )
    assert second.experiment_id == first.experiment_id
    assert len(fake.requests_to("POST", "/experiments")) == 1
    assert len(fake.runs) == 2


def test_existing_experiment_used(fake: FakeKfpApi, package: Path) -> None:
    existing = fake.add_experiment("crosskd")
    run = submit_pipeline(str(package), host=fake.host, arguments={"name": "x"})
    assert run.experiment_id == existing
    assert fake.requests_to("POST", "/experiments") == []


def test_namespace_passed_through(package: Path) -> None:
    with FakeKfpApi(multi_user=True) as fake:
        other = fake.add_experiment("crosskd", namespace="team-b")
        run = submit_pipeline(
            str(package), host=fake.host, arguments={"name": "x"}, namespace="team-a"
        )
        (listed,) = fake.requests_to("GET", "/experiments")
        assert listed.query["namespace"] == ["team-a"]
        (created_exp,) = fake.requests_to("POST", "/experiments")
        assert created_exp.body["namespace"] == "team-a"
        assert run.experiment_id != other
        assert fake.experiments[run.experiment_id]["namespace"] == "team-a"
        (created,) = fake.requests_to("POST", "/runs")
        assert created.body["experiment_id"] == run.experiment_id
        assert fake.errors == []


def test_import_does_not_need_kfp() -> None:
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['kfp'] = None; sys.modules['kfp_server_api'] = None; "
        "import crosskd.pipeline.submit"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
