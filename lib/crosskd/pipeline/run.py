"""Compiling the pipeline and running it locally.

The pipeline's source (``pipelines/distill.py`` and ``components/``) lives in the repository,
not in the installed package: :func:`source_root` finds the checkout this package runs from (an
editable install) or the current directory. :func:`preset_arguments` turns a run config (a
preset) into the pipeline's parameters; :func:`run_local` runs the whole DAG under
``kfp.local`` (each step a subprocess of this Python, the training step through the local
PyTorchJob executor)."""

from __future__ import annotations

import importlib
import logging
import os
import re
import shutil
import sys
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import yaml

from crosskd.errors import ConfigError, CrosskdError
from crosskd.steps.config import RunConfig, check_pipeline_scoring
from crosskd.steps.locations import is_local
from crosskd.steps.runtime import ERRORS_ENV
from crosskd.train.config import TrainConfig

log = logging.getLogger(__name__)

PIPELINE_FILE = "pipelines/distill.py"
COMPILED_FILE = "pipelines/distill.yaml"
TOP_LEVEL = (
    "teachers",
    "student",
    "train_data",
    "heldout_data",
    "ood_data",
    "k",
    "tau",
    "compare_ce_only",
    "score_pods",
)
"""RunConfig keys that are pipeline parameters of their own (so is ``train.steps``: ``steps``);
the rest go into ``options``."""
TEACHER_SERVING = {"cache": "distill", "server": "distill_served"}
"""``--teacher-serving``: the pipeline function of ``pipelines/distill.py`` for each choice
(``cache``: teachers scored into caches; ``server``: a teacher server per teacher, started for
training and stopped after it)."""
LOCAL_JOB = {"cpu": "1", "memory": "2Gi", "grace_seconds": 30, "env": {"OMP_NUM_THREADS": "1"}}
"""The local executor's PyTorchJob settings (one CPU process, no GPU)."""


def source_root() -> Path:
    """The checkout holding ``pipelines/distill.py``: the one this package was installed from
    (editable), else the current directory."""
    for candidate in (Path(__file__).resolve().parents[3], Path.cwd()):
        if (candidate / PIPELINE_FILE).is_file() and (candidate / "components").is_dir():
            return candidate
    raise ConfigError(
        f"{PIPELINE_FILE} not found; run crosskd pipeline from a crosskd checkout (the pipeline "
        f"and its components are source files, not installed)."
    )


def load_pipeline(image: str | None = None, teacher_serving: str = "cache") -> Callable[..., Any]:
    """The pipeline function of ``pipelines/distill.py`` (the checkout's root is put first on
    ``sys.path``); ``image`` replaces the components' image (``CROSSKD_IMAGE``, and
    ``<image>-cuda`` for the GPU steps): the components are imported afresh, since they read
    it when imported; ``teacher_serving`` picks the pipeline (:data:`TEACHER_SERVING`)."""
    if teacher_serving not in TEACHER_SERVING:
        raise ConfigError(
            f"teacher_serving is {teacher_serving!r}; choose one of {', '.join(TEACHER_SERVING)}."
        )
    root = str(source_root())
    if image:
        os.environ["CROSSKD_IMAGE"] = image
        os.environ["CROSSKD_CUDA_IMAGE"] = f"{image}-cuda"
        for name in [m for m in sys.modules if m.split(".")[0] in ("components", "pipelines")]:
            del sys.modules[name]
    if root not in sys.path:
        sys.path.insert(0, root)
    return getattr(importlib.import_module("pipelines.distill"), TEACHER_SERVING[teacher_serving])


def compile_pipeline(
    output: str,
    *,
    image: str | None = None,
    parameters: dict[str, Any] | None = None,
    teacher_serving: str = "cache",
) -> str:
    """Compile the pipeline (``teacher_serving``: :data:`TEACHER_SERVING`) into ``output``
    (YAML), with ``parameters`` as the defaults of those pipeline parameters; returns
    ``output``."""
    # lazy: kfp is an optional extra (crosskd[kfp]); crosskd pipeline graph and submit import this
    # module for COMPILED_FILE and source_root
    from kfp import compiler

    pipeline = load_pipeline(image, teacher_serving)
    compiler.Compiler().compile(pipeline, output, pipeline_parameters=parameters or None)
    Path(output).write_text(canonical_header(Path(output).read_text()))
    return output


def canonical_header(compiled: str) -> str:
    """The compiled pipeline YAML ``compiled`` with its header comment written again from the
    key-sorted pipeline spec by kfp's own comment writer, so that one pipeline always compiles
    to the same bytes. kfp writes the header from ``json_format.MessageToDict`` of the spec
    and prints each dict default with ``str()``, so the order of its keys is the order of
    protobuf's ``Struct`` map, which upb hashes with its own per-process seed (not
    ``PYTHONHASHSEED``) whatever order the keys were inserted in: sorted inputs cannot fix it,
    only the header can be written again; the YAML documents below it are already sorted."""
    # lazy: kfp is an optional extra (crosskd[kfp]); crosskd pipeline graph and submit import this
    # module for COMPILED_FILE and source_root
    from kfp.compiler.pipeline_spec_builder import extract_comments_from_pipeline_spec

    lines = compiled.splitlines(keepends=True)
    first = next(i for i, line in enumerate(lines) if not line.startswith("#"))
    body = "".join(lines[first:])
    spec = next(yaml.safe_load_all(body))
    ordered = _sorted_keys(spec)
    header = extract_comments_from_pipeline_spec(
        ordered, ordered["pipelineInfo"].get("description")
    )
    return header + body


