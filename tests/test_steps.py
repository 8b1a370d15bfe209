"""The step functions (:mod:`crosskd.steps`) that the components, ``crosskd distill`` and the
local pipeline call: planning invariants, content addresses, the held-out split, merging scored
ranges (and refusing gaps), up-front validation, and ``crosskd distill`` on user inputs (a
pretrained student, two teachers of which one shares the student's tokenizer, a JSONL file with a
held-out fraction)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from crosskd import steps
from crosskd.errors import ConfigError, CrosskdError
from crosskd.steps.prepare import held_out
from crosskd.steps.train import run_history


@given(shards=st.integers(1, 60), pods=st.integers(1, 20), teachers=st.integers(1, 3))
def test_scoring_ranges_cover_every_shard_once_per_teacher(shards, pods, teachers):
    plan = {"root": "r", "teachers": [{"index": i, "ref": f"t{i}"} for i in range(teachers)]}
    jobs = steps.plan_scoring(plan, {"train": "d", "train_shards": shards}, {"k": 4}, pods)
    for i in range(teachers):
        ranges = [(j["start"], j["stop"]) for j in jobs if j["teacher"]["index"] == i]
        assert len(ranges) == min(pods, shards)
        assert ranges[0][0] == 0 and ranges[-1][1] == shards
        assert all(a < b for a, b in ranges)
        assert all(ranges[n][1] == ranges[n + 1][0] for n in range(len(ranges) - 1))
        sizes = [b - a for a, b in ranges]
        assert max(sizes) - min(sizes) <= 1


def test_content_uri_depends_on_the_key_only():
    a = steps.content_uri("s3://b/root/", "tables", {"student": "x", "teacher": "y"})
    assert a == steps.content_uri("s3://b/root", "tables", {"teacher": "y", "student": "x"})
    assert a.startswith("s3://b/root/tables/") and len(a.rsplit("/", 1)[1]) == 20
    assert a != steps.content_uri("s3://b/root", "tables", {"student": "x", "teacher": "z"})
    assert steps.run_folder("s3://b/root/", "1234") == "s3://b/root/runs/1234"
    with pytest.raises(ConfigError, match="run id"):
        steps.run_folder("r", "a/b")


@given(
    ids=st.lists(st.text(min_size=1, max_size=12), min_size=1, max_size=40, unique=True),
    fraction=st.floats(0.01, 0.99),
)
def test_held_out_rows_do_not_depend_on_order(ids, fraction):
    chosen = {i for i in ids if held_out(i, fraction)}
    assert chosen == {i for i in reversed(ids) if held_out(i, fraction)}
    assert all(held_out(i, 1.0) for i in ids) and not any(held_out(i, 0.0) for i in ids)


def _part(start: int, stop: int, total: int, **extra) -> dict:
    header = {
        "teacher": {"name": "t", "fingerprint": "f", "vocab_size": 5},
        "tokenizer": {"name": "t", "fingerprint": "g"},
        "data": {"uri": "d", "fingerprint": "h", "teacher": "teacher0"},
        "config": {"k": 4, "tau": 1.0, "encoding": "lossless"},
    }
    digest = extra.pop("sha256", None)  # every shard's digest (default: its index)
    shards = [
        {
            "path": f"part-{i:05d}.parquet",
            "samples": 1,
            "tokens": 10 * (i + 1),
            "sha256": digest or str(i),
            "bytes": 100,
            "nll_bits": 8.0,
            "predicted_bytes": 4,
        }
        for i in range(start, stop)
    ]
    return {
        "start": start,
        "stop": stop,
        "total": total,
        **header,
        "shards": shards,
        "samples": stop - start,
    } | extra


def _write_parts(folder: Path, parts: list[dict]) -> str:
    (folder / "parts").mkdir(parents=True)
    for p in parts:
        (folder / "parts" / f"{p['start']:05d}-{p['stop']:05d}.json").write_text(json.dumps(p))
    return str(folder)


def test_merging_scored_ranges_writes_one_manifest(tmp_path):
    uri = _write_parts(tmp_path / "c", [_part(2, 3, 3), _part(0, 2, 3)])
    (merged,) = steps.merge_caches([{"index": 0, "cache": uri}, {"index": 0, "cache": uri}])
    manifest = json.loads((tmp_path / "c" / "manifest.json").read_text())
    assert [s["path"] for s in manifest["shards"]] == [f"part-{i:05d}.parquet" for i in range(3)]
    assert manifest["tokens"] == 10 + 20 + 30 == merged["tokens"]
    assert manifest["bits_per_byte"] == pytest.approx(24.0 / 12) == merged["bits_per_byte"]
    assert manifest["samples"] == 3
    assert (manifest["k"], manifest["tau"], manifest["encoding"]) == (4, 1.0, "lossless")


def test_ranges_split_otherwise_by_a_rerun_merge_once_per_shard(tmp_path):
    """0..1 from one run, 1..2 from a rerun split otherwise: shard 1 counted once."""
    uri = _write_parts(tmp_path / "c", [_part(0, 2, 3), _part(1, 3, 3)])
    (merged,) = steps.merge_caches([{"index": 0, "cache": uri}])
    assert merged["tokens"] == 10 + 20 + 30
    assert merged["bits_per_byte"] == pytest.approx(24.0 / 12)


@pytest.mark.parametrize(
    "parts, message",
    [
        ([(0, 1), (2, 3)], r"shards 1..1 are not scored yet"),
        ([(0, 2), (1, 3, "other")], r"shard 1 is recorded twice with different digests"),
        ([(0, 2)], r"shards 2..2 are not scored yet"),
        ([(0, 1)], r"shards 1..2 are not scored yet"),
    ],
)
def test_merging_refuses_gaps_overlaps_and_missing_ranges(tmp_path, parts, message):
    uri = _write_parts(
        tmp_path / "c", [_part(a, b, 3, **({"sha256": p[0]} if p else {})) for a, b, *p in parts]
    )
    with pytest.raises(CrosskdError, match=message):
        steps.merge_caches([{"index": 0, "cache": uri}])
    assert not (tmp_path / "c" / "manifest.json").exists()


def test_merging_refuses_ranges_of_another_teacher(tmp_path):
    other = {"teacher": {"name": "t", "fingerprint": "OTHER", "vocab_size": 5}}
    uri = _write_parts(tmp_path / "c", [_part(0, 1, 2), _part(1, 2, 2, **other)])
    with pytest.raises(CrosskdError, match="scored with another teacher"):
        steps.merge_caches([{"index": 0, "cache": uri}])


@pytest.mark.parametrize(
    "options, message",
    [
        ({"stepz": 3}, r"options: unknown key\(s\) stepz"),
        ({"train": {"steps": 3}}, r"options sets train\.steps, which the pipeline takes as "),
        ({"steps": 3}, r"options: unknown key\(s\) steps; known keys: .*, train, "),
        ({"train": {"stepz": 3}}, r"train: unknown key\(s\) stepz; known keys: "),
        ({"train": {"seed": 3}}, r"train: unknown key\(s\) seed; .*\(the run sets student, "),
        ({"train": {"lr": "fast"}}, r"train: lr is 'fast'"),
        ({"train": {"loss": {"tau": 2.0}}}, r"train\.loss\.tau is set; the run sets it"),
        ({"max_length": 0}, r"max_length is 0; it must be an integer >= 1"),
        ({"train": {"loss": {"kd_weight": -1}}}, r"train: loss\.kd_weight"),
        ({"student_shape": {"layers": 4}}, r"student_shape has unknown key\(s\) layers; known: "),
        ({"teacher_shape": [64]}, r"teacher_shape is \[64\]; it must be a mapping"),
        ({"student_shape": {"hidden_size": 0}}, r"student_shape.hidden_size is 0; it must be a "),
        ({"train": {"loss": {"kd": "uldx"}}}, r"kd is 'uldx'; choose one of csd, uld"),
        ({"pack": "no"}, r"pack is 'no'; write true or false"),
    ],
)
def test_pipeline_options_are_refused_by_name(options, message):
    with pytest.raises(ConfigError, match=message):
        steps.run_config_from_parameters({"output": "o", "train": {"steps": 2}}, options)


def test_every_shipped_preset_is_a_valid_run_config():
    """Each preset's keys build a RunConfig (every training and transplant key checked)."""
    from crosskd.steps.config import PRESETS

    for name in PRESETS:
        config = steps.load_run_config(None, name, ["output=o"])
        assert config.output == "o"
    transfer = steps.load_run_config(None, "transfer", ["output=o", "transplant.method=mean"])
    assert transfer.transplant == {"method": "mean"}
    assert transfer.student == transfer.teachers[0] == "zoo:smollm2"


