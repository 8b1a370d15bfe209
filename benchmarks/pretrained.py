"""The pretrained-student settings of ``benchmarks/quality.py``: does distilling beat fine-tuning
where the teacher knows more than the student's data shows?

Every arm of a setting starts from one pretrained student. In two settings it is the
**compressed** SmolLM2: SmolLM2-135M-Instruct with 10 of its 30 decoder layers kept
(``student_layers``, :mod:`crosskd.shrink`: the first two and the last eight, 64M parameters of
135M), so the student is smaller than its teacher and has lost much of what the teacher knows:

* ``compressed``: the teacher is the full SmolLM2-135M-Instruct, the model the student was cut
  from (the student is healed by distillation);
* ``domain-teacher``: the teacher is SmolLM2-135M-Instruct first adapted (CE, every parameter,
  one pass) on more than 10x as much in-domain text as the student gets (:func:`domain_teacher`;
  the student's held-out documents are not in it), so it knows the domain beyond the student's
  data. The adapted teacher is a cached step: built once under
  ``<out>/work/inputs/domain-teacher``.

In the third, ``transfer``, the student is the whole SmolLM2-135M-Instruct moved onto the
Llama-3 tokenizer and the teacher is the model it was: distillation restores what the move lost.

Data: the machine's Python standard-library text (``crosskd.alignment.corpus``) in documents of
about ``3 * max_length`` bytes, every second document held out: about 31 kB to train on and
31 kB of **in-domain** held-out text; 31 kB of licence texts as **out-of-domain** held-out text.
Training rows hold :data:`MAX_LENGTH` tokens; the held-out sets the results are scored on are
prepared at :data:`SCORED_LENGTH` tokens, so every document is scored whole (the set that picks
the best checkpoint during training keeps the training length).
Arms, each on every seed (a seed changes the data order; the student is the same):

* ``ce``: the compressed student on its own tokenizer, CE only (fine-tuning);
* ``kd``: the same student, same-tokenizer KD from the teacher's top-K (the ceiling: the
  student keeps the teacher's tokenizer);
* ``ce-llama3``: the compressed student moved onto the Llama-3 tokenizer
  (:mod:`crosskd.transplant`, ``tuned``), CE only;
* ``csd``: the moved student, CSD from the teacher;
* ``uld``: the moved student, ULD;
* ``kd-only``, ``csd-only``: ``kd`` and ``csd`` without the CE term (pure distillation, as
  depth-pruned models are healed in Minitron and as ALM transfers tokenizers);
* ``csd-mw1``: ``csd`` with ``mismatch_weight`` 1 (the spec's 5 weighs the 1:n, n:1 and n:m
  chunks five times a 1:1 chunk);
* ``csd-kd-warmup``: ``csd`` with the KD term fading in over the first pass
  (``kd_warmup_steps``);
* ``csd-embeddings-first``: ``csd`` with the moved student's embeddings (and its tied output
  layer) trained alone for the first half pass (``first_trainable``, ``first_steps``);
* ``csd-on-policy``: ``csd`` with one more row per step (:data:`ON_POLICY`): the student's
  own continuation of the first half of a training document, sampled with the step's weights
  and scored by the teacher online (``train.on_policy``); the same steps and prepared rows
  (which the teacher then scores online too, to the values the lossless cache holds);
* ``csd-static-scale``: ``csd`` with a static KD weight of 1 in place of the dynamic KD scale
  (the scale alone, everything else kept);
* ``csd-k8``, ``csd-k128``, ``csd-tau2``: ``csd`` from the teacher's top 8 or 128 instead of
  32, or at temperature 2 (each from a teacher cache of its own);
* ``ce-llama3-long``, ``csd-mw1-long``: ``ce-llama3`` and ``csd-mw1`` over twice the passes
  (the longer budget);
* ``xtoken``: the moved student distilled with X-Token's projected KL (``loss.kd: xtoken``,
  :mod:`crosskd.loss.xtoken`) through the projection the run builds from the tables, forward
  KL and the dynamic KD scale as ``csd``;
* ``gold``, ``hkl``: the same with X-Token's gold loss and H-KL (:mod:`crosskd.loss.gold`).

``--arms`` picks; :data:`DEFAULT_ARMS` are the default (``transfer``: the arms on Llama-3; its
student on its own tokenizer is its teacher).

Every arm trains ``passes`` passes over its rows with a held-out evaluation every half pass
(``train.eval_data``: the in-domain held-out rows); the arm is compared at its best checkpoint by
that figure (early stopping), evaluated in and out of domain with each document's bits and
bytes kept, and compared with the CE-only arm on its own tokenizer by a paired bootstrap over
documents (:mod:`crosskd.paired`; :data:`COMPARISONS`). The CE-only arms do not read the
teacher: the two settings of the compressed student share them (``<out>/runs/ce-*``).
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import statistics
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from arithmetic_text import write_rows

from crosskd import steps
from crosskd.data.collate import load_prepared
from crosskd.distill import checked_tables, teacher_caches
from crosskd.errors import ConfigError
from crosskd.paired import PairedDifference, paired_bootstrap
from crosskd.steps.config import RunConfig
from crosskd.steps.evaluate import evaluate_models
from crosskd.steps.train import run_history

log = logging.getLogger("quality")

SETTINGS = ("compressed", "domain-teacher", "transfer")
KD = {"divergence": "forward_kl", "dynamic_kd_scale": True, "mismatch_weight": 5.0}
"""The distilled arms' loss: forward KL, the dynamic KD scale, the spec's ``mismatch_weight`` 5
(what the arms were measured with; ``csd-mw1`` changes it)."""
KD_ONLY = {**KD, "ce_weight": 0.0, "kd_weight": 1.0, "dynamic_kd_scale": False}


@dataclass(frozen=True)
class Arm:
    """One arm: the student's tokenizer (``own``, or ``llama3``: moved), its loss changes (None:
    CE only) and its train keys counted in steps, given here in passes over the training rows
    (each rounded up to whole steps)."""

    tokenizer: str
    loss: dict | None
    in_passes: dict[str, float] = field(default_factory=dict)
    on_policy: dict | None = None
    """``train.on_policy`` (the teacher then scores online, in the training process)."""
    scoring: dict = field(default_factory=dict)
    """Changes of the teacher cache this arm reads (``k``, ``tau``: ``RunConfig`` keys; the run
    scores the teacher once for each distinct set)."""
    budget: int = 1
    """The setting's passes over the training rows times this (2: the longer budget)."""


