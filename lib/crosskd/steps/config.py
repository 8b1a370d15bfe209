"""The configuration of one distillation run (:class:`RunConfig`): what ``crosskd distill`` and
the pipeline's parameters set. Presets ship with the package (``tiny``, ``demo``)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from crosskd.alignment.corpus import LICENCE_TEXTS
from crosskd.config import load_config, merged, require_positive_ints
from crosskd.errors import ConfigError
from crosskd.loss.config import PROJECTED
from crosskd.train.config import TrainConfig
from crosskd.transplant import TransplantConfig
from crosskd.zoo.models import check_shape

PRESETS = ("tiny", "demo", "scratch", "chat-demo", "transfer", "on-policy-demo")
TRAIN_ROWS = "train"
"""``train.on_policy.prompts`` meaning the run's own training rows after the held-out split
(so that the student never answers, and is never taught on, a held-out prompt)."""
TEACHER_SCORING = ("cache", "online")
"""Values of ``RunConfig.teacher_scoring``."""
EXECUTORS = ("inprocess", "local", "cluster")
"""Where training runs: ``inprocess``: the Trainer in this process; ``local``: the rendered
PyTorchJob on this machine (:mod:`crosskd.k8s.local`); ``cluster``: the PyTorchJob on the
cluster."""
INIT = "init"
"""A model reference meaning a random-init Llama (of the ``*_shape`` for the ``*_tokenizer``)."""
STDLIB = ""
"""``train_data`` unset: text from this machine's Python standard library (``corpus_bytes``)."""
RUN_SETS = ("student", "data", "output", "teachers", "seed", "student_tokenizer", "student_shape")
TRANSPLANT_SETS = ("model", "tokenizer", "output")
"""The :class:`crosskd.transplant.TransplantConfig` keys the run sets itself (``transplant``
refuses them): the pretrained ``student``, ``student_tokenizer`` and a content-addressed folder."""
"""The :class:`crosskd.train.TrainConfig` keys the run sets itself (``RunConfig.train`` refuses
them): the resolved student, its prepared data, run folder and teacher caches, and ``seed``."""
LICENCES = LICENCE_TEXTS
"""``ood_data`` reference: ``ood_bytes`` of this machine's licence texts
(:func:`crosskd.alignment.corpus.licence_documents`)."""


