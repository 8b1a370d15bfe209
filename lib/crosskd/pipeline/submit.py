"""Submit a compiled Kubeflow Pipelines (KFP v2) pipeline to a cluster and, if asked, wait for it.

:func:`submit_pipeline` is what ``crosskd pipeline submit`` calls. Its contract:

* **The package** is a compiled pipeline YAML file (``kfp.compiler.Compiler().compile``); the
  first YAML document is the ``PipelineSpec``, a second one (``kfp-kubernetes``) the platform
  spec. It is read before the server is contacted.
* **Arguments are checked before the server is contacted.** Keys must be input parameters of
  the pipeline (``root.inputDefinitions.parameters``); parameters without a default must be
  given; ``None`` values are dropped (the parameter keeps its compiled default). Strings given
  for ``NUMBER_INTEGER``/``NUMBER_DOUBLE``/``BOOLEAN``/``LIST``/``STRUCT`` parameters are read as
  YAML, so ``steps=50`` from a command line becomes ``50`` and ``layers=[1, 2]`` a list; a
  ``NUMBER_DOUBLE`` string that YAML leaves a string (``1e-4``) is read by ``float``. A value of
  the wrong type is refused. Every refusal is a :class:`~crosskd.errors.ConfigError`.
* **Authentication** as multi-user Kubeflow expects: a bearer token from the environment
  variable ``token_env`` (``KFP_TOKEN``) when it is set and not empty, else the projected
  service-account token file (``$KF_PIPELINES_SA_TOKEN_PATH``, default
  ``/var/run/secrets/kubeflow/pipelines/token``) when it exists, re-read on every request so
  the kubelet's rotation is followed, else no credentials (a port-forwarded single-user KFP).
  The token is never an argument and never logged.
* **Submission** gets or creates the experiment (``kfp.Client.create_experiment``, which looks
  the name up in ``namespace`` first), then creates the run with
  ``kfp.Client.create_run_from_pipeline_package`` (the spec inline, no pipeline upload). The two
  steps are separate calls so that an HTTP error names the step it came from.
* **Waiting** (``wait=True``) polls the run every ``poll_s`` seconds until it reaches a final
  state (``SUCCEEDED``, ``FAILED``, ``SKIPPED``, ``CANCELED``). Our own loop rather than
  ``kfp.Client.wait_for_run_completion``: that one does not treat ``CANCELED`` as final, and on a
  401 it tries to refresh a Google Cloud token. Transient errors while polling (5xx, 429, a
  broken connection) are logged and retried at the next poll, up to ``_MAX_POLL_ERRORS`` in a
  row; ``timeout_s`` bounds the whole wait and raises :class:`~crosskd.errors.CrosskdError`
  saying the run still runs (the run is left alone). :func:`run_failed` tells the caller to exit
  non-zero.
* **Errors.** A refused connection or an HTTP error becomes a one-line
  :class:`~crosskd.errors.CrosskdError` naming the host, the status and the step, e.g.
  ``KFP at https://kf.example.com/pipeline: 403 Forbidden on create run (...); check ...``.

``kfp`` is imported inside the functions, so importing this module needs only PyYAML. The client
prints the experiment and run links to stdout; that output is captured and logged instead.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import os
import re
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import urllib3
import yaml

from crosskd.errors import ConfigError, CrosskdError

if TYPE_CHECKING:
    import kfp

logger = logging.getLogger(__name__)

#: States after which a KFP v2 run changes no more (``V2beta1RuntimeState``).
FINAL_STATES = frozenset({"SUCCEEDED", "FAILED", "SKIPPED", "CANCELED"})
#: Transient errors in a row tolerated while waiting for a run.
_MAX_POLL_ERRORS = 10
_TYPE_WORDS = {
    "NUMBER_INTEGER": "an integer",
    "NUMBER_DOUBLE": "a number",
    "BOOLEAN": "a boolean (true/false)",
    "STRING": "a string",
    "LIST": "a list, e.g. [a, b]",
    "STRUCT": "a mapping, e.g. {key: value}",
}


@dataclass
class SubmittedRun:
    """A run created on a KFP server.

    Attributes:
        run_id: The run's id (a UUID).
        url: The run's page in the KFP UI, ``{host}/#/runs/details/{run_id}``.
        experiment_id: The id of the experiment the run belongs to.
        state: The final state (``SUCCEEDED``, ``FAILED``, ``SKIPPED``, ``CANCELED``) when the run
            was waited for, else ``None``.
        error: The run's error message when it reported one (a failed run), else ``None``.
    """

    run_id: str
    url: str
    experiment_id: str
    state: str | None = None
    error: str | None = None


def run_failed(run: SubmittedRun) -> bool:
    """Whether a waited-for run ended in any state but ``SUCCEEDED`` (``False`` if not waited)."""
    return run.state is not None and run.state != "SUCCEEDED"


def submit_pipeline(
    package: str,
    *,
    host: str,
    arguments: Mapping[str, object],
    namespace: str | None = None,
    experiment: str = "crosskd",
    run_name: str | None = None,
    wait: bool = False,
    timeout_s: float | None = None,
    poll_s: float = 5.0,
    token_env: str = "KFP_TOKEN",
    enable_caching: bool | None = None,
) -> SubmittedRun:
    """Create a run of the compiled pipeline ``package`` on the KFP server at ``host``.

    Args:
        package: Path of the compiled pipeline YAML file.
        host: Base URL of the KFP API, with its scheme (``http://localhost:8888``, or
            ``https://kubeflow.example.com/pipeline`` behind the Kubeflow gateway); the UI is
            assumed at the same URL.
        arguments: Pipeline parameters by name; strings are converted to the parameter's type
            (see the module docstring), ``None`` values are dropped.
        namespace: Kubeflow profile namespace of the experiment (multi-user KFP); ``None`` lets
            the client decide (single-user KFP, or the client's context).
        experiment: Experiment name; created in ``namespace`` when absent.
        run_name: Display name of the run; ``None`` lets kfp name it after the package file and
            the current time.
        wait: Wait until the run reaches a final state.
        timeout_s: Bound of the whole wait, in seconds; ``None`` waits as long as it takes.
        poll_s: Seconds between two reads of the run while waiting.
        token_env: Name of the environment variable holding a bearer token.
        enable_caching: False runs every step again (KFP's cache off for this run); None keeps
            each task's compiled setting.

    Returns:
        The run, with its final state and error message when ``wait`` is true.

    Raises:
        ConfigError: A missing or malformed package, unknown, missing or ill-typed arguments,
            a bad host, timeout or poll interval (nothing was sent to the server).
        CrosskdError: The server could not be reached or answered an error, or the wait timed
            out (the run keeps running).
    """
    path = _check_package(package)
    host = _check_host(host)
    if not poll_s > 0:
        raise ConfigError(f"poll_s must be a positive number of seconds, not {poll_s!r}")
    if timeout_s is not None and not timeout_s > 0:
        raise ConfigError(
            f"timeout_s must be a positive number of seconds or None (no limit), not {timeout_s!r}"
        )
    parameters = pipeline_parameters(path)
    values = convert_arguments(parameters, arguments, package=str(path))

    client = _client(host, namespace=namespace, token_env=token_env)
    with _calls(host, "get or create experiment"):
        exp = client.create_experiment(name=experiment, namespace=namespace)
    with _calls(host, "create run"):
        result = client.create_run_from_pipeline_package(
            str(path),
            arguments=values,
            run_name=run_name,
            experiment_id=exp.experiment_id,
            namespace=namespace,
            enable_caching=enable_caching,
        )
    run = SubmittedRun(
        run_id=result.run_id,
        url=f"{host}/#/runs/details/{result.run_id}",
        experiment_id=exp.experiment_id,
    )
    logger.info(
        "submitted run %s of %s in experiment %r: %s", run.run_id, path.name, experiment, run.url
    )
    if not wait:
        return run
    final = _wait(client, host, run, timeout_s=timeout_s, poll_s=poll_s)
    run.state = str(final.state).upper()
    error = getattr(final, "error", None)
    run.error = (getattr(error, "message", None) or None) if error is not None else None
    log = logger.info if run.state == "SUCCEEDED" else logger.error
    log(
        "run %s ended %s%s: %s",
        run.run_id,
        run.state,
        f" ({run.error})" if run.error else "",
        run.url,
    )
    return run


def pipeline_parameters(package: str | os.PathLike[str]) -> dict[str, dict[str, Any]]:
    """The input parameters of a compiled pipeline: name -> its ``inputDefinitions`` entry.

    Each entry has ``parameterType`` and, for an optional parameter, ``defaultValue`` and/or
    ``isOptional``. Raises :class:`ConfigError` when the file is not a compiled pipeline.
    """
    path = Path(package)
    try:
        with path.open(encoding="utf-8") as f:
            spec = next(iter(yaml.safe_load_all(f)), None)
    except OSError as e:
        raise ConfigError(
            f"pipeline package {path}: cannot read it ({e.strerror or e}); give the path of a "
            "compiled pipeline YAML file (kfp.compiler.Compiler().compile(...))"
        ) from None
    except yaml.YAMLError as e:
        raise ConfigError(
            f"pipeline package {path}: not valid YAML ({_one_line(e)}); compile the pipeline "
            "again with kfp.compiler.Compiler().compile(...)"
        ) from None
    root = spec.get("root") if isinstance(spec, dict) else None
    if not isinstance(root, dict) or "pipelineInfo" not in spec:
        raise ConfigError(
            f"pipeline package {path}: not a compiled KFP pipeline (no root/pipelineInfo in its "
            "first YAML document); compile it with kfp.compiler.Compiler().compile(...)"
        )
    params = (root.get("inputDefinitions") or {}).get("parameters") or {}
    return {name: dict(entry or {}) for name, entry in params.items()}


def convert_arguments(
    parameters: Mapping[str, Mapping[str, Any]],
    arguments: Mapping[str, object],
    *,
    package: str = "the pipeline",
) -> dict[str, object]:
    """Check ``arguments`` against the pipeline's ``parameters`` and convert them to their types.

    Args:
        parameters: As returned by :func:`pipeline_parameters`.
        arguments: Values by parameter name; ``None`` values are dropped.
        package: How to name the pipeline in messages.

    Returns:
        The values to send, typed as the parameters declare.

    Raises:
        ConfigError: An unknown parameter, a missing required one, or a value of the wrong type.
    """
    known = sorted(parameters)
    unknown = sorted(k for k in arguments if k not in parameters)
    if unknown:
        raise ConfigError(
            f"{package}: unknown pipeline argument(s) {', '.join(unknown)}; its parameters are "
            f"{', '.join(known) if known else '(none)'}"
        )
    values: dict[str, object] = {}
    for name, value in arguments.items():
        if value is None:
            continue
        kind = str(parameters[name].get("parameterType", ""))
        values[name] = _convert(name, kind, value, package)
    missing = [
        name
        for name in known
        if name not in values
        and "defaultValue" not in parameters[name]
        and not parameters[name].get("isOptional", False)
    ]
    if missing:
        raise ConfigError(
            f"{package}: required pipeline argument(s) {', '.join(missing)} not given; "
            "pass them as NAME=VALUE"
        )
    return values


def _convert(name: str, kind: str, value: object, package: str) -> object:
    """``value`` as the parameter type ``kind`` wants it, or a :class:`ConfigError`."""
    given = value
    if isinstance(value, str) and kind in _TYPE_WORDS and kind != "STRING":
        with contextlib.suppress(yaml.YAMLError):  # left a string: refused below
            value = yaml.safe_load(value) if value.strip() else value
        if kind == "NUMBER_DOUBLE" and isinstance(value, str):
            with contextlib.suppress(ValueError):
                value = float(value)
    ok: bool
    if kind == "NUMBER_INTEGER":
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind == "NUMBER_DOUBLE":
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if ok:
            value = float(value)  # type: ignore[arg-type]
            ok = math.isfinite(value)
    elif kind == "BOOLEAN":
        ok = isinstance(value, bool)
    elif kind == "STRING":
        ok = isinstance(value, str)
    elif kind == "LIST":
        ok = isinstance(value, list)
    elif kind == "STRUCT":
        ok = isinstance(value, dict)
    else:  # a type this module does not know: passed as given
        return value
    if ok and kind in ("LIST", "STRUCT"):
        try:
            json.dumps(value, allow_nan=False)
        except (TypeError, ValueError):
            ok = False
    if not ok:
        raise ConfigError(
            f"{package}: pipeline argument {name}={given!r} is not {_TYPE_WORDS[kind]} "
            f"(parameter type {kind})"
        )
    return value


def _check_package(package: str) -> Path:
    path = Path(package)
    if not path.is_file() or not os.access(path, os.R_OK):
        what = (
            "does not exist"
            if not path.exists()
            else ("is not a file" if not path.is_file() else "is not readable")
        )
        raise ConfigError(
            f"pipeline package {path} {what}; give the path of a compiled pipeline YAML file "
            "(kfp.compiler.Compiler().compile(pipeline, 'pipeline.yaml'))"
        )
    if path.suffix.lower() not in (".yaml", ".yml"):
        raise ConfigError(
            f"pipeline package {path}: kfp reads only .yaml/.yml files here; give the compiled "
            "pipeline YAML file"
        )
    return path


def _check_host(host: str) -> str:
    host = (host or "").strip().rstrip("/")
    if not re.match(r"^https?://[^/\s]+", host):
        raise ConfigError(
            f"KFP host {host!r} must be a URL with its scheme, e.g. http://localhost:8888 (a "
            "port-forwarded ml-pipeline-ui) or https://kubeflow.example.com/pipeline"
        )
    return host


def _credentials(token_env: str) -> dict[str, Any]:
    """The authentication keyword arguments of ``kfp.Client`` (never logs the token)."""
    # lazy: kfp is an optional extra (crosskd[kfp]): this module imports without it
    # (tests/test_pipeline_submit.py)
    from kfp import client as kfp_client

    token = os.environ.get(token_env, "").strip()
    if token:
        logger.debug("authenticating to KFP with the bearer token in $%s", token_env)
        return {"existing_token": token}
    token_file = (
        os.environ.get(kfp_client.KF_PIPELINES_SA_TOKEN_ENV)
        or kfp_client.KF_PIPELINES_SA_TOKEN_PATH
    )
    if os.path.isfile(token_file):
        logger.debug("authenticating to KFP with the service-account token file %s", token_file)
        # path=None: kfp resolves $KF_PIPELINES_SA_TOKEN_PATH or the default, as checked here,
        # and re-reads the file before every request.
        return {"credentials": kfp_client.ServiceAccountTokenVolumeCredentials(path=None)}
    logger.debug(
        "no $%s and no token file %s: contacting KFP without credentials", token_env, token_file
    )
    return {}


def _client(host: str, *, namespace: str | None, token_env: str) -> kfp.Client:
    """A ``kfp.Client`` for ``host`` (construction may call the health check)."""
    # lazy: kfp is an optional extra (crosskd[kfp]): this module imports without it
    # (tests/test_pipeline_submit.py)
    import kfp

    kwargs: dict[str, Any] = {"host": host, **_credentials(token_env)}
    if namespace:
        # A namespace given here also spares the health check kfp makes at construction,
        # which retries 5 times 5 s apart on an HTTP error.
        kwargs["namespace"] = namespace
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="This client only works with Kubeflow", category=FutureWarning
        )
        with _calls(host, "health check"):
            return kfp.Client(**kwargs)


@contextlib.contextmanager
def _calls(host: str, step: str, url: str | None = None):
    """Turn what the client raises while doing ``step`` into a one-line CrosskdError.

    What the client prints (the experiment and run links) is logged instead.
    """
    # lazy: kfp_server_api comes with kfp, an optional extra (crosskd[kfp]): this module imports
    # without it
    import kfp_server_api

    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            yield
    except kfp_server_api.ApiException as e:
        raise CrosskdError(_http_message(host, step, e, url)) from None
    except urllib3.exceptions.HTTPError as e:
        raise CrosskdError(
            f"KFP at {host}: cannot reach the server on {step} ({_reason(e)}); check the host "
            "URL and that the KFP API is reachable (e.g. kubectl port-forward "
            f"svc/ml-pipeline-ui 8080:80){_still(url)}"
        ) from None
    except TimeoutError as e:  # the health check's 5 failed attempts
        raise CrosskdError(
            f"KFP at {host}: {step} failed ({_one_line(e)}); check the host URL and the token"
            f"{_still(url)}"
        ) from None
    except ValueError as e:  # kfp's own refusals, e.g. two experiments of the same name
        raise CrosskdError(f"KFP at {host}: {step}: {_one_line(e)}{_still(url)}") from None
    finally:
        for line in printed.getvalue().splitlines():
            if line.strip():
                logger.info("kfp: %s", line.strip())


def _http_message(host: str, step: str, e: Any, url: str | None) -> str:
    status = getattr(e, "status", None)
    reason = getattr(e, "reason", None) or ""
    if not status:  # kfp_server_api raises status 0 for TLS errors
        return (
            f"KFP at {host}: {step} failed ({_one_line(reason) or 'TLS error'}); check the "
            f"host URL and its certificate{_still(url)}"
        )
    detail = _server_message(getattr(e, "body", None))
    if detail == _one_line(reason):
        detail = ""
    hints = {
        401: "check the bearer token (its environment variable, KFP_TOKEN by default, or the "
        "service-account token file)",
        403: "check the token and that its identity may use the namespace (a Kubeflow "
        "profile contributor)",
        404: "check the host URL (the KFP API, e.g. https://kubeflow.example.com/pipeline)",
    }
    hint = hints.get(status) or (
        "the server failed; retry later or read the ml-pipeline logs"
        if status >= 500
        else "the server refused the request"
    )
    return (
        f"KFP at {host}: {status} {_one_line(reason)} on {step}"
        f"{f' ({detail})' if detail else ''}; {hint}{_still(url)}"
    )


def _server_message(body: Any) -> str:
    """The ``message`` of a grpc-gateway error body, one line and short ('' when none)."""
    if isinstance(body, bytes):
        body = body.decode("utf-8", "replace")
    if not isinstance(body, str) or not body.strip():
        return ""
    try:
        parsed = json.loads(body)
    except ValueError:
        text = body if not body.lstrip().startswith("<") else ""  # an HTML error page
    else:
        text = (
            str(parsed.get("message") or parsed.get("error") or "")
            if isinstance(parsed, dict)
            else ""
        )
    return _one_line(text)[:200]


def _reason(e: Any) -> str:
    reason = getattr(e, "reason", None) or e
    # urllib3 writes '<urllib3.connection.HTTPConnection object at 0x..>: Failed to ...'
    return re.sub(r"^<[^>]*>:\s*", "", _one_line(reason))[:200]


def _one_line(value: object) -> str:
    return " ".join(str(value).split())


def _still(url: str | None) -> str:
    return f"; the run was submitted and keeps going: {url}" if url else ""


def _wait(
    client: kfp.Client, host: str, run: SubmittedRun, *, timeout_s: float | None, poll_s: float
) -> Any:
    """Poll ``run`` every ``poll_s`` s until it reaches a final state or ``timeout_s`` s pass."""
    # lazy: kfp_server_api comes with kfp, an optional extra (crosskd[kfp]): this module imports
    # without it
    import kfp_server_api

    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    errors = 0
    state: str | None = None
    while True:
        try:
            with _calls(host, "get run", run.url):
                current = client.get_run(run.run_id)
        except CrosskdError as e:
            cause = e.__context__
            transient = isinstance(cause, urllib3.exceptions.HTTPError) or (
                isinstance(cause, kfp_server_api.ApiException)
                and (cause.status == 429 or (cause.status or 0) >= 500)
            )
            errors += 1
            if not transient or errors > _MAX_POLL_ERRORS:
                raise
            logger.warning("reading run %s failed (%s); retrying", run.run_id, e)
        else:
            errors = 0
            state = str(current.state).upper() if current.state else None
            if state in FINAL_STATES:
                return current
            logger.debug("run %s is %s", run.run_id, state)
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            raise CrosskdError(
                f"KFP at {host}: run {run.run_id} is still running ({state or 'state unknown'}) "
                f"after {timeout_s:g} s; it was left running: {run.url}"
            )
        time.sleep(poll_s if deadline is None else min(poll_s, deadline - now))