ON_POLICY = {"prompts": "train", "fraction": 0.25, "max_new_tokens": 64, "text_share": 0.5}
"""The on-policy arm's rollouts: one row of the student's own continuation of the first half of
a training document per step, beside the step's 4 prepared rows."""
EMBEDDINGS = ["embed_tokens", "lm_head"]
"""The moved student's new embeddings (tied with its output layer)."""
ARMS = {
    "ce": Arm("own", None),
    "kd": Arm("own", KD),
    "ce-llama3": Arm("llama3", None),
    "csd": Arm("llama3", KD),
    "uld": Arm("llama3", {"kd": "uld", "kd_weight": 1.5, "dynamic_kd_scale": False}),
    "kd-only": Arm("own", KD_ONLY),
    "csd-only": Arm("llama3", KD_ONLY),
    "csd-mw1": Arm("llama3", {**KD, "mismatch_weight": 1.0}),
    "csd-kd-warmup": Arm("llama3", KD, {"kd_warmup_steps": 1.0}),
    "csd-embeddings-first": Arm("llama3", KD, {"first_steps": 0.5}),
    "csd-on-policy": Arm("llama3", KD, on_policy=ON_POLICY),
    "csd-static-scale": Arm("llama3", {**KD, "dynamic_kd_scale": False, "kd_weight": 1.0}),
    "csd-k8": Arm("llama3", KD, scoring={"k": 8}),
    "csd-k128": Arm("llama3", KD, scoring={"k": 128}),
    "csd-tau2": Arm("llama3", KD, scoring={"tau": 2.0}),
    "ce-llama3-long": Arm("llama3", None, budget=2),
    "csd-mw1-long": Arm("llama3", {**KD, "mismatch_weight": 1.0}, budget=2),
    "xtoken": Arm("llama3", {**KD, "kd": "xtoken"}),
    "gold": Arm("llama3", {**KD, "kd": "gold"}),
    "hkl": Arm("llama3", {**KD, "kd": "hkl"}),
}
DEFAULT_ARMS = {
    "compressed": ("ce", "kd", "ce-llama3", "csd"),
    "domain-teacher": ("ce", "kd", "ce-llama3", "csd"),
    "transfer": ("ce-llama3", "csd"),
}
MAX_LENGTH = 128
"""Tokens per training row and per row of the held-out set that picks the best checkpoint."""
SCORED_LENGTH = 2048
"""Tokens per row of the held-out sets the best checkpoints and references are scored on: every
document fits whole, so all of its bytes are scored (the documents are about ``3 * MAX_LENGTH``
bytes; the longest held-out one is 5.2 kB, 1,338 SmolLM2 tokens)."""
FULL = {
    "corpus_bytes": 62_000,
    "ood_bytes": 31_000,
    "numbers_bytes": 30_000,
    "teacher_bytes": 700_000,
    "layers": 10,
    "passes": 3,
    "seeds": 3,
    "teacher_steps": None,  # one pass over the teacher's rows
}
QUICK = {
    "corpus_bytes": 6_000,
    "ood_bytes": 3_000,
    "numbers_bytes": 3_000,
    "teacher_bytes": 24_000,
    "layers": 3,
    "passes": 1,
    "seeds": 1,
    "teacher_steps": 2,
}
TRAIN = {
    "micro_batch_rows": 4,
    "lr": 3e-4,
    "warmup_steps": 4,
    "checkpoint_every": 0,
}