def _sorted_keys(value: Any) -> Any:
    """``value`` with the keys of every mapping in it in sorted order."""
    if isinstance(value, dict):
        return {key: _sorted_keys(value[key]) for key in sorted(value)}
    if isinstance(value, list):
        return [_sorted_keys(item) for item in value]
    return value


def preset_arguments(config: RunConfig) -> dict[str, Any]:
    """The pipeline arguments of a run config for a local run: its keys (the ones that are not
    parameters of their own go into ``options``) with the local executor, no GPU and the steps'
    metrics on free ports (nothing scrapes them here; a fixed port could be taken). When this
    machine's environment has S3 credentials (``AWS_ACCESS_KEY_ID``), the training job reads
    them as a pod would read its Secret (the local executor takes ``secretKeyRef`` values from
    the environment)."""
    check_pipeline_scoring(config)
    values = {k: v for k, v in asdict(config).items() if v is not None}
    output = values.pop("output")
    arguments = {key: values.pop(key) for key in TOP_LEVEL}
    train = dict(values.pop("train"))
    arguments["steps"] = train.pop("steps", TrainConfig.steps)
    values["train"] = train
    return {
        "output_root": output,
        **arguments,
        "options": values,
        "executor": "local",
        "image": "crosskd:local",
        "gpus_per_node": 0,
        "nodes": 1,
        "score_gpus": 0,
        "score_tolerations": [],
        "job": dict(LOCAL_JOB),
        "metrics_port": 0,
        "s3_secret": "crosskd-s3" if os.environ.get("AWS_ACCESS_KEY_ID") else "",
    }


def run_local(
    arguments: dict[str, Any], *, local_root: str | None = None, cache: bool = True
) -> dict[str, Any]:
    """Run the pipeline with ``arguments`` under ``kfp.local`` (``SubprocessRunner`` in this
    Python, no new virtual environment); KFP's own records (artifact files, its cache) go under
    ``local_root`` (default: ``<output_root>/kfp-local`` for a local output root), the workspace
    into a temporary folder kfp deletes. Returns the report step's output (``report``,
    ``bits_per_byte``); a failed step raises :class:`crosskd.errors.CrosskdError` with its
    message."""
    # lazy: kfp is an optional extra (crosskd[kfp]); crosskd pipeline graph and submit import this
    # module for COMPILED_FILE and source_root
    from kfp import local

    local_root = local_root or local_root_of(str(arguments["output_root"]))
    pipeline = load_pipeline()
    Path(local_root).mkdir(parents=True, exist_ok=True)
    workspace = tempfile.mkdtemp(prefix="crosskd-kfp-workspace-")
    errors = Path(tempfile.mkdtemp(prefix="crosskd-step-errors-"))
    local.init(
        runner=local.SubprocessRunner(use_venv=False),
        pipeline_root=local_root,
        workspace_root=workspace,
        enable_caching=cache,
        raise_on_error=True,
    )
    with warnings.catch_warnings():
        # kfp.local ignores resources and Kubernetes settings, and warns about each.
        warnings.simplefilter("ignore")
        previous = os.environ.get(ERRORS_ENV)
        os.environ[ERRORS_ENV] = str(errors)  # the steps' processes inherit it
        try:
            task = pipeline(**arguments)
        except RuntimeError as exc:
            found = sorted(errors.glob("*.txt"), key=lambda p: p.stat().st_mtime)
            message = found[0].read_text() if found else " ".join(_plain(str(exc)).split())
            raise CrosskdError(message) from None
        finally:
            if previous is None:
                os.environ.pop(ERRORS_ENV, None)
            else:
                os.environ[ERRORS_ENV] = previous
            shutil.rmtree(errors, ignore_errors=True)
    return dict(task.output)


def local_root_of(output_root: str) -> str:
    """kfp.local's own folder for a run whose outputs go to ``output_root``:
    ``<output_root>/kfp-local``; a :class:`ConfigError` when that is not a local folder."""
    if not is_local(output_root):
        raise ConfigError(
            f"output_root {output_root} is not a local folder; give "
            f"--local-root DIR for kfp.local's own files."
        )
    return f"{output_root.rstrip('/')}/kfp-local"


def _plain(text: str) -> str:
    """``text`` without the terminal colour codes kfp.local puts in its messages."""
    return re.sub(r"\x1b\[[0-9;]*m", "", text)