@dataclass
class RunConfig:
    """A whole distillation run. Lengths are token counts; URIs are any fsspec URI or path."""

    output: str
    """Root of the run's outputs. Pure steps write under content-addressed prefixes here
    (``tables/<key>``, ``prepared/<key>``, ``cache/<key>``, ``inputs/...``: the same inputs give
    the same URIs); a run's own outputs go to its run folder (``crosskd distill``: this folder;
    the pipeline: ``runs/<run id>``)."""
    teachers: list[str] = field(default_factory=lambda: ["zoo:smollm2"])
    """Teacher model references (HF folder, fsspec URI of one, ``zoo:NAME``, cached hub id), or
    ``init``: a random-init Llama of ``teacher_shape`` for ``teacher_tokenizer``."""
    teacher_tokenizer: str = "tiny:420"
    """Tokenizer of an ``init`` teacher (any tokenizer reference, or ``tiny:N``: a byte-level BPE
    of N tokens trained on the training data)."""
    teacher_shape: dict = field(default_factory=dict)
    """Llama shape of an ``init`` teacher (``hidden_size``, ``num_hidden_layers``, ...)."""
    student: str = INIT
    """The student: a pretrained model reference, or ``init`` (``student_shape`` for
    ``student_tokenizer``)."""
    student_tokenizer: str = "zoo:llama3"
    """Tokenizer of an ``init`` student (a teacher's own makes a same-tokenizer teacher: no
    tables), or the one a pretrained student is moved onto (``transplant``); otherwise unused
    (a pretrained student keeps its own)."""
    student_shape: dict = field(default_factory=dict)
    """Llama shape of an ``init`` student."""
    student_layers: int | list[int] | None = None
    """A compressed student: the pretrained ``student`` with only these of its decoder layers
    (a count: the first two and the last ones; or a list of indices; :mod:`crosskd.shrink`),
    cut once under ``<output>/inputs/students/<key>`` before anything else (and before
    ``transplant``), then healed by distillation from the teachers (the model it was cut from,
    for instance). None: the student whole."""
    transplant: dict | None = None
    """Tokenizer transfer: move the pretrained ``student`` onto ``student_tokenizer`` before
    training (step ``init_student``, :mod:`crosskd.transplant`), then distil it from the
    teachers (the model it was, for instance). A mapping of
    :class:`crosskd.transplant.TransplantConfig` keys except ``model``, ``tokenizer`` and
    ``output`` (``method``, ``dtype``, ``tune_steps``, ...; ``{}``: their defaults); without
    ``tune_data`` the ``tuned`` method trains on the run's training rows. The moved student is
    written once under ``<output>/inputs/students/<key>`` (keyed by the student reference and
    its ``config.json``, the tokenizer's fingerprint, these keys and the tuning text). None: the
    student keeps its own tokenizer."""
    train_data: str = STDLIB
    """Training rows (JSONL, Parquet, a ``datasets`` folder, a folder or glob of shards; text or
    chat). Empty: ``corpus_bytes`` of Python standard-library text."""
    heldout_data: str = ""
    """Held-out rows (same formats). Empty: ``heldout_fraction`` of the training rows."""
    ood_data: str = ""
    """Out-of-domain held-out rows (same formats): text of another kind than the training
    data, evaluated and reported beside the in-domain held-out rows (does a student generalise,
    or only fit its own text?). ``machine:licences``: ``ood_bytes`` of this machine's licence
    texts. Empty: none."""
    ood_bytes: int = 40_000
    """Size of the ``machine:licences`` out-of-domain text (UTF-8 bytes), in documents of about
    ``3 * max_length`` bytes."""
    heldout_fraction: float = 0.1
    """Without ``heldout_data``: the share of training rows held out, chosen by a hash of each
    row's id (the same rows whatever the order or the machine)."""
    corpus_bytes: int = 200_000
    """Size of the standard-library corpus (``train_data`` empty), in documents of about
    ``3 * max_length`` bytes: about ``max_length`` tokens, so that little of a document is
    clipped away (prepare keeps the first ``max_length`` tokens of each)."""
    heldout_every: int = 10
    """Standard-library corpus: every ``heldout_every``-th document is held out."""
    max_length: int = 256
    """Student capacity (longest sample, packed row length); teachers get twice as much."""
    shard_rows: int = 4096
    """Samples per prepared shard (the unit teacher scoring is split by)."""
    prepare_workers: int = 1
    """Processes the prepare step runs (``PrepareConfig.workers``). 1: one process, whose
    tokenizers use every core for their own part; the pod's cores (the pipeline requests 8)
    prepare about that many times faster (``docs/benchmarks.md``, "The data path"). The
    prepared data are the same bytes whatever the count (it is not part of their key)."""
    pack: bool = True
    """Lockstep-pack several samples into each row; false: one sample per row, right-padded
    (a student with state-carrying mixers, such as LFM2 or a Mamba hybrid, needs it)."""
    k: int = 128
    """Top-K of the teacher cache (128: on the compressed student, 3 seeds, CSD from the top
    128 ends 1.7% below CSD from the top 32 in and out of domain, and from the top 8 2.4% and
    2.6% above; ``docs/benchmarks.md``). The cache grows with K (lossless: about 530 bytes a
    token at 128)."""
    tau: float = 1.0
    """Distillation temperature."""
    algorithms: list[str] = field(default_factory=list)
    """Per teacher (in ``teachers`` order) its KD term: ``csd``, ``uld``, ``xtoken``, ``gold``
    or ``hkl`` (X-Token's projected KL, gold loss and H-KL, through the projection the run
    builds beside each cross-tokenizer teacher's tables). Empty: ``train.loss.kd`` (``csd``
    unless set) for every teacher."""
    encoding: str = "lossless"
    """Teacher cache encoding: ``lossless`` or ``lossy``."""
    teacher_scoring: str = "cache"
    """How the teachers' signal reaches training: ``cache`` (each teacher scores the prepared
    training rows once, step ``score_teacher``, into a cache every training run reads) or
    ``online`` (no cache: each training step scores its rows with the teachers in the training
    process, ``online:REF``; what ``train.on_policy`` needs, since the student's own answers
    exist only while it trains). ``online`` runs under ``crosskd distill``; the pipeline scores
    online through teacher servers instead (``crosskd pipeline compile --teacher-serving
    server``)."""
    score_pods: int = 1
    """Scoring of each teacher is split over this many shard ranges (pods in the pipeline)."""
    seed: int = 0
    """Seed of the data order and of random-init models (the student: ``seed``; teacher ``i``:
    ``seed + 1 + i``)."""
    train: dict = field(default_factory=dict)
    """Settings of each training run (the KD student and the CE-only one): any
    :class:`crosskd.train.TrainConfig` key except those the run sets itself (``student``,
    ``data``, ``output``, ``teachers``, ``seed``, ``student_tokenizer``, ``student_shape``), for
    example ``steps``, ``lr``, ``micro_batch_rows``, ``grad_accum``, ``parallel`` (it must fit
    the training job's ``nodes * gpus_per_node`` workers; one process in process) or
    ``activation_checkpointing``. ``loss`` takes :class:`crosskd.loss.LossConfig` keys except
    ``tau`` and ``teachers`` (the run sets them from ``tau``, ``k`` and the built tables). A key
    left out takes TrainConfig's default. Override one with ``train.KEY=VALUE``
    (``train.loss.kd_weight=0.5``)."""
    compare_ce_only: bool = True
    """Also train the same student with CE only (kd_weight 0) on the same budget."""
    token_budget: int = 2048
    """Padded tokens per forward batch when scoring and evaluating."""
    device: str | None = None
    """Device of scoring and evaluation (``cpu``, ``cuda``; default: CUDA when available)."""

    def __post_init__(self) -> None:
        if (
            not isinstance(self.teachers, list)
            or not self.teachers
            or not all(isinstance(t, str) and t for t in self.teachers)
        ):
            raise ConfigError(
                f"teachers is {self.teachers!r}; give a list of one or more "
                f"teacher model references (or init)."
            )
        require_positive_ints(
            self,
            (
                "corpus_bytes",
                "ood_bytes",
                "heldout_every",
                "max_length",
                "shard_rows",
                "prepare_workers",
                "k",
                "score_pods",
                "token_budget",
            ),
        )
        fraction = self.heldout_fraction
        if (
            isinstance(fraction, bool)
            or not isinstance(fraction, int | float)
            or not (0 < fraction < 1)
        ):
            raise ConfigError(
                f"heldout_fraction is {fraction!r}; it must be a number between 0 "
                f"and 1 (exclusive)."
            )
        for key in ("compare_ce_only", "pack"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(f"{key} is {getattr(self, key)!r}; write true or false.")
        for key in ("teacher_shape", "student_shape"):
            check_shape(key, getattr(self, key))
        if self.teacher_scoring not in TEACHER_SCORING:
            raise ConfigError(
                f"teacher_scoring is {self.teacher_scoring!r}; choose one of "
                f"{', '.join(TEACHER_SCORING)}."
            )
        if not isinstance(self.algorithms, list) or len(self.algorithms) not in (
            0,
            len(self.teachers),
        ):
            raise ConfigError(
                f"algorithms is {self.algorithms!r}; give one algorithm (csd, uld, xtoken, "
                f"gold, hkl) per teacher ({len(self.teachers)}), or none (train.loss.kd for "
                f"every teacher)."
            )
        self._check_train()
        self._check_transplant()
        self._check_layers()

    def _check_layers(self) -> None:
        """Refuse a ``student_layers`` that is neither a count nor a list of indices, or one
        for an ``init`` student."""
        layers = self.student_layers
        if layers is None:
            return
        count = isinstance(layers, int) and not isinstance(layers, bool) and layers >= 1
        indices = (
            isinstance(layers, list)
            and bool(layers)
            and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layers)
        )
        if not (count or indices):
            raise ConfigError(
                f"student_layers is {layers!r}; give a count of decoder layers to keep (>= 1) "
                f"or a list of layer indices, or leave it out."
            )
        if self.student == INIT:
            raise ConfigError(
                "student_layers is set but student is init; give a pretrained student to cut, "
                "or set student_shape instead."
            )

    def _check_transplant(self) -> None:
        """Refuse a ``transplant`` that is not a mapping, one for an ``init`` student, a key the
        run sets or an unknown one, or a value :class:`crosskd.transplant.TransplantConfig`
        refuses, naming it under ``transplant.``."""
        if self.transplant is None:
            return
        if not isinstance(self.transplant, dict):
            raise ConfigError(
                f"transplant is {self.transplant!r}; give a mapping of transplant keys (method, "
                f"dtype, tune_steps, ...; {{}} for the defaults), or leave it out."
            )
        if self.student == INIT:
            raise ConfigError(
                "transplant is set but student is init; give a pretrained student to move onto "
                "student_tokenizer, or leave transplant out."
            )
        _refuse_unknown("transplant", self.transplant, TransplantConfig, TRANSPLANT_SETS)
        try:
            TransplantConfig(model="-", tokenizer="-", output="-", **self.transplant)
        except ConfigError as exc:
            raise ConfigError(f"transplant: {exc}") from exc

    def _check_train(self) -> None:
        """Refuse a ``train`` key the run sets, an unknown one, or a value
        :class:`crosskd.train.TrainConfig` refuses, naming it under ``train.``."""
        if not isinstance(self.train, dict):
            raise ConfigError(
                f"train is {self.train!r}; give a mapping of TrainConfig keys (steps, lr, ...)."
            )
        _refuse_unknown("train", self.train, TrainConfig, RUN_SETS)
        loss = self.train.get("loss", {})
        if not isinstance(loss, dict):
            raise ConfigError(f"train.loss is {loss!r}; give a mapping of LossConfig keys.")
        for key in ("tau", "teachers"):
            if key in loss:
                raise ConfigError(
                    f"train.loss.{key} is set; the run sets it from the top-level keys (tau, k "
                    f"and the built tables). Remove train.loss.{key}."
                )
        if self.train.get("on_policy") is not None and self.teacher_scoring == "cache":
            raise ConfigError(
                "train.on_policy is set but teacher_scoring is cache: a cache holds the "
                "teachers' signal of the prepared rows only, not of the answers the student "
                "writes while it trains. Set teacher_scoring: online."
            )
        n = len(self.teachers)
        placeholder = "online:-" if self.teacher_scoring == "online" else "-"
        try:
            TrainConfig(
                **self.train_values(
                    student="-",
                    data="-",
                    output="-",
                    caches=[placeholder] * n,
                    tables=[{"s2t": "-", "t2s": "-", "projection": "-"}] * n,
                    kd=True,
                )
            )
        except ConfigError as exc:
            raise ConfigError(f"train: {exc}") from exc

    def train_values(
        self,
        *,
        student: str,
        data: str,
        output: str,
        caches: list[str],
        tables: list[dict | None],
        kd: bool,
        train_rows: str = "-",
    ) -> dict[str, Any]:
        """The ``crosskd train`` keys of one training run: ``train`` with what the run sets
        (the resolved ``student`` folder, prepared ``data``, run ``output``, teacher ``caches``
        and ``tables`` (``{"s2t", "t2s"}`` URIs, None for a same-tokenizer teacher), ``seed``,
        and the loss's ``tau`` and teacher entries); ``kd`` False: the CE-only run
        (``kd_weight`` 0, and no on-policy rows: it learns from the data alone).
        ``train_rows``: the raw training rows, the prompts of ``on_policy.prompts: train``."""
        values = dict(self.train)
        loss = dict(values.get("loss", {}))
        if not kd:
            loss.update(kd_weight=0.0, dynamic_kd_scale=False)
            values.pop("on_policy", None)
        elif (values.get("on_policy") or {}).get("prompts") == TRAIN_ROWS:
            values["on_policy"] = {**values["on_policy"], "prompts": train_rows}
        loss["tau"] = self.tau
        loss["teachers"] = [
            self._teacher_loss(t, algorithm, loss.get("kd", "csd"))
            for t, algorithm in zip(tables, self.algorithms or [None] * len(tables), strict=True)
        ]
        return {
            **values,
            "student": student,
            "data": data,
            "output": output,
            "teachers": list(caches),
            "seed": self.seed,
            "loss": loss,
        }

    def _teacher_loss(self, tables: dict | None, algorithm: str | None, kd: str) -> dict:
        """One ``loss.teachers`` entry: ``k``, the tables' URIs, the teacher's ``algorithm``
        (when ``algorithms`` names one) and, for one that reads it (``xtoken``, ``gold``,
        ``hkl``), its projection's URI."""
        tables = tables or {}
        entry: dict[str, Any] = {
            "k": self.k,
            "student_to_teacher": tables.get("s2t"),
            "teacher_to_student": tables.get("t2s"),
        }
        if algorithm is not None:
            entry["algorithm"] = algorithm
        if (algorithm or kd) in PROJECTED:
            entry["projection"] = tables.get("projection")
        return entry

    def scoring(self) -> dict[str, Any]:
        """What changes a teacher cache: ``k``, ``tau``, ``encoding``, ``token_budget``,
        ``device``."""
        return {
            "k": self.k,
            "tau": self.tau,
            "encoding": self.encoding,
            "token_budget": self.token_budget,
            "device": self.device,
        }

    def preparing(self) -> dict[str, Any]:
        """How the prepare step runs: what changes prepared data besides the inputs
        (``max_length``, ``shard_rows``, ``pack``) and its ``workers``, which does not."""
        return {
            "max_length": self.max_length,
            "shard_rows": self.shard_rows,
            "pack": self.pack,
            "workers": self.prepare_workers,
        }