def run(setting: str, arms: list[str], quick: bool, seeds: int | None, out: Path) -> dict:
    """One pretrained setting (module docstring), every arm of ``arms`` on each seed; returns
    the results: per arm and seed the best checkpoint's held-out bits per byte in and out of
    domain, each document's bits and bytes, the held-out curve; the references (teacher, the
    student on each tokenizer an arm uses)."""
    size = dict(QUICK if quick else FULL)
    started = time.perf_counter()
    work = out / "work"
    layers = None if setting == "transfer" else size["layers"]
    teacher = (
        domain_teacher(work, size["teacher_bytes"], size["teacher_steps"])
        if setting == "domain-teacher"
        else "zoo:smollm2"
    )
    results: dict = {"setting": setting, "arms": {}, "reference": {}, "config": {**size}}
    numbers = write_rows(work / "inputs" / "numbers.jsonl", size["numbers_bytes"])
    results["config"] |= {"train": TRAIN, "teacher": teacher, "student_layers": layers}
    for mode in ("own", "llama3"):
        wanted = [a for a in arms if ARMS[a].tokenizer == mode]
        if not wanted and mode == "llama3":
            continue
        base = _base(work, teacher, mode, size, layers)
        plan = steps.init_student(steps.validate_inputs(base))
        prepared = steps.prepare_data(plan, **base.preparing(), progress=False)
        scoring = {**base.preparing(), "max_length": SCORED_LENGTH}
        scored = steps.prepare_data(plan, **scoring, progress=False)
        with_numbers = {**plan, "ood_data": str(numbers)}
        scored["numbers"] = steps.prepare_data(with_numbers, **scoring, progress=False)["ood"]
        references = {f"student_init_{mode}": plan["student"]} if wanted else {}
        if mode == "own":
            references["teacher"] = plan["teachers"][0]["ref"]
        results["reference"] |= _evaluate(
            scored, references, out / "references" / setting / mode, base
        )
        if not wanted:
            continue
        tables = checked_tables(plan, progress=False)
        caches: dict[tuple, list[dict]] = {}
        per_pass = math.ceil(prepared["rows"]["train"] / TRAIN["micro_batch_rows"])
        results["config"][f"rows_{mode}"] = prepared["rows"]
        results["config"]["steps_per_pass"] = per_pass
        for seed in range(seeds or size["seeds"]):
            for arm in wanted:
                name = arm if ARMS[arm].loss is None and layers else f"{setting}-{arm}"
                folder = out / "runs" / f"{name}-seed{seed}"
                config = replace(base, seed=seed, **ARMS[arm].scoring)
                scoring = config.scoring()
                key = tuple(sorted(scoring.items()))
                if key not in caches and not (folder / "arm.json").exists():
                    caches[key] = teacher_caches(plan, prepared, scoring, 1, progress=False)
                record = _arm(
                    config,
                    plan,
                    (prepared, scored, tables, caches.get(key, [])),
                    ARMS[arm],
                    folder,
                    per_pass,
                    ARMS[arm].budget * size["passes"],
                )
                results["arms"].setdefault(arm, []).append(record)
                log.info(
                    "%s %s seed %d: best step %d, in-domain %.4f, out-of-domain %.4f (%.0f s)",
                    setting,
                    arm,
                    seed,
                    record["best_step"],
                    record["in_domain"],
                    record["ood"],
                    record["seconds"],
                )
    results["wall_seconds"] = time.perf_counter() - started
    return results