def test_run_config_nests_the_training_keys(tmp_path):
    """``train`` holds TrainConfig keys: ``train.KEY=VALUE`` overrides merge into it at any depth,
    a key left out takes TrainConfig's default, and what the run sets (student, data, output,
    teachers, seed, the loss's tau and teacher entries) comes from the run."""
    preset = steps.load_run_config(None, "tiny", ["output=o", "train.loss.kd_weight=0.5"])
    assert preset.train == {
        "steps": 12,
        "micro_batch_rows": 4,
        "lr": 0.003,
        "warmup_steps": 2,
        "loss": {"dynamic_kd_scale": True, "kd_weight": 0.5},
    }
    file = tmp_path / "run.yaml"
    file.write_text("train: {steps: 5}\nseed: 3\ntau: 2.0\n")
    config = steps.load_run_config(str(file), "tiny", ["output=o"])
    assert config.train["steps"] == 5 and config.train["lr"] == 0.003  # merged, not replaced
    values = config.train_values(
        student="s",
        data="d",
        output="out",
        caches=["c"],
        tables=[{"s2t": "a", "t2s": "b"}],
        kd=False,
    )
    assert values["seed"] == 3 and values["steps"] == 5 and "grad_accum" not in values
    assert values["loss"] == {
        "dynamic_kd_scale": False,
        "kd_weight": 0.0,
        "tau": 2.0,
        "teachers": [{"k": 16, "student_to_teacher": "a", "teacher_to_student": "b"}],
    }
    assert (values["student"], values["data"], values["output"], values["teachers"]) == (
        "s",
        "d",
        "out",
        ["c"],
    )
    xtoken = replace(config, algorithms=["xtoken"])
    tables = [{"s2t": "a", "t2s": "b", "projection": "w"}]
    values = xtoken.train_values(
        student="s", data="d", output="out", caches=["c"], tables=tables, kd=True
    )
    assert values["loss"]["teachers"] == [
        {
            "k": 16,
            "student_to_teacher": "a",
            "teacher_to_student": "b",
            "algorithm": "xtoken",
            "projection": "w",
        }
    ]
    with pytest.raises(ConfigError, match=r"algorithms is \['csd', 'csd'\]; give one .* \(1\)"):
        replace(config, algorithms=["csd", "csd"])
    with pytest.raises(ConfigError, match=r"teachers\[0\].algorithm is 'GOLD'"):
        replace(config, algorithms=["GOLD"])
    with pytest.raises(ConfigError, match=r"train is \[3\]; give a mapping of TrainConfig keys"):
        steps.RunConfig(output="o", train=[3])
    with pytest.raises(CrosskdError, match=r"override 'train.steps.x=1'"):
        steps.load_run_config(None, "tiny", ["output=o", "train=3", "train.steps.x=1"])


