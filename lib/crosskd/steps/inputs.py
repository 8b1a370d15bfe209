"""Step ``validate_inputs``: check a run's inputs in seconds, before any GPU step, and resolve
every reference the later steps need into a URI.

Checked: every config value the later steps would refuse (prepare, score, train, loss, the
PyTorchJob's), that the data exist, that every model folder has a ``config.json`` and a
tokenizer crosskd supports. Resolved (written once, under content-addressed prefixes of the
run's root, so a rerun finds them): the standard-library corpus when no data is given, ``tiny:N``
tokenizers trained on the training rows, ``init`` models (random-init Llamas, seeded) and the
``machine:licences`` out-of-domain text. A student to move onto another tokenizer
(``transplant``) is only planned here: step ``init_student`` (:mod:`crosskd.steps.student`)
moves it.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import fsspec
import torch

from crosskd.alignment.corpus import benchmark_corpus, licence_documents
from crosskd.data.prepare import PrepareConfig
from crosskd.data.records import read_records
from crosskd.errors import ConfigError, CrosskdError
from crosskd.k8s import JOB_KINDS
from crosskd.parallel.attention import layer_windows, refuse_state_mixers
from crosskd.parallel.layout import ParallelLayout
from crosskd.shrink import kept_layers, shrink
from crosskd.steps.config import EXECUTORS, INIT, LICENCES, STDLIB, RunConfig
from crosskd.steps.locations import content_uri, exists, materialize
from crosskd.teacher.model import model_folder
from crosskd.teacher.scoring import ScoreConfig
from crosskd.tokenization import load_tokenizer
from crosskd.transplant import TransplantConfig, check_template_specials, corpus_texts
from crosskd.zoo import train_tiny_bpe
from crosskd.zoo.models import init_llama

log = logging.getLogger(__name__)

VARIANTS = ("kd", "ce")
"""Training runs of a run: ``kd`` (CSD), ``ce`` (CE only, the comparison)."""


def variants(config: RunConfig) -> list[str]:
    """The training runs of ``config``: ``["kd"]``, with ``compare_ce_only`` ``["kd", "ce"]``."""
    return list(VARIANTS if config.compare_ce_only else VARIANTS[:1])


def model_tokenizer(ref: str) -> str:
    """The tokenizer reference of a model reference: its local folder (``zoo:`` models built,
    URIs copied into the cache), which holds the tokenizer files."""
    return str(model_folder(ref, role="model"))


def validate_inputs(
    config: RunConfig,
    job: dict[str, Any] | None = None,
    executor: str = "inprocess",
    job_kind: str = "pytorchjob",
) -> dict[str, Any]:
    """Check ``config``, the training ``executor`` (:data:`crosskd.steps.config.EXECUTORS`)
    and, for a job, its settings ``job`` (JobConfig keys) as the ``job_kind``
    (:data:`crosskd.k8s.JOB_KINDS`) it is rendered as, and resolve its
    references; returns the run's plan: ``{"root", "student", "student_fingerprint",
    "teachers": [{"index", "ref", "fingerprint", "same_tokenizer"}], "train_data",
    "heldout_data", "heldout_fraction", "ood_data", "transplant"}`` (URIs;
    ``heldout_fraction`` None when ``heldout_data`` is given, ``ood_data`` None without
    out-of-domain rows; ``transplant`` None, or with ``config.transplant`` the
    :class:`crosskd.transplant.TransplantConfig` keys of step ``init_student``, whose
    ``output`` is the moved student's URI, and ``student_fingerprint`` is then the fingerprint
    of ``student_tokenizer``)."""
    if executor not in EXECUTORS:
        raise ConfigError(f"executor is {executor!r}; choose one of {', '.join(EXECUTORS)}.")
    if job_kind not in JOB_KINDS:
        raise ConfigError(f"job_kind is {job_kind!r}; choose one of {', '.join(JOB_KINDS)}.")
    _check_step_configs(config, job if executor != "inprocess" else None, job_kind)
    root = config.output.rstrip("/")
    train_data, heldout_data = config.train_data, config.heldout_data
    if train_data == STDLIB:
        train_data, heldout_data = _stdlib_corpus(config, root)
    ood_data = _licence_text(config, root) if config.ood_data == LICENCES else config.ood_data
    for key, uri in (
        ("train_data", train_data),
        ("heldout_data", heldout_data),
        ("ood_data", ood_data),
    ):
        if uri and not _data_exists(uri):
            raise ConfigError(
                f"{key} {uri}: no such file, folder or glob; check the URI (and "
                f"the S3 credentials in the environment)."
            )
    docs: list[str] | None = None

    def tokenizer_ref(ref: str) -> str:
        nonlocal docs
        if not ref.startswith("tiny:"):
            return ref
        if docs is None:
            docs = _texts(train_data)
        size = _tiny_size(ref)
        uri = content_uri(
            root,
            "inputs/tokenizers",
            {"vocab": size, "docs": len(docs), "data": _text_digest(docs)},
        )
        return materialize(uri, lambda folder: train_tiny_bpe(docs, size, folder))

    def model_ref(ref: str, tokenizer: str, shape: dict, seed: int, role: str) -> str:
        if ref != INIT:
            _check_model(ref, role)
            return ref
        tok_ref = tokenizer_ref(tokenizer)
        fingerprint = load_tokenizer(tok_ref).fingerprint
        uri = content_uri(
            root, "inputs/models", {"tokenizer": fingerprint, "shape": shape, "seed": seed}
        )
        return materialize(uri, lambda folder: init_llama(folder, tok_ref, shape, seed) and None)

    student = model_ref(
        config.student, config.student_tokenizer, config.student_shape, config.seed, "student"
    )
    if config.student_layers is not None:
        student = _compressed_student(root, student, config.student_layers)
    transplant = None
    if config.transplant is None:
        student_fp = load_tokenizer(model_tokenizer(student)).fingerprint
    else:
        target = tokenizer_ref(config.student_tokenizer)
        new_tokenizer = load_tokenizer(target)
        check_template_specials(new_tokenizer, config.student_tokenizer)
        student_fp = new_tokenizer.fingerprint
        transplant = _transplant_plan(config, root, student, target, student_fp, train_data)
    if config.pack and config.student != INIT:
        _check_student_packs(student)
    teachers = []
    for i, ref in enumerate(config.teachers):
        resolved = model_ref(
            ref, config.teacher_tokenizer, config.teacher_shape, config.seed + 1 + i, f"teacher {i}"
        )
        fingerprint = load_tokenizer(model_tokenizer(resolved)).fingerprint
        teachers.append(
            {
                "index": i,
                "ref": resolved,
                "fingerprint": fingerprint,
                "same_tokenizer": fingerprint == student_fp,
            }
        )
    plan = {
        "root": root,
        "student": student,
        "student_fingerprint": student_fp,
        "teachers": teachers,
        "train_data": train_data,
        "heldout_data": heldout_data,
        "heldout_fraction": None if heldout_data else float(config.heldout_fraction),
        "ood_data": ood_data or None,
        "transplant": transplant,
    }
    log.info(
        "inputs: student %s, %d teacher(s) (%s), data %s",
        student,
        len(teachers),
        ", ".join(t["ref"] for t in teachers),
        train_data,
    )
    return plan


def _compressed_student(root: str, student: str, layers: int | list[int]) -> str:
    """``student`` with only its decoder ``layers`` (:func:`crosskd.shrink.shrink`), written
    once under a URI keyed by the student reference, its ``config.json`` and the kept layers."""
    folder = model_folder(student, role="student")
    config_json = (folder / "config.json").read_bytes()
    total = json.loads(config_json).get("num_hidden_layers")
    if not isinstance(total, int):
        raise ConfigError(
            f"student_layers is set but student {student} has no num_hidden_layers in its "
            f"config.json; give a decoder-only causal LM of the Llama family."
        )
    try:
        keep = kept_layers(total, layers)
    except ConfigError as exc:
        raise ConfigError(f"student_layers: {exc} (student {student})") from exc
    key = {
        "student": student,
        "config": hashlib.sha256(config_json).hexdigest(),
        "layers": keep,
    }

    def build(folder: Path) -> None:
        shrink(student, str(folder), keep)

    return materialize(content_uri(root, "inputs/students", key), build)


def _transplant_plan(
    config: RunConfig, root: str, student: str, tokenizer: str, fingerprint: str, train_data: str
) -> dict[str, Any]:
    """The :class:`crosskd.transplant.TransplantConfig` keys that move ``student`` onto
    ``tokenizer`` (fingerprint ``fingerprint``): ``config.transplant``, ``tune_data`` the
    training rows unless it names its own, and ``output`` a URI keyed by the student reference
    and its ``config.json``, the tokenizer, the keys and (when tuning) a digest of the text it
    tunes on (the first ``tune_bytes`` of ``tune_data``: a large dataset is not read whole)."""
    values = {"tune_data": train_data, **(config.transplant or {})}
    move = TransplantConfig(model=student, tokenizer=tokenizer, output="-", **values)
    text = None
    if move.method == "tuned":  # the text it tunes on: at most tune_bytes of tune_data
        text = _text_digest(corpus_texts(move.tune_data, move.tune_bytes, "transplant.tune_data"))
    config_json = (model_folder(student, role="student") / "config.json").read_bytes()
    key = {
        "student": student,
        "config": hashlib.sha256(config_json).hexdigest(),
        "tokenizer": fingerprint,
        "transplant": {k: v for k, v in values.items() if k != "tune_data"},
        "tune_text": text,
    }
    return {
        **values,
        "model": student,
        "tokenizer": tokenizer,
        "output": content_uri(root, "inputs/students", key),
    }


def _check_student_packs(student: str) -> None:
    """Refuse now, not after preparing and scoring, a pretrained ``student`` that packed rows
    would train wrongly (:func:`crosskd.parallel.attention.refuse_state_mixers`): the model of its
    ``config.json`` alone is built on the meta device (no weights are read). A model type this
    transformers does not know is left to the training step's own check."""
    # lazy: transformers costs ~1 s over torch; every pipeline step imports crosskd.steps, which
    # imports this module, and only a pretrained student's check builds a model
    from transformers import AutoConfig, AutoModelForCausalLM

    if "://" in student and not student.startswith("file://"):
        with fsspec.open(f"{student.rstrip('/')}/config.json", "rb") as handle:
            values = json.load(handle)
    else:
        values = json.loads((model_folder(student, role="student") / "config.json").read_text())
    try:
        config = AutoConfig.for_model(values.pop("model_type", None), **values)
    except ValueError:
        return
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    layer_windows(config)
    refuse_state_mixers(
        model,
        f"the samples of the packed rows of student {student}",
        "set pack: false (one sample per row)",
    )