def _base(work: Path, teacher: str, mode: str, size: dict, layers: int | None) -> RunConfig:
    """The run config of the arms on tokenizer ``mode`` (``own`` or ``llama3``: moved), the
    student SmolLM2-135M-Instruct cut to ``layers`` decoder layers (None: whole)."""
    moved = mode == "llama3"
    return RunConfig(
        output=str(work),
        teachers=[teacher],
        student="zoo:smollm2",
        student_layers=layers,
        student_tokenizer="zoo:llama3",
        transplant={"method": "tuned"} if moved else None,
        corpus_bytes=size["corpus_bytes"],
        heldout_every=2,
        ood_data="machine:licences",
        ood_bytes=size["ood_bytes"],
        max_length=MAX_LENGTH,
        k=32,
        train={**TRAIN, "loss": {}},
        token_budget=2048,
        device="cpu",
    )


def domain_teacher(work: Path, corpus_bytes: int, steps_: int | None) -> str:
    """SmolLM2-135M-Instruct trained with CE on the training half of ``corpus_bytes`` of the
    standard-library corpus (every second document held out, as the student's corpus is: the
    student's corpus is this one's first documents, so its held-out documents are held out here
    too), one pass (or ``steps_`` steps), lr 2e-4; written once under
    ``<work>/inputs/domain-teacher``; returns the model folder."""
    folder = work / "inputs" / "domain-teacher"
    model = folder / "final"
    if (model / "config.json").exists():
        return str(model)
    micro = 8
    config = RunConfig(
        output=str(work),
        teachers=["zoo:smollm2"],
        student="zoo:smollm2",
        corpus_bytes=corpus_bytes,
        heldout_every=2,
        max_length=128,
        k=1,
        train={
            "micro_batch_rows": micro,
            "lr": 2e-4,
            "warmup_steps": 10,
            "checkpoint_every": 50,
            "keep_checkpoints": 1,
        },
        device="cpu",
    )
    # The trainer reads a teacher cache even for CE only: a K = 1 one, which the run ignores.
    plan = steps.validate_inputs(config)
    prepared = steps.prepare_data(plan, **config.preparing(), progress=False)
    caches = teacher_caches(plan, prepared, config.scoring(), 1, progress=False)
    rows = prepared["rows"]["train"]
    config = replace(config, train={**config.train, "steps": steps_ or math.ceil(rows / micro)})
    tables = checked_tables(plan, progress=False)
    items = steps.plan_training(config, plan, prepared, tables, caches, str(folder))
    (item,) = [i for i in items if i["variant"] == "ce"]
    item["train"]["output"] = str(folder)
    log.info("domain teacher: %d rows of %d bytes of text", rows, corpus_bytes)
    steps.train(item, executor="inprocess", progress=True)
    (folder / "teacher.json").write_text(json.dumps({"corpus_bytes": corpus_bytes, "rows": rows}))
    return str(model)


def _evaluate(prepared: dict, models: dict[str, str], folder: Path, base: RunConfig) -> dict:
    """``{name: [{"in_domain", "ood", "numbers", "digits", "sequences": {split: {"bits",
    "bytes"}}}]}`` of each model on the held-out sets (:func:`_score`)."""
    _score(prepared, models, folder, base)
    return {name: [_figures(folder, name)] for name in models}