def test_validate_inputs_fails_fast_naming_the_input(tmp_path):
    config = steps.RunConfig(
        output=str(tmp_path),
        teachers=["init"],
        student="init",
        train_data=str(tmp_path / "missing.jsonl"),
    )
    with pytest.raises(ConfigError, match=r"train_data .*missing\.jsonl: no such file"):
        steps.validate_inputs(config)
    with pytest.raises(ConfigError, match="executor is 'kubernetes'; choose one of"):
        steps.validate_inputs(config, executor="kubernetes")
    with pytest.raises(ConfigError, match="gpus_per_node is -1"):
        steps.validate_inputs(config, job={"image": "i", "gpus_per_node": -1}, executor="local")
    with pytest.raises(ConfigError, match="job_kind is 'mpijob'; choose one of pytorchjob, train"):
        steps.validate_inputs(config, job={"image": "i"}, executor="local", job_kind="mpijob")
    # What a TrainJob cannot carry is refused before any work, as the job_kind it is for.
    with pytest.raises(ConfigError, match="metrics_port is 9500; the crosskd-torch runtime"):
        steps.validate_inputs(
            config, job={"image": "i", "metrics_port": 9500}, executor="local", job_kind="trainjob"
        )
    # The training layout must fit the job's workers (or the one in-process worker).
    sharded = replace(config, train={"parallel": {"dp_shard": 4}})
    with pytest.raises(
        ConfigError,
        match=r"parallel \{'dp_shard': 4\} does not fit this job's "
        r"1 node\(s\) x 2 process\(es\) = 2",
    ):
        steps.validate_inputs(sharded, job={"image": "i", "gpus_per_node": 2}, executor="local")
    with pytest.raises(
        ConfigError,
        match=r"does not divide the 1 processes.*In-process training "
        r"is one process",
    ):
        steps.validate_inputs(sharded)
    with pytest.raises(ConfigError, match=r"teacher 0: .*nowhere"):
        steps.validate_inputs(
            steps.RunConfig(output=str(tmp_path), teachers=[str(tmp_path / "nowhere")])
        )


