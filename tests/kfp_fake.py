"""FakeKfpApi, a fake KFP v2beta1 REST API (a fake: speaks only the subset the client uses).

It is **not** a KFP server and runs nothing: an ``http.server`` on 127.0.0.1 (one thread per
request) that keeps experiments and runs in memory and answers, with the JSON the real API server
(grpc-gateway, original proto field names) sends and ``kfp_server_api``'s models read, exactly
the requests ``kfp.Client`` (kfp 2.17) makes for a submission:

* ``GET /apis/v2beta1/healthz`` -> ``{"multi_user": ..., "pipeline_store": "database"}`` (the
  client calls it at construction unless it was given a namespace or has one in its context),
* ``GET /apis/v2beta1/experiments?filter=...&namespace=...`` -> ``{"experiments": [...],
  "total_size": n, "next_page_token": ""}``; the filter is the JSON ``Filter`` the client sends
  (``EQUALS`` on ``display_name``, operation as the enum number or name), anything else is 400;
  in multi-user mode a request without ``namespace`` is 400, as the real server answers,
* ``POST /apis/v2beta1/experiments`` (a ``V2beta1Experiment``) -> the experiment with an id,
* ``POST /apis/v2beta1/runs`` (a ``V2beta1Run`` with an inline ``pipeline_spec`` and
  ``runtime_config.parameters``) -> the run, state ``PENDING``; an unknown ``experiment_id`` is
  404, a run without ``pipeline_spec`` or ``pipeline_version_reference`` 400,
* ``GET /apis/v2beta1/runs/{run_id}`` -> the run, its state taken from :attr:`run_states`.

Errors are grpc-gateway bodies (``{"error", "code", "message", "details"}``, ``code`` the gRPC
code). Every request is recorded in :attr:`FakeKfpApi.requests` (method, path, query, headers
with lower-case names, JSON body) *before* it is answered, refused ones included.

The test drives the runs: :attr:`run_states` lists the states successive ``GET``\\ s of a run
report (the last one repeats; each run walks the list on its own) and :attr:`run_error` the
error message a ``FAILED`` run carries; :meth:`fail` makes the next matching requests answer an
HTTP error; :meth:`add_experiment` makes an experiment exist beforehand. Anything that goes wrong
in the server thread is recorded in :attr:`errors`.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import threading
import uuid
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

API = "/apis/v2beta1"
# HTTP status -> the gRPC code grpc-gateway maps to it.
_GRPC_CODES = {400: 3, 401: 16, 403: 7, 404: 5, 409: 6, 429: 8, 500: 13, 501: 12, 503: 14, 504: 4}
_EQUALS = (1, "EQUALS")


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclasses.dataclass
class Request:
    """One request as the fake received it."""

    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]  # names in lower case
    body: Any  # the parsed JSON body, None when there was none


@dataclasses.dataclass
class _Failure:
    method: str
    path: str
    status: int
    message: str
    times: int


class _Reply(Exception):
    """An HTTP answer other than 200, raised by a route."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class FakeKfpApi:
    """A fake KFP v2beta1 API on ``http://127.0.0.1:<random port>``; a context manager.

    Args:
        multi_user: What the health check reports; in multi-user mode experiments must be
            listed with a namespace.
    """

    def __init__(self, *, multi_user: bool = False) -> None:
        self.multi_user = multi_user
        self.requests: list[Request] = []
        self.errors: list[str] = []
        self.experiments: dict[str, dict[str, Any]] = {}
        self.runs: dict[str, dict[str, Any]] = {}
        #: States reported by successive GETs of a run; the last one repeats.
        self.run_states: list[str] = ["RUNNING"]
        #: The error message of a run whose reported state is FAILED.
        self.run_error: str | None = None
        self._gets: dict[str, int] = {}
        self._failures: list[_Failure] = []
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    # -- lifecycle -------------------------------------------------------------------------

    @property
    def host(self) -> str:
        """The base URL to give ``kfp.Client(host=...)``."""
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> FakeKfpApi:
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()
        return self

    def close(self) -> None:
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join(timeout=5)
            self._thread = None
        self._server.server_close()

    def __enter__(self) -> FakeKfpApi:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- what a test sets up and reads -----------------------------------------------------

    def add_experiment(self, name: str, namespace: str | None = None) -> str:
        """Make an experiment exist, as if created earlier; returns its id."""
        with self._lock:
            return self._create_experiment({"display_name": name, "namespace": namespace})[
                "experiment_id"
            ]

    def fail(self, method: str, path: str, status: int, message: str = "", times: int = 1) -> None:
        """Answer the next ``times`` requests ``method path`` (path under ``/apis/v2beta1``,
        e.g. ``/runs``; a trailing ``*`` matches any rest) with HTTP ``status``."""
        with self._lock:
            self._failures.append(
                _Failure(
                    method.upper(), API + path, status, message or HTTPStatus(status).phrase, times
                )
            )

    def requests_to(self, method: str, path: str) -> list[Request]:
        """The recorded requests ``method path`` (path under ``/apis/v2beta1``; ``*`` at the
        end matches any rest)."""
        with self._lock:
            return [
                r
                for r in self.requests
                if r.method == method.upper() and _matches(API + path, r.path)
            ]

    # -- the API ---------------------------------------------------------------------------

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            # Headers and body go out in two writes: without this, delayed ACKs add ~40 ms.
            disable_nagle_algorithm = True

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                self._serve("GET")

            def do_POST(self) -> None:
                self._serve("POST")

            def do_DELETE(self) -> None:
                self._serve("DELETE")

            def _serve(self, method: str) -> None:
                try:
                    status, payload = fake._answer(method, self)
                except Exception as e:  # a bug in the fake: recorded, answered 500
                    fake.errors.append(f"{method} {self.path}: {type(e).__name__}: {e}")
                    status, payload = 500, _error_body(500, f"fake: {e}")
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        return Handler

    def _answer(self, method: str, req: BaseHTTPRequestHandler) -> tuple[int, Any]:
        url = urlsplit(req.path)
        length = int(req.headers.get("Content-Length") or 0)
        raw = req.rfile.read(length) if length else b""
        body = None
        if raw:
            try:
                body = json.loads(raw)
            except ValueError:
                body = raw.decode("utf-8", "replace")
        with self._lock:
            self.requests.append(
                Request(
                    method=method,
                    path=url.path,
                    query=parse_qs(url.query),
                    headers={k.lower(): v for k, v in req.headers.items()},
                    body=body,
                )
            )
            for failure in self._failures:
                if (
                    failure.times > 0
                    and failure.method == method
                    and _matches(failure.path, url.path)
                ):
                    failure.times -= 1
                    return failure.status, _error_body(failure.status, failure.message)
            try:
                return 200, self._route(method, url.path, parse_qs(url.query), body)
            except _Reply as r:
                return r.status, _error_body(r.status, r.message)

    def _route(self, method: str, path: str, query: dict[str, list[str]], body: Any) -> Any:
        if path == f"{API}/healthz" and method == "GET":
            return {"multi_user": self.multi_user, "pipeline_store": "database"}
        if path == f"{API}/experiments" and method == "GET":
            return self._list_experiments(query)
        if path == f"{API}/experiments" and method == "POST":
            if not isinstance(body, dict) or not body.get("display_name"):
                raise _Reply(400, "Invalid input error: Experiment name is empty")
            if self.multi_user and not body.get("namespace"):
                raise _Reply(
                    400,
                    "Invalid input error: In multi-user mode, experiment "
                    "namespace must be specified",
                )
            return self._create_experiment(body)
        if path.startswith(f"{API}/experiments/") and method == "GET":
            found = self.experiments.get(path.rsplit("/", 1)[1])
            if found is None:
                raise _Reply(404, "Experiment not found")
            return found
        if path == f"{API}/runs" and method == "POST":
            return self._create_run(body)
        if path.startswith(f"{API}/runs/") and method == "GET":
            return self._get_run(path.rsplit("/", 1)[1])
        raise _Reply(404, "Not Found")

    def _list_experiments(self, query: dict[str, list[str]]) -> dict[str, Any]:
        namespace = (query.get("namespace") or [""])[0]
        if self.multi_user and not namespace:
            raise _Reply(
                400,
                "Invalid input error: In multi-user mode, ListExperiment "
                "requires filtering by namespace",
            )
        name = None
        if "filter" in query:
            try:
                predicates = json.loads(query["filter"][0])["predicates"]
                (predicate,) = predicates
                assert predicate["key"] in ("display_name", "name")
                assert predicate["operation"] in _EQUALS
                name = predicate.get("stringValue", predicate.get("string_value"))
            except (ValueError, KeyError, TypeError, AssertionError) as e:
                raise _Reply(400, f"fake: unsupported filter {query['filter'][0]!r}") from e
        found = [
            e
            for e in self.experiments.values()
            if (name is None or e["display_name"] == name)
            and (not namespace or e["namespace"] == namespace)
        ]
        return {"experiments": found, "total_size": len(found), "next_page_token": ""}

    def _create_experiment(self, body: dict[str, Any]) -> dict[str, Any]:
        experiment = {
            "experiment_id": str(uuid.uuid4()),
            "display_name": body["display_name"],
            "description": body.get("description") or "",
            "created_at": _now(),
            "namespace": body.get("namespace") or "",
            "storage_state": "AVAILABLE",
            "last_run_created_at": "1970-01-01T00:00:00Z",
        }
        self.experiments[experiment["experiment_id"]] = experiment
        return experiment

    def _create_run(self, body: Any) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise _Reply(400, "Invalid input error: the body is not a run")
        if not body.get("pipeline_spec") and not body.get("pipeline_version_reference"):
            raise _Reply(
                400,
                "Invalid input error: a run needs a pipeline_spec or a pipeline_version_reference",
            )
        experiment_id = body.get("experiment_id")
        if experiment_id and experiment_id not in self.experiments:
            raise _Reply(404, f"Failed to create a run: experiment {experiment_id} not found")
        run = {
            "experiment_id": experiment_id or "",
            "run_id": str(uuid.uuid4()),
            "display_name": body.get("display_name") or "",
            "storage_state": "AVAILABLE",
            "description": body.get("description") or "",
            "pipeline_spec": body.get("pipeline_spec"),
            "runtime_config": body.get("runtime_config") or {},
            "service_account": body.get("service_account") or "pipeline-runner",
            "created_at": _now(),
            "scheduled_at": _now(),
            "finished_at": "1970-01-01T00:00:00Z",
            "state": "PENDING",
            "state_history": [{"update_time": _now(), "state": "PENDING"}],
        }
        self.runs[run["run_id"]] = run
        self._gets[run["run_id"]] = 0
        return run

    def _get_run(self, run_id: str) -> dict[str, Any]:
        run = self.runs.get(run_id)
        if run is None:
            raise _Reply(404, f"Failed to get run: run {run_id} not found")
        index = min(self._gets[run_id], len(self.run_states) - 1)
        self._gets[run_id] += 1
        state = self.run_states[index]
        if state != run["state"]:
            run["state"] = state
            run["state_history"].append({"update_time": _now(), "state": state})
            if state in ("SUCCEEDED", "FAILED", "SKIPPED", "CANCELED"):
                run["finished_at"] = _now()
        if state == "FAILED" and self.run_error:
            run["error"] = {"code": 2, "message": self.run_error, "details": []}
        return run


def _matches(pattern: str, path: str) -> bool:
    return path.startswith(pattern[:-1]) if pattern.endswith("*") else path == pattern


def _error_body(status: int, message: str) -> dict[str, Any]:
    code = _GRPC_CODES.get(status, 2)
    return {"error": message, "code": code, "message": message, "details": []}