def _score(prepared: dict, models: dict[str, str], folder: Path, base: RunConfig) -> None:
    """Each model's evaluation on both held-out sets and on the arithmetic text
    (``prepared["numbers"]``), every token and the digits alone, under ``folder``
    (:data:`FILES`); an evaluation already there is kept."""
    options = {"token_budget": base.token_budget, "device": "cpu"}
    steps.evaluate_run(prepared, models, str(folder), **options)
    for tokens, file in (("all", FILES["numbers"]), ("digits", FILES["digits"])):
        evaluate_models(prepared["numbers"], models, str(folder / file), tokens=tokens, **options)


def _figures(folder: Path, name: str) -> dict:
    """One model's bits per byte and per-document bits, bytes and sample ids (the order of
    each prepared set's samples depends on its tokenizer's packing) from ``evaluate_run``'s
    files under ``folder``."""
    record: dict = {"sequences": {}}
    for split, file in FILES.items():
        evaluation = json.loads((folder / file).read_text())
        entry = evaluation["models"][name]
        data = load_prepared(evaluation["data"])
        record[split] = entry["bits_per_byte"]
        record["sequences"][split] = {
            "ids": [s["sample_id"] for row in data.packed_rows() for s in row],
            "bits": entry["sequence_bits"],
            "bytes": entry["sequence_bytes"],
        }
    return record


def _arm(
    config: RunConfig,
    plan: dict,
    inputs: tuple[dict, dict, list[dict], list[dict]],
    arm: Arm,
    folder: Path,
    per_pass: int,
    passes: int,
) -> dict:
    """Train one ``arm`` for ``passes`` passes of ``per_pass`` steps with an evaluation on the
    training-length held-out rows every half pass, then evaluate its best checkpoint
    on the whole-document held-out sets (``scored``); returns its record. A finished arm's
    training record (``<folder>/arm.json``) and evaluation (``<folder>/scored-<length>``) are
    read back instead. Of the run's files the best checkpoint and the metrics are kept (the last
    checkpoint and the final model are removed: 1 to 3 GB an arm)."""
    prepared, scored, tables, caches = inputs
    eval_every = math.ceil(per_pass / 2)
    done = folder / "arm.json"
    if not done.exists():
        train = {
            **config.train,
            "steps": per_pass * passes,
            "eval_data": prepared["heldout"],
            "eval_every": eval_every,
            "loss": {**config.train.get("loss", {}), **(arm.loss or {})},
            **{key: math.ceil(share * per_pass) for key, share in arm.in_passes.items()},
        }
        if "first_steps" in arm.in_passes:
            train["first_trainable"] = EMBEDDINGS
        sources = caches
        if arm.on_policy is not None:
            train["on_policy"] = arm.on_policy
            config = replace(config, teacher_scoring="online")
            sources = steps.online_teachers(plan)
        config = replace(config, train=train)
        items = steps.plan_training(config, plan, prepared, tables, sources, str(folder))
        item = next(i for i in items if i["variant"] == ("ce" if arm.loss is None else "kd"))
        tick = time.perf_counter()
        steps.train(item, executor="inprocess", progress=False)
        history = run_history(str(_output(folder)))
        curve = [
            (h["step"], h["heldout_bits_per_byte"]) for h in history if "heldout_bits_per_byte" in h
        ]
        record = {
            "seed": config.seed,
            "best_step": min(curve, key=lambda c: c[1])[0],
            "curve": curve,
            "ce": [h["ce"] for h in history],
            "seconds": time.perf_counter() - tick,
        }
        done.write_text(json.dumps(record))
        for name in ("checkpoints", "final"):  # 1-3 GB an arm; the report reads best/
            shutil.rmtree(_output(folder) / name, ignore_errors=True)
    _score(scored, {"student": str(_output(folder) / "best")}, _scored(folder), config)
    return {**json.loads(done.read_text()), **_outcome(folder, eval_every)}


def _scored(folder: Path) -> Path:
    """Where an arm's best checkpoint's evaluation on the :data:`SCORED_LENGTH` sets goes."""
    return folder / f"scored-{SCORED_LENGTH}"


def _output(folder: Path) -> Path:
    """The training run's output folder under an arm's ``folder``."""
    (output,) = [p for p in folder.iterdir() if (p / "metrics-rank0.jsonl").exists()]
    return output


