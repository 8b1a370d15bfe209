"""Steps ``plan_scoring``, ``score_teacher`` and ``merge_cache``: each teacher's top-K signal of
the prepared training data (the teacher-serving GPU step), split by shard range over several
pods and joined into one cache manifest per teacher. A cache lives under ``<root>/cache/<key>``,
keyed by the data, the teacher's weights and everything that changes the stored numbers."""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Any

import fsspec
import torch

from crosskd.data.collate import load_prepared
from crosskd.metrics.steps import ScoringMetrics, served
from crosskd.steps.locations import content_uri
from crosskd.teacher.model import default_device, default_dtype, fingerprint, model_folder
from crosskd.teacher.scoring import MANIFEST, ScoreConfig, merge_cache, score_shards
from crosskd.teacher.sharded import score_on_processes

log = logging.getLogger(__name__)


def plan_scoring(
    plan: dict[str, Any], prepared: dict[str, Any], scoring: dict[str, Any], pods: int
) -> list[dict[str, Any]]:
    """One scoring job per teacher and shard range: the prepared training shards split into
    ``min(pods, shards)`` contiguous ranges of near-equal size. Each job is self-contained (what
    :func:`score_teacher` needs): ``{"teacher", "start", "stop"`` (exclusive)``, "data", "root",
    "scoring"}`` (``scoring``: ``k``, ``tau``, ``encoding``, ``token_budget``, ``device``)."""
    shards, pods = int(prepared["train_shards"]), int(pods)
    parts = max(1, min(pods, shards))
    bounds = [round(i * shards / parts) for i in range(parts + 1)]
    return [
        {
            "teacher": t,
            "start": bounds[i],
            "stop": bounds[i + 1],
            "data": prepared["train"],
            "root": plan["root"],
            "scoring": dict(scoring),
        }
        for t in plan["teachers"]
        for i in range(parts)
    ]


def online_teachers(plan: dict[str, Any]) -> list[dict[str, Any]]:
    """The teachers of ``plan`` for training without a cache (``teacher_scoring: online``):
    ``{"index", "online": "online:<ref>"}`` each, the ``teachers`` entry of a training run that
    scores each step's rows with that teacher in the training process."""
    return [{"index": t["index"], "online": f"online:{t['ref']}"} for t in plan["teachers"]]


def cache_uri(
    root: str,
    data: str,
    teacher: dict[str, Any],
    *,
    k: int,
    tau: float,
    encoding: str,
    token_budget: int,
    device: str | None,
) -> str:
    """The content-addressed cache of one teacher: keyed by the prepared data's fingerprint,
    the teacher's weights fingerprint, K, tau, the encoding, the token budget and the device
    type and dtype (which change the stored numbers)."""
    resolved = torch.device(device) if device else default_device()
    key = {
        "data": load_prepared(data).manifest["data_fingerprint"],
        "teacher": fingerprint(model_folder(teacher["ref"])),
        "index": int(teacher["index"]),
        "k": int(k),
        "tau": float(tau),
        "encoding": encoding,
        "token_budget": int(token_budget),
        "device": resolved.type,
        "dtype": str(default_dtype(resolved)),
    }
    return content_uri(root, "cache", key)


def score_teacher(
    job: dict[str, Any],
    *,
    progress: bool = True,
    metrics_port: int | None = None,
    final_scrape_s: float = 30.0,
    processes: int = 1,
) -> dict[str, Any]:
    """Score the shard range of ``job`` (:func:`plan_scoring`) with the job's teacher into its
    cache (:func:`cache_uri`); returns ``{"index", "cache", "start", "stop", "samples"}``. A
    range scored before returns at once; an interrupted one resumes. ``metrics_port``: serve
    the scoring metrics (:class:`crosskd.metrics.steps.ScoringMetrics`) there while it runs
    (0: a free port; None: not served), ``final_scrape_s`` seconds at most for a last scrape.
    ``processes`` > 1: the teacher sharded over that many processes, one per GPU of the pod
    (:mod:`crosskd.teacher.sharded`; the metrics then count the range's shards at its end)."""
    teacher, options = job["teacher"], job["scoring"]
    k, tau = int(options["k"]), float(options["tau"])
    encoding, budget = options.get("encoding", "lossless"), int(options.get("token_budget", 4096))
    device = options.get("device")
    uri = cache_uri(
        job["root"],
        job["data"],
        teacher,
        k=k,
        tau=tau,
        encoding=encoding,
        token_budget=budget,
        device=device,
    )
    config = ScoreConfig(
        data=job["data"],
        teacher=teacher["ref"],
        output=uri,
        teacher_index=int(teacher["index"]),
        k=k,
        tau=tau,
        encoding=encoding,
        token_budget=budget,
        device=device,
        processes=processes,
    )
    metrics = ScoringMetrics(f"teacher{int(teacher['index'])}")
    start, stop = int(job["start"]), int(job["stop"])
    with served(metrics, metrics_port, "score_teacher", final_scrape_s):
        if processes > 1:
            metrics.shards.set(stop - start)
            part = score_on_processes(config, start, stop, progress=progress)
            metrics.shards_done.set(stop - start)
        else:
            part = score_shards(config, start, stop, progress=progress, metrics=metrics)
    return {
        "index": int(teacher["index"]),
        "cache": uri,
        "start": part["start"],
        "stop": part["stop"],
        "samples": part["samples"],
    }


def merge_caches(parts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Join the scored ranges (outputs of :func:`score_teacher`, any order) into one manifest
    per teacher cache; returns ``[{"index", "cache", "manifest_sha256", "tokens",
    "bits_per_byte"}]`` in teacher order."""
    caches = {}
    for part in parts:
        caches.setdefault(int(part["index"]), part["cache"])
    merged = []
    for index in sorted(caches):
        manifest = merge_cache(caches[index])
        fs, path = fsspec.core.url_to_fs(caches[index])
        digest = hashlib.sha256(fs.cat_file(f"{path}/{MANIFEST}")).hexdigest()
        merged.append(
            {
                "index": index,
                "cache": caches[index],
                "manifest_sha256": digest,
                "tokens": manifest["tokens"],
                "bits_per_byte": manifest["bits_per_byte"],
            }
        )
        log.info(
            "teacher %d cache %s: %d tokens, %s bits per byte",
            index,
            caches[index],
            manifest["tokens"],
            json.dumps(manifest["bits_per_byte"]),
        )
    return merged
