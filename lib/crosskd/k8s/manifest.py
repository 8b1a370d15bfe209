"""The PyTorchJob the launcher submits: a manifest or an SDK model checked and turned into the
``KubeflowOrgV1PyTorchJob`` it creates, that job as the camelCase manifest it keeps as YAML, and
the checks every job kind shares (:func:`check_name`, :func:`dropped_keys`,
:func:`write_manifest`; the TrainJob's own are in :mod:`crosskd.k8s.trainjob_api`).

A manifest with fields the ``kubeflow.org/v1`` model does not know is refused (the SDK would
drop them silently), and so is a job without a fixed DNS-1035 name or one that names another
namespace than the one it is submitted to.
"""

from __future__ import annotations

import copy
import logging
import os
import re
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from kubeflow.training import KubeflowOrgV1PyTorchJob
from kubeflow.training.api_client import ApiClient as TrainingApiClient
from kubeflow.training.utils.utils import FakeResponse
from kubernetes.client import ApiClient

from crosskd.errors import ConfigError

logger = logging.getLogger(__name__)

_DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def to_manifest(job: Mapping[str, Any] | KubeflowOrgV1PyTorchJob) -> dict[str, Any]:
    """The camelCase manifest of ``job`` (``ApiClient().sanitize_for_serialization``), no Nones."""
    if isinstance(job, Mapping):
        return ApiClient().sanitize_for_serialization(dict(job))
    return ApiClient().sanitize_for_serialization(job)


def job_to_submit(
    job: Mapping[str, Any] | KubeflowOrgV1PyTorchJob, namespace: str
) -> KubeflowOrgV1PyTorchJob:
    """A copy of ``job`` as the SDK's model with ``metadata.namespace`` set to ``namespace``.

    Raises:
        ConfigError: ``job`` is not a ``kubeflow.org/v1`` PyTorchJob, has fields the model would
            drop, has no DNS-1035 ``metadata.name`` (at most 63 characters) or names another
            namespace.
    """
    model = _as_model(job)
    meta = model.metadata
    named = meta.namespace if meta else None
    check_name("PyTorchJob", meta.name if meta else None, named, namespace)
    model.metadata.namespace = namespace
    return model


def check_name(kind: str, name: str | None, named: str | None, namespace: str) -> None:
    """Refuse a job of ``kind`` without a DNS-1035 ``metadata.name`` ``name`` (at most 63
    characters), or whose ``metadata.namespace`` ``named`` is not ``namespace``.

    Raises:
        ConfigError: Naming the job, what is wrong and what to do.
    """
    if not name:
        raise ConfigError(f"the {kind} has no metadata.name; the launcher needs a fixed one.")
    if len(name) > 63 or not _DNS1035_LABEL.match(name):
        raise ConfigError(
            f"the {kind} name {name!r} is not a DNS-1035 label (lower-case letters, digits "
            "and '-', starting with a letter, at most 63 characters)."
        )
    if named and named != namespace:
        raise ConfigError(
            f"the {kind} {name} names namespace {named!r} but is submitted to {namespace!r}; "
            "drop metadata.namespace or make them agree."
        )


def write_manifest(path: str | os.PathLike[str], manifest: Mapping[str, Any]) -> Path:
    """Write ``manifest`` (a job as :func:`to_manifest` gives it) as YAML to ``path``
    atomically; returns the path."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    text = yaml.safe_dump(dict(manifest), sort_keys=False, default_flow_style=False)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    meta = manifest["metadata"]
    logger.info(
        "%s %s/%s: manifest kept in %s", manifest["kind"], meta["namespace"], meta["name"], target
    )
    return target


def _as_model(job: Mapping[str, Any] | KubeflowOrgV1PyTorchJob) -> KubeflowOrgV1PyTorchJob:
    """``job`` as the SDK's model; a manifest whose fields the model would drop is refused."""
    if isinstance(job, KubeflowOrgV1PyTorchJob):
        return copy.deepcopy(job)  # the launcher sets metadata.namespace on its own copy
    if not isinstance(job, Mapping):
        raise ConfigError(
            f"the job to submit is a {type(job).__name__}; give a PyTorchJob manifest (a dict) "
            "or a kubeflow.training KubeflowOrgV1PyTorchJob."
        )
    if job.get("apiVersion") != "kubeflow.org/v1" or job.get("kind") != "PyTorchJob":
        raise ConfigError(
            f"the job to submit has apiVersion {job.get('apiVersion')!r} and kind "
            f"{job.get('kind')!r}; the launcher submits kubeflow.org/v1 PyTorchJob only."
        )
    body = {key: value for key, value in job.items() if key != "status"}
    try:
        model = TrainingApiClient().deserialize(FakeResponse(body), "KubeflowOrgV1PyTorchJob")
    except ValueError as exc:  # a required field is missing (spec.pytorchReplicaSpecs, ...)
        raise ConfigError(f"the PyTorchJob manifest is incomplete: {exc}") from exc
    dropped = dropped_keys(body, to_manifest(model))
    if dropped:
        raise ConfigError(
            "the PyTorchJob manifest has fields the kubeflow.org/v1 model does not know, which "
            f"would be dropped on submission: {', '.join(dropped[:10])}; fix their spelling."
        )
    return model


def dropped_keys(given: Any, kept: Any, path: str = "") -> list[str]:
    """The key paths of ``given`` (a manifest) that are missing from ``kept`` (its round trip)."""
    out: list[str] = []
    if isinstance(given, Mapping):
        kept_map = kept if isinstance(kept, Mapping) else {}
        for key, value in given.items():
            where = f"{path}.{key}" if path else str(key)
            if value is None:
                continue
            if key not in kept_map:
                out.append(where)
            # Free-form maps (labels, limits, ...) round-trip by construction.
            else:
                out.extend(dropped_keys(value, kept_map[key], where))
    elif isinstance(given, list) and isinstance(kept, list):
        for index, (item, kept_item) in enumerate(zip(given, kept, strict=False)):
            out.extend(dropped_keys(item, kept_item, f"{path}[{index}]"))
    return out