def _outcome(folder: Path, eval_every: int) -> dict:
    """What the report reads from an arm's files: its best checkpoint's figures
    (:func:`_figures`) and, for a cross-tokenizer run, per chunk shape (``1:1``, ``1:n``, ...)
    its chunks and share of the KD term, mean over the last ``eval_every`` steps."""
    last = run_history(str(_output(folder)))[-eval_every:]
    shapes = sorted(
        {k.split("/")[1] for k in last[-1] if k.startswith("teacher0/") and k.count("/") == 2}
    )
    per_shape = {
        shape: {
            stat: statistics.fmean(h.get(f"teacher0/{shape}/{stat}", 0.0) for h in last)
            for stat in ("chunks", "kd_share")
        }
        for shape in shapes
    }
    return {**_figures(_scored(folder), "student"), "shapes": per_shape}


COMPARISONS = (  # (arm, against): the paired tests the report prints, each on one tokenizer
    ("kd", "ce"),
    ("csd", "ce-llama3"),
    ("uld", "ce-llama3"),
    ("kd-only", "ce"),
    ("csd-only", "ce-llama3"),
    ("csd-mw1", "ce-llama3"),
    ("csd-mw1", "csd"),
    ("csd-kd-warmup", "csd"),
    ("csd-embeddings-first", "csd"),
    ("csd-on-policy", "csd"),
    ("csd-static-scale", "csd"),
    ("csd-k8", "csd"),
    ("csd-k128", "csd"),
    ("csd-tau2", "csd"),
    ("ce-llama3-long", "ce-llama3"),
    ("csd-mw1-long", "ce-llama3-long"),
    ("csd-mw1-long", "csd-mw1"),
    ("xtoken", "ce-llama3"),
    ("xtoken", "csd"),
    ("xtoken", "csd-mw1"),
    ("gold", "ce-llama3"),
    ("gold", "csd-mw1"),
    ("gold", "xtoken"),
    ("hkl", "ce-llama3"),
    ("hkl", "csd"),
    ("hkl", "csd-mw1"),
    ("hkl", "gold"),
)
"""Arms are compared only with arms on the same tokenizer: two tokenizers' held-out sets score
different bytes of the same documents (a tokenizer without BOS, SmolLM2's, leaves each
document's first token unscored), so a difference across tokenizers is partly a difference of
text."""
SPLITS = (("in_domain", "in domain"), ("ood", "out of domain"))
FILES = {
    "in_domain": "evaluation.json",
    "ood": "evaluation_ood.json",
    "numbers": "evaluation_numbers.json",
    "digits": "evaluation_numbers_digits.json",
}
"""Each figure of a model and the evaluation file under its folder it comes from: in domain,
out of domain, the arithmetic text (:mod:`arithmetic_text`) whole and its digits alone."""
NUMBERS = (("numbers", "arithmetic text"), ("digits", "its digits alone"))
KINDS = ("code", "prose", "translations")
"""The corpus deals documents from its three streams in turn (:func:`crosskd.alignment.corpus
.benchmark_corpus`, while all three last, as they do at these sizes): held-out document ``j``
(every second) is corpus document ``2j``, of kind ``2j mod 3``."""


def _init_of(arm: str) -> str:
    return f"student_init_{ARMS[arm].tokenizer}"


def _mean_sd(values: list[float]) -> str:
    mean = statistics.fmean(values)
    return f"{mean:.4f} ± {statistics.stdev(values):.4f}" if len(values) > 1 else f"{mean:.4f}"


def _cell(d: PairedDifference) -> str:
    """A comparison's table cell: difference, relative, 95% interval, p-value."""
    return f"{d.difference:+.4f} ({d.relative:+.1%}) [{d.low:+.4f}, {d.high:+.4f}] {_p(d)}"


def _p(d: PairedDifference) -> str:
    """The p-value, or its floor when no resample reached zero."""
    floor = 2 / (d.samples + 1)
    return f"p<={floor:.1g}" if d.p_value <= floor else f"p={d.p_value:.2g}"