def _refuse_unknown(key: str, values: dict, cls: type, sets: tuple[str, ...]) -> None:
    """Refuse a key of the mapping ``values`` (the RunConfig's ``key``) that is not a field of
    ``cls`` or that the run sets itself (``sets``), naming it and the known keys."""
    known = {f.name for f in fields(cls)} - set(sets)
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(
            f"{key}: unknown key(s) {', '.join(unknown)}; known keys: "
            f"{', '.join(sorted(known))} (the run sets {', '.join(sets)} itself)."
        )


def run_config_from_parameters(parameters: dict[str, Any], options: dict[str, Any]) -> RunConfig:
    """The RunConfig of the pipeline's parameters: the keys that are parameters of their own
    (``parameters``; the pipeline's ``steps`` comes as ``{"train": {"steps": N}}``) and every
    other key (``options``), mappings merged key by key; an unknown key, or one given in both,
    is a :class:`ConfigError` naming it."""
    known = set(RunConfig.__dataclass_fields__)
    unknown = sorted(set(options) - known)
    if unknown:
        own = {key for key, value in parameters.items() if not isinstance(value, dict)}
        raise ConfigError(
            f"options: unknown key(s) {', '.join(unknown)}; known keys: "
            f"{', '.join(sorted(known - own))}."
        )
    twice = _overlap(options, parameters)
    if twice:
        raise ConfigError(
            f"options sets {', '.join(twice)}, which the pipeline takes as "
            f"parameter(s) of their own; set them there."
        )
    config = load_config(RunConfig, None, [], flags=merged(options, parameters))
    check_pipeline_scoring(config)
    return config