def test_a_student_that_cannot_pack_is_refused_before_any_data_is_prepared(train_inputs, tmp_path):
    """A pretrained LFM2 student (short convolutions) with packed rows: refused by the
    validation step from its config.json alone, naming the model type and ``pack: false``;
    with ``pack: false`` the run validates and its data is prepared one sample per row."""
    import transformers

    from crosskd.tokenization import load_tokenizer

    folder = tmp_path / "lfm2"
    vocab = transformers.AutoConfig.from_pretrained(train_inputs["student"]).vocab_size
    transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(
            "lfm2",
            vocab_size=vocab,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            layer_types=["conv", "full_attention"],
        )
    ).save_pretrained(folder)
    load_tokenizer(train_inputs["student"]).hf.save_pretrained(str(folder))
    data = Path(train_inputs["student"]).parent / "data.jsonl"
    config = steps.RunConfig(
        output=str(tmp_path / "run"),
        teachers=[train_inputs["teacher"]],
        student=str(folder),
        train_data=str(data),
        max_length=48,
    )
    with pytest.raises(
        ConfigError,
        match=r"^lfm2 \(Lfm2ForCausalLM\) .*layer type 'conv'.*"
        r"packed rows of student .*set pack: false",
    ):
        steps.validate_inputs(config)
    assert not (tmp_path / "run" / "prepared").exists()
    unpacked = replace(config, pack=False)
    prepared = steps.prepare_data(
        steps.validate_inputs(unpacked), **unpacked.preparing(), progress=False
    )
    manifest = json.loads((Path(prepared["train"]) / "manifest.json").read_text())
    assert manifest["packing"]["packed"] is False
    assert manifest["packing"]["bins"] == manifest["rows"]


def test_the_machine_licence_text_is_resolved_once_under_a_content_address(tmp_path):
    from crosskd.alignment.corpus import licence_documents

    config = steps.RunConfig(
        output=str(tmp_path),
        teachers=["init"],
        corpus_bytes=3000,
        teacher_tokenizer="tiny:300",
        student_tokenizer="tiny:280",
        ood_data="machine:licences",
        ood_bytes=2000,
    )
    plan = steps.validate_inputs(config)
    rows = [json.loads(x) for x in Path(plan["ood_data"]).read_text().splitlines()]
    assert [r["text"] for r in rows] == licence_documents(2000, document_bytes=3 * 256)
    assert len({r["id"] for r in rows}) == len(rows)
    assert steps.validate_inputs(config)["ood_data"] == plan["ood_data"]
    assert steps.validate_inputs(replace(config, ood_bytes=3000))["ood_data"] != plan["ood_data"]
    without = steps.validate_inputs(replace(config, ood_data=""))
    assert without["ood_data"] is None
    # Out-of-domain rows are prepared under a key of their own: adding them to a run prepares
    # nothing else again.
    prepared = steps.prepare_data(plan, max_length=64, progress=False)
    plain = steps.prepare_data(without, max_length=64, progress=False)
    assert (prepared["train"], prepared["heldout"]) == (plain["train"], plain["heldout"])
    assert "ood" not in plain and prepared["rows"]["ood"] == len(rows)
    with pytest.raises(ConfigError, match=r"ood_data .*nowhere\.jsonl: no such file"):
        steps.validate_inputs(replace(config, ood_data=str(tmp_path / "nowhere.jsonl")))