def table(results: dict) -> str:
    """The report as Markdown: each arm's best-checkpoint bits per byte (mean ± sample sd over
    seeds, each seed's value), the share of its initialisation-to-teacher gap it closes, the
    bytes each tokenizer's held-out sets score; the paired bootstrap of each comparison of
    :data:`COMPARISONS` present; each distilled arm's relative gain over its CE-only twin; the
    in-domain figures by kind of text; CSD's KD term by chunk shape."""
    arms, refs = results["arms"], results["reference"]
    lines = [
        f"**{results['setting']}**: best checkpoint by in-domain held-out bits per byte",
        "",
        "| arm | in domain | per seed | gap closed | out of domain | per seed | gap closed "
        "| best step |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, runs in refs.items():
        lines.append(f"| {name} | {runs[0]['in_domain']:.4f} | | | {runs[0]['ood']:.4f} | | | |")
    for arm, runs in arms.items():
        cells = [arm]
        for split, _ in SPLITS:
            values = [r[split] for r in runs]
            init, teacher = refs[_init_of(arm)][0][split], refs["teacher"][0][split]
            closed = (init - statistics.fmean(values)) / (init - teacher)
            cells += [_mean_sd(values), ", ".join(f"{v:.4f}" for v in values), f"{closed:.0%}"]
        cells.append(", ".join(str(r["best_step"]) for r in runs))
        lines.append("| " + " | ".join(cells) + " |")
    scored = {
        name: {split: sum(runs[0]["sequences"][split]["bytes"]) for split, _ in SPLITS}
        for name, runs in refs.items()
    }
    lines += [
        "",
        "Bytes scored (the teacher's: on its own tokenizer's set): "
        + "; ".join(f"{n} {b['in_domain']} / {b['ood']}" for n, b in scored.items())
        + ". Gap closed is measured against that teacher figure.",
        "",
        "Paired bootstrap over documents (10,000 resamples, seeds averaged), arms on the same "
        "tokenizer: difference in bits per byte (negative: the first arm is better), relative, "
        "95% interval, p-value.",
        "",
        "| comparison | in domain | out of domain |",
        "|---|---|---|",
    ]
    gains = {}
    for arm, other in COMPARISONS:
        if arm in arms and other in arms:
            cells = [f"{arm} vs {other}"]
            for split, label in SPLITS:
                d = compare(arms[arm], arms[other], split)
                if ARMS[arm].loss is not None and ARMS[other].loss is None:  # its CE twin
                    gains.setdefault(arm, []).append(f"{label} {-d.relative:.1%}")
                cells.append(_cell(d))
            lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Relative gain over the CE-only twin on the same tokenizer:"]
    lines += [f"* {arm}: {', '.join(values)}" for arm, values in gains.items()]
    lines += _numbers(results)
    lines += ["", "In-domain bits per byte by kind of text (mean over seeds):", ""]
    lines += [f"* {arm}: {_by_kind(runs)}" for arm, runs in arms.items()]
    for arm in ("csd", "csd-only"):
        if arm in arms:
            lines += [
                "",
                f"{arm} (seed {arms[arm][0]['seed']}), the last half pass: {_shapes(arms[arm][0])}",
            ]
    return "\n".join(lines)


def _numbers(results: dict) -> list[str]:
    """The report's lines on the arithmetic text (:mod:`arithmetic_text`): each reference's and
    arm's bits per byte on it whole and on its digits alone (mean ± sample sd, each seed), the
    digits scored per tokenizer, and the paired bootstrap of each comparison of
    :data:`COMPARISONS` on both; nothing when a run has no such figures."""
    arms, refs = results["arms"], results["reference"]
    runs = [r for group in (*arms.values(), *refs.values()) for r in group]
    if not runs or not all("digits" in r for r in runs):
        return []
    lines = [
        "",
        "Arithmetic text (worked sums, a quarter of its bytes digits; `benchmarks/"
        "arithmetic_text.py`), best checkpoints: bits per byte of the text and of its digits "
        "alone (the tokens spelled by digits; Llama-3 packs up to three, SmolLM2 has one a "
        "token).",
        "",
        "| arm | arithmetic text | per seed | its digits | per seed |",
        "|---|---|---|---|---|",
    ]
    for name, group in (*refs.items(), *arms.items()):
        cells = [name]
        for split, _ in NUMBERS:
            values = [r[split] for r in group]
            cells += [
                _mean_sd(values),
                ", ".join(f"{v:.4f}" for v in values) if name in arms else "",
            ]
        lines.append("| " + " | ".join(cells) + " |")
    digit_bytes = {n: sum(g[0]["sequences"]["digits"]["bytes"]) for n, g in refs.items()}
    lines += [
        "",
        "Bytes scored, text / digits: "
        + "; ".join(
            f"{n} {sum(g[0]['sequences']['numbers']['bytes'])} / {digit_bytes[n]}"
            for n, g in refs.items()
        )
        + ".",
        "",
        "| comparison | arithmetic text | its digits |",
        "|---|---|---|",
    ]
    for arm, other in COMPARISONS:
        if arm in arms and other in arms:
            cells = [f"{arm} vs {other}"]
            for split, _ in NUMBERS:
                d = compare(arms[arm], arms[other], split)
                cells.append(_cell(d))
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def _by_kind(runs: list[dict]) -> str:
    """In-domain bits per byte of each of :data:`KINDS`, mean over seeds."""
    figures = []
    for k, kind in enumerate(KINDS):
        values = []
        for run in runs:
            s = run["sequences"]["in_domain"]
            picked = [
                (b, n)
                for i, b, n in zip(s["ids"], s["bits"], s["bytes"], strict=True)
                if 2 * int(i.rsplit("-", 1)[1]) % 3 == k
            ]
            values.append(sum(b for b, _ in picked) / sum(n for _, n in picked))
        figures.append(f"{kind} {statistics.fmean(values):.4f}")
    return ", ".join(figures)


def _shapes(run: dict) -> str:
    """Per chunk shape of a cross-tokenizer run: its share of the chunks and of the KD term,
    mean over the steps of the last half pass."""
    last = run["shapes"]
    total = sum(v["chunks"] for v in last.values())
    return "; ".join(
        f"{shape} {v['chunks'] / total:.0%} of the chunks, {v['kd_share']:.0%} of the KD term"
        for shape, v in last.items()
    )


def compare(runs_a: list[dict], runs_b: list[dict], split: str) -> PairedDifference:
    """The paired bootstrap (:func:`crosskd.paired.paired_bootstrap`) of two arms on one
    held-out set (a key of :data:`FILES`): seeds matched by position, documents by sample id.
    Arms with different seed counts, or whose documents or bytes differ (two tokenizers' sets),
    are a ConfigError."""
    if len(runs_a) != len(runs_b):
        raise ConfigError(
            f"the arms have {len(runs_a)} and {len(runs_b)} seeds; compare runs of the same seeds."
        )
    first = runs_a[0]["sequences"][split]
    order = first["ids"]
    want = dict(zip(order, first["bytes"], strict=True))

    def stack(runs: list[dict], key: str) -> list[list[float]]:
        rows = []
        for run in runs:
            sequences = run["sequences"][split]
            if dict(zip(sequences["ids"], sequences["bytes"], strict=True)) != want:
                raise ConfigError(
                    f"{split}: the arms score other documents or bytes (two tokenizers' held-out "
                    f"sets); compare arms on the same tokenizer."
                )
            by_id = dict(zip(sequences["ids"], sequences[key], strict=True))
            rows.append([by_id[i] for i in order])
        return rows

    return paired_bootstrap(
        stack(runs_a, "bits"), stack(runs_a, "bytes"), stack(runs_b, "bits"), stack(runs_b, "bytes")
    )


def plot(results: dict, path: Path) -> None:
    """Each arm's held-out curve against steps (mean over seeds), one plot: bits per byte on the
    set that picks the best checkpoint (the in-domain documents clipped to rows of
    :data:`MAX_LENGTH` tokens: other bytes than the table's whole documents, so other
    values)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, runs in results["arms"].items():
        steps_ = [s for s, _ in runs[0]["curve"]]
        curves = [[b for _, b in r["curve"]] for r in runs]
        mean = [statistics.fmean(v) for v in zip(*curves, strict=True)]
        ax.plot(steps_, mean, marker="o", label=name)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(f"in-domain held-out bits per byte ({MAX_LENGTH}-token rows)")
    ax.set_title(f"crosskd quality, {results['setting']}: mean over seeds")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