def _check_step_configs(config: RunConfig, job: dict[str, Any] | None, job_kind: str) -> None:
    """Build every later step's config from ``config`` so a value they would refuse is refused
    now, naming the key (the training keys were checked when ``config`` was built), render the
    training job as ``job_kind`` (what that API cannot carry is refused), and check the
    training layout against the job's workers (or the one in-process worker)."""
    n = len(config.teachers)
    PrepareConfig(
        data="-",
        student_tokenizer="-",
        teacher_tokenizers=["-"] * n,
        output="-",
        max_length=config.max_length,
        teacher_max_length=2 * config.max_length,
        shard_rows=config.shard_rows,
        pack=config.pack,
    )
    ScoreConfig(
        data="-",
        teacher="-",
        output="-",
        k=config.k,
        tau=config.tau,
        encoding=config.encoding,
        token_budget=config.token_budget,
    ).check()
    if job is not None:
        # lazy: crosskd.k8s imports the kubernetes and kubeflow clients (~0.4 s); every pipeline
        # step imports this module through crosskd.steps, and only rendering or running a job
        # needs them
        from crosskd.k8s.job import job_layout, load_job_config
        from crosskd.k8s.kinds import KINDS

        job_config = load_job_config(values={"run_id": "validate", **job})
        KINDS[job_kind].render(job_config)
        job_layout(job_config, config.train.get("parallel"))
    else:
        try:
            ParallelLayout.from_mapping(config.train.get("parallel", {})).resolved(1)
        except ConfigError as exc:
            raise ConfigError(
                f"{exc} In-process training is one process; use the local or "
                f"cluster executor for a parallel layout."
            ) from exc