def check_pipeline_scoring(config: RunConfig) -> None:
    """Refuse ``teacher_scoring: online`` for the pipeline, whose training pods score online
    through teacher servers, not with the teachers in their own process."""
    if config.teacher_scoring != "cache":
        raise ConfigError(
            f"teacher_scoring is {config.teacher_scoring}, which runs the teachers in the "
            f"training process (crosskd distill); the pipeline scores online through teacher "
            f"servers: compile it with --teacher-serving server, or run crosskd distill."
        )


def _overlap(first: dict[str, Any], second: dict[str, Any], prefix: str = "") -> list[str]:
    """The dotted keys both mappings set (a key where both hold a mapping is looked into)."""
    keys = []
    for key in sorted(set(first) & set(second)):
        if isinstance(first[key], dict) and isinstance(second[key], dict):
            keys += _overlap(first[key], second[key], f"{prefix}{key}.")
        else:
            keys.append(f"{prefix}{key}")
    return keys


def preset_path(name: str) -> str:
    """The YAML file of a shipped preset."""
    if name not in PRESETS:
        raise ConfigError(f"preset {name!r} does not exist; choose one of {', '.join(PRESETS)}.")
    return str(resources.files("crosskd") / "presets" / f"{name}.yaml")


def preset_values(name: str) -> dict[str, Any]:
    """The keys a shipped preset sets."""
    return yaml.safe_load(Path(preset_path(name)).read_text()) or {}


def load_run_config(
    path: str | None,
    preset: str | None,
    overrides: list[str],
    flags: dict[str, Any] | None = None,
) -> RunConfig:
    """A preset (or none), then the file, then command-line ``flags`` (field options), then
    ``key=value`` overrides; a mapping (``train``, ``train.loss``) is merged key by key, so a
    file that sets ``train.steps`` keeps the preset's ``train.lr``."""
    values: dict[str, Any] = {}
    for source in (preset_path(preset) if preset else None, path):
        if source is None:
            continue
        loaded = yaml.safe_load(Path(source).read_text()) or {}
        known = set(RunConfig.__dataclass_fields__)
        unknown = sorted(set(loaded) - known)
        if unknown:
            raise ConfigError(
                f"config {source}: unknown key(s) {', '.join(unknown)}; known keys: "
                f"{', '.join(sorted(known))}."
            )
        values = merged(values, loaded)
    return load_config(RunConfig, None, overrides, flags=merged(values, flags or {}))