@pytest.mark.parametrize("kind", ["pytorchjob", "trainjob"])
def test_a_job_that_asks_for_gpus_but_renders_none_is_refused(monkeypatch, kind):
    import dataclasses
    import importlib

    from crosskd.k8s import kinds

    train_step = importlib.import_module("crosskd.steps.train")  # the module, not the function
    settings = {"image": "i", "gpus_per_node": 8}
    job, *support = train_step.job_documents("s3://b/t.yaml", settings, "r", job_kind=kind)
    if kind == "trainjob":  # the runtime comes along, for the local executor
        assert [d["kind"] for d in support] == ["TrainingRuntime"]
        trainer = job["spec"]["trainer"]
        assert trainer["resourcesPerNode"]["limits"]["nvidia.com/gpu"] == "8"
        assert trainer["command"][:4] == ["crosskd", "train", "--config", "s3://b/t.yaml"]
    else:
        assert support == []
        spec = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
        (container,) = spec["containers"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "8"
        assert container["command"][:4] == ["crosskd", "train", "--config", "s3://b/t.yaml"]
    real = kinds.KINDS[kind].render

    def without_gpus(config):
        manifest = real(config)
        if kind == "trainjob":
            manifest["spec"]["trainer"]["resourcesPerNode"]["limits"].pop("nvidia.com/gpu")
        for spec in manifest["spec"].get("pytorchReplicaSpecs", {}).values():
            spec["template"]["spec"]["containers"][0]["resources"]["limits"].pop("nvidia.com/gpu")
        return manifest

    broken = dataclasses.replace(kinds.KINDS[kind], render=without_gpus)
    monkeypatch.setitem(kinds.KINDS, kind, broken)
    with pytest.raises(ConfigError, match="gpus_per_node is 8 but the rendered job requests"):
        train_step.job_documents("s3://b/t.yaml", settings, "r", job_kind=kind)
    with pytest.raises(ConfigError, match="job_kind is 'tfjob'; choose one of"):
        train_step.job_documents("s3://b/t.yaml", settings, "r", job_kind="tfjob")


def test_distill_on_user_inputs(train_inputs, tmp_path):
    """A pretrained student, two teachers (the first compared by X-Token's projected KL through
    the projection the run builds, the second with the student's tokenizer: no tables, CSD), a
    JSONL file split by a held-out fraction: the same steps as the pipeline. The out-of-domain
    rows are the held-out rows themselves, so their bits per byte must be the same numbers."""
    from crosskd.distill import distill

    data = Path(train_inputs["student"]).parent / "data.jsonl"
    rows = [json.loads(x) for x in data.read_text().splitlines()]
    ood = tmp_path / "ood.jsonl"
    ood.write_text("".join(json.dumps(r) + "\n" for r in rows if held_out(r["id"], 0.25)))
    config = steps.RunConfig(
        output=str(tmp_path / "run"),
        teachers=[train_inputs["teacher"], train_inputs["teacher_same"]],
        algorithms=["xtoken", "csd"],
        student=train_inputs["student"],
        train_data=str(data),
        heldout_fraction=0.25,
        ood_data=str(ood),
        max_length=48,
        k=8,
        train={"steps": 2},
        compare_ce_only=False,
        token_budget=512,
    )
    result = distill(config, progress=False)
    assert set(result["bits_per_byte"]) == {"teacher0", "teacher1", "student_init", "student_kd"}
    assert result["ood_bits_per_byte"] == result["bits_per_byte"]
    summary = (tmp_path / "run" / "report" / "summary.md").read_text()
    assert "| model | in-domain bits/byte | out-of-domain bits/byte |" in summary
    # Two prepared prefixes: the training and held-out rows', and the out-of-domain rows'.
    (split,) = [p for p in (tmp_path / "run" / "prepared").iterdir() if (p / "rows").is_dir()]
    held = [
        json.loads(x)["id"] for x in (split / "rows" / "heldout.jsonl").read_text().splitlines()
    ]
    assert held == [r["id"] for r in rows if held_out(r["id"], 0.25)] and held
    (tables,) = (tmp_path / "run" / "tables").iterdir()  # one pair: teacher 1 needs none
    assert sorted(p.name for p in tables.iterdir()) == ["s2t.safetensors", "t2s.safetensors"]
    train = yaml.safe_load((tmp_path / "run" / "kd" / "train.yaml").read_text())
    assert train["loss"]["teachers"][1].get("student_to_teacher") is None
    (projection,) = (tmp_path / "run" / "projections").glob("*/projection.safetensors")
    assert train["loss"]["teachers"][0]["projection"] == str(projection)
    assert [t["algorithm"] for t in train["loss"]["teachers"]] == ["xtoken", "csd"]
    history = run_history(str(tmp_path / "run" / "kd"))
    assert len(history) == 2 and all(h["kd/teacher0"] > 0 < h["kd/teacher1"] for h in history)
    assert train["student"] == train_inputs["student"]
    # A rerun finds every output: nothing is computed again.
    assert distill(config, progress=False) == result


def test_a_retried_training_task_gets_the_same_valid_job_run_id():
    from crosskd.k8s.job import JobConfig, job_name
    from crosskd.steps.train import job_run_id

    assert job_run_id("train", "kd", "0f3c") == "train-kd-0f3c"
    kfp_id = "4d9e2f0a-7b1c-4e55-9a3b-2c8d6f1e0b7a"  # KFP's pipeline job ids are UUIDs
    long_id = job_run_id("crosskd-train-for-a-long-pipeline-task", "kd", kfp_id)
    assert len(long_id) == 63 and long_id == job_run_id(
        "crosskd-train-for-a-long-pipeline-task", "kd", kfp_id
    )
    assert long_id.startswith("crosskd-train-for-a-long-pipeline-task-kd-4d9e2f0a-")
    assert long_id != job_run_id("crosskd-train-for-a-long-pipeline-task", "ce", kfp_id)
    config = JobConfig(run_id=long_id, image="i")  # a valid label value: accepted
    assert job_name(config.run_id) == job_name(long_id)


def test_chat_distillation_end_to_end(train_inputs, tmp_path):
    """The chat-demo path on tiny models: the teacher answers prompts (crosskd generate), then a
    run distils it into the student on those conversations; the held-out figure is over the
    bytes of the held-out answers, the same for the teacher and the students."""
    from crosskd.distill import distill
    from crosskd.generate import GenerateConfig, generate

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": f"Tell me about the number {i}."}) + "\n" for i in range(16))
    )
    conversations = str(tmp_path / "conversations.jsonl")
    generate(
        GenerateConfig(
            output=conversations,
            model=train_inputs["teacher"],
            prompts=str(prompts),
            conversations=16,
            max_new_tokens=12,
            temperature=1.0,
            device="cpu",
        ),
        progress=False,
    )
    rows = [json.loads(x) for x in Path(conversations).read_text().splitlines()]
    config = steps.RunConfig(
        output=str(tmp_path / "run"),
        teachers=[train_inputs["teacher"]],
        student=train_inputs["student"],
        train_data=conversations,
        heldout_fraction=0.25,
        max_length=256,
        k=8,
        train={"steps": 2},
        token_budget=2048,
        device="cpu",
    )
    result = distill(config, progress=False)
    assert set(result["bits_per_byte"]) == {"teacher", "student_init", "student_kd", "student_ce"}
    evaluation = json.loads((tmp_path / "run" / "evaluation.json").read_text())
    answers = sum(
        len(r["messages"][1]["content"].encode()) for r in rows if held_out(r["id"], 0.25)
    )
    assert answers > 0
    assert {m["bytes"] for m in evaluation["models"].values()} == {answers}