def _stdlib_corpus(config: RunConfig, root: str) -> tuple[str, str]:
    """The standard-library corpus as ``train.jsonl`` / ``heldout.jsonl`` (every
    ``heldout_every``-th document held out), in documents of about ``3 * max_length`` bytes."""
    document_bytes = 3 * config.max_length

    def build(folder: Path) -> None:
        documents = benchmark_corpus(config.corpus_bytes, document_bytes=document_bytes)
        splits = {
            "train": [d for i, d in enumerate(documents) if i % config.heldout_every],
            "heldout": [d for i, d in enumerate(documents) if not i % config.heldout_every],
        }
        for name, docs in splits.items():
            (folder / f"{name}.jsonl").write_text(
                "".join(
                    json.dumps({"id": f"{name}-{i}", "text": d}) + "\n" for i, d in enumerate(docs)
                )
            )
        log.info(
            "corpus: %d training and %d held-out documents",
            len(splits["train"]),
            len(splits["heldout"]),
        )

    uri = content_uri(
        root,
        "inputs/corpus",
        {
            "bytes": config.corpus_bytes,
            "every": config.heldout_every,
            "document_bytes": document_bytes,
        },
    )
    materialize(uri, build)
    return f"{uri}/train.jsonl", f"{uri}/heldout.jsonl"


def _licence_text(config: RunConfig, root: str) -> str:
    """``ood_bytes`` of this machine's licence texts as ``ood.jsonl``, in documents of about
    ``3 * max_length`` bytes (whole, once prepared); returns its URI."""
    documents = licence_documents(config.ood_bytes, document_bytes=3 * config.max_length)
    uri = content_uri(root, "inputs/licences", {"text": _text_digest(documents)})

    def build(folder: Path) -> None:
        (folder / "ood.jsonl").write_text(
            "".join(
                json.dumps({"id": f"ood-{i}", "text": d}) + "\n" for i, d in enumerate(documents)
            )
        )

    materialize(uri, build)
    return f"{uri}/ood.jsonl"


def _data_exists(uri: str) -> bool:
    fs, path = fsspec.core.url_to_fs(uri)
    return fs.exists(path) or bool(fs.glob(path))


def _texts(uri: str) -> list[str]:
    """The text of every row (chat rows: their messages' content) of the data at ``uri``."""
    texts = []
    for record in read_records(uri):
        if record.text is not None:
            texts.append(record.text)
        else:
            texts.append("\n".join(str(m.get("content") or "") for m in record.messages or []))
    return texts


def _text_digest(texts: list[str]) -> str:
    digest = hashlib.sha256()
    for text in texts:
        digest.update(text.encode("utf-8") + b"\0")
    return digest.hexdigest()


def _tiny_size(ref: str) -> int:
    try:
        size = int(ref[len("tiny:") :])
    except ValueError:
        size = 0
    if size < 1:
        raise ConfigError(f"tokenizer {ref!r}: write tiny:N with N the vocabulary size (>= 1).")
    return size


def _check_model(ref: str, role: str) -> None:
    """A model reference must name a folder with ``config.json`` and a tokenizer."""
    try:
        model_tokenizer(ref)
    except CrosskdError as exc:
        raise ConfigError(f"{role}: {exc}") from exc
    if "://" in ref and not exists(f"{ref.rstrip('/')}/config.json"):
        raise ConfigError(f"{role} {ref}: no config.json there; give a model folder.")
