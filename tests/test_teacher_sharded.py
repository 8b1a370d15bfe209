"""A teacher sharded over processes (FSDP2, real gloo workers under torch's elastic agent)
scores the same cache, byte for byte, as the whole teacher in one process: also when a worker
has no shard of its own and only joins the others' forward passes, and when a run resumes.

How it is loaded, watched from inside the real workers (probes patched in by a wrapper of the
worker function, which the spawned processes import from this file): the weights are hashed
once, by the parent; every worker reads only its own rows of each weight, and together they
read each value once; the workers read at the same time (each, at its first read, waits for
the others to begin theirs: with workers loading in turns it would wait alone); and the process
group gets ``collective_timeout_s``. The loader itself, in three gloo processes, gives the
weights, buffers and logits of ``from_pretrained`` for tied and untied teachers, one file or an
indexed set of files, converted to bfloat16, with a rank whose part of a weight is empty; a
Mixtral checkpoint (its experts saved under the names transformers fuses while loading) is
loaded whole by each process in turn, with the same result; a checkpoint that names the weights
otherwise is refused.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import safetensors
import torch
from train_workers import _join, run_ranks, tiny_llama, worker_exit

import crosskd.teacher.model
from crosskd.errors import CrosskdError
from crosskd.teacher.scoring import MANIFEST, ScoreConfig
from crosskd.teacher.sharded import score, score_on_processes

PROBES = "CROSSKD_TEST_SHARDED_PROBES"
"""Environment variable: the folder the probed workers write what they saw into."""
TOGETHER_WAIT_S = 120
"""How long a probed worker waits at its first read for the others to begin reading (a bound
on a wait, not a measurement: loading in turns never gets there)."""


def _shards(cache: str) -> dict[str, bytes]:
    manifest = json.loads((Path(cache) / MANIFEST).read_text())
    return {s["path"]: (Path(cache) / s["path"]).read_bytes() for s in manifest["shards"]}


def test_a_teacher_sharded_over_two_processes_scores_the_same_bytes(train_inputs, tmp_path):
    config = ScoreConfig(
        data=train_inputs["data_sharded"],
        teacher=train_inputs["teacher"],
        output=str(tmp_path / "cache"),
        k=16,
        processes=2,
    )
    # One shard over two processes: the second has none and joins the first's passes.
    first = score_on_processes(config, 0, 1, progress=False)
    assert (first["start"], first["stop"], len(first["parts"])) == (0, 1, 1)
    assert first["samples"] == first["parts"][0]["samples"] > 0
    # All of it: the halves 0..2 and 3..5, shard 0 kept from the first run (recorded twice).
    manifest = score(config, progress=False)
    assert sorted(p.name for p in (tmp_path / "cache" / "parts").iterdir()) == [
        "00000-00001.json",
        "00000-00003.json",
        "00003-00006.json",
    ]
    whole = json.loads((Path(train_inputs["cache_sharded"]) / MANIFEST).read_text())
    assert manifest["samples"] == whole["samples"] and len(manifest["shards"]) == 6
    assert _shards(config.output) == _shards(train_inputs["cache_sharded"])
    assert manifest["bits_per_byte"] == pytest.approx(whole["bits_per_byte"], rel=1e-12)


def test_processes_must_be_a_positive_integer_and_use_the_default_device(train_inputs, tmp_path):
    with pytest.raises(CrosskdError, match=r"processes is 0; it must be an integer >= 1"):
        ScoreConfig(data="d", teacher="t", output="o", processes=0).check()
    with pytest.raises(CrosskdError, match=r"collective_timeout_s is 1.5; it must be an integer"):
        ScoreConfig(data="d", teacher="t", output="o", collective_timeout_s=1.5).check()
    config = ScoreConfig(
        data=train_inputs["data_sharded"],
        teacher=train_inputs["teacher"],
        output=str(tmp_path / "c"),
        processes=2,
        device="cuda:0",
    )
    with pytest.raises(
        CrosskdError,
        match=r"device is 'cuda:0', but processes = 2 puts one "
        r"process on each cpu device here",
    ):
        score_on_processes(config)


def _bindings(real: object) -> list[tuple[object, str]]:
    """Every ``(module, name)`` of crosskd, transformers and safetensors bound to ``real``."""
    prefixes = ("crosskd", "transformers", "safetensors")
    return [
        (module, name)
        for key, module in list(sys.modules.items())
        if key.split(".")[0] in prefixes
        for name, value in list(vars(module).items())
        if value is real
    ]


class _ProbedSlice:
    def __init__(self, view, key: str, probe: _Probe) -> None:
        self.view, self.key, self.probe = view, key, probe

    def __getitem__(self, box):
        return self.probe.record(self.key, self.view[box])

    def __getattr__(self, name: str):
        return getattr(self.view, name)


class _Probe:
    """What one worker does: weight values it reads (elements per checkpoint key), hashes,
    whether all workers were reading at once, the process group's timeout."""

    def __init__(self, out: Path, rank: int, world: int) -> None:
        self.out, self.rank, self.world = out, rank, world
        self.seen = {"read": Counter(), "hashes": 0, "together": None, "timeout_s": None}

    def record(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        if self.seen["together"] is None:
            (self.out / f"reading-{self.rank}").touch()
            deadline = time.monotonic() + TOGETHER_WAIT_S
            while (
                len(list(self.out.glob("reading-*"))) < self.world and time.monotonic() < deadline
            ):
                time.sleep(0.1)
            self.seen["together"] = len(list(self.out.glob("reading-*"))) == self.world
        self.seen["read"][key] += tensor.numel()
        return tensor

    def install(self) -> None:
        import torch.distributed as dist

        real_open, real_hash, real_init = (
            safetensors.safe_open,
            crosskd.teacher.model.fingerprint,
            dist.init_process_group,
        )
        probe = self

        class ProbedOpen:
            def __init__(self, *args, **kwargs) -> None:
                self.handle = real_open(*args, **kwargs)

            def __enter__(self):
                self.handle.__enter__()
                return self

            def __exit__(self, *exc):
                return self.handle.__exit__(*exc)

            def get_slice(self, key: str) -> _ProbedSlice:
                return _ProbedSlice(self.handle.get_slice(key), key, probe)

            def get_tensor(self, key: str) -> torch.Tensor:
                return probe.record(key, self.handle.get_tensor(key))

            def __getattr__(self, name: str):
                return getattr(self.handle, name)

        def hashing(folder: Path) -> str:
            self.seen["hashes"] += 1
            return real_hash(folder)

        def init(*args, **kwargs):
            timeout = kwargs.get("timeout")
            self.seen["timeout_s"] = None if timeout is None else timeout.total_seconds()
            return real_init(*args, **kwargs)

        for module, name in _bindings(real_open):
            setattr(module, name, ProbedOpen)
        for module, name in _bindings(real_hash):
            setattr(module, name, hashing)
        dist.init_process_group = init

    def save(self) -> None:
        (self.out / f"rank{self.rank}.json").write_text(json.dumps(self.seen))


def _probed_worker(*args):
    """:func:`crosskd.teacher.sharded._worker` of this process, with a :class:`_Probe`."""
    from crosskd.teacher import sharded

    probe = _Probe(Path(os.environ[PROBES]), int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
    probe.install()
    try:
        return sharded._worker(*args)
    finally:
        probe.save()


def test_the_workers_hash_nothing_read_their_own_rows_at_once_under_the_timeout(
    train_inputs, tmp_path, monkeypatch
):
    from safetensors.torch import load_file

    from crosskd.teacher import sharded

    hashes = []
    real_hash = crosskd.teacher.model.fingerprint
    for module, name in _bindings(real_hash):
        monkeypatch.setattr(module, name, lambda folder: hashes.append(folder) or real_hash(folder))
    monkeypatch.setattr(sharded, "_worker", _probed_worker)
    probes = tmp_path / "probes"
    probes.mkdir()
    monkeypatch.setenv(PROBES, str(probes))
    config = ScoreConfig(
        data=train_inputs["data_sharded"],
        teacher=train_inputs["teacher"],
        output=str(tmp_path / "cache"),
        k=16,
        processes=2,
        collective_timeout_s=1234,
    )
    result = score_on_processes(config, 0, 2, progress=False)

    whole = json.loads((Path(train_inputs["cache_sharded"]) / MANIFEST).read_text())
    digests = {s["path"]: s["sha256"] for s in whole["shards"]}
    scored = [s for part in result["parts"] for s in part["shards"]]
    assert [s["sha256"] for s in scored] == [digests[s["path"]] for s in scored]
    assert len(scored) == 2
    seen = [json.loads((probes / f"rank{r}.json").read_text()) for r in range(2)]
    assert len(hashes) == 1 and [s["hashes"] for s in seen] == [0, 0]
    assert [s["timeout_s"] for s in seen] == [1234, 1234]
    assert [s["together"] for s in seen] == [True, True]
    weights = load_file(Path(train_inputs["teacher"]) / "model.safetensors")
    for key, tensor in weights.items():  # FSDP2's rows of rank r: torch.chunk's r-th piece
        rows, chunk = len(tensor), -(-len(tensor) // 2)
        mine = [min(chunk, rows - r * chunk) * tensor[0].numel() for r in range(2)]
        assert [s["read"].get(key, 0) for s in seen] == mine, key


def _save_teachers(root: Path) -> dict[str, Path]:
    """Tiny Llamas saved in float32: ``tied`` (one file; 3 heads of 4 over 1 key-value head, so
    ``k_proj`` and ``v_proj`` have 4 rows: chunks of 2, 2 and none over 3 ranks), ``untied``
    (in 4+ files with an index), ``renamed`` (the tied one's tensors under other names), and
    ``mixtral`` (untied, 3 experts saved under their per-expert names)."""
    from safetensors.torch import load_file, save_file
    from transformers import MixtralConfig, MixtralForCausalLM

    shape = {
        "vocab_size": 67,
        "hidden_size": 12,
        "num_attention_heads": 3,
        "num_key_value_heads": 1,
        "intermediate_size": 24,
    }
    folders = {name: root / name for name in ("tied", "untied", "renamed")}
    torch.manual_seed(0)
    tiny_llama(**shape).save_pretrained(folders["tied"])
    tiny_llama(**shape, tie_word_embeddings=False).save_pretrained(
        folders["untied"], max_shard_size="4KB"
    )
    tiny_llama(**shape).save_pretrained(folders["renamed"])
    weights = folders["renamed"] / "model.safetensors"
    save_file({f"transformer.{k}": v for k, v in load_file(weights).items()}, weights)
    folders["mixtral"] = root / "mixtral"
    # bfloat16 grouped matmuls on CPU need rows of a multiple of 16 bytes: hidden 16.
    MixtralForCausalLM(
        MixtralConfig(
            **shape | {"hidden_size": 16, "intermediate_size": 32, "num_attention_heads": 2},
            num_hidden_layers=2,
            num_local_experts=3,
            num_experts_per_tok=2,
        )
    ).save_pretrained(folders["mixtral"])
    return folders


def _loader_worker(rank: int, world: int, port: int, folders: dict[str, Path], out: Path) -> None:
    """Each teacher loaded sharded in bfloat16 and the same from ``from_pretrained``: writes
    ``{teacher: what differs, ...}`` to ``out/load-rank<r>.json``."""
    with worker_exit(rank, out):
        _join(rank, world, port)
        import torch.distributed as dist
        from transformers import AutoModelForCausalLM

        from crosskd.teacher.model import TeacherError
        from crosskd.teacher.sharded import load_sharded_teacher

        seen = {}
        for name, folder in folders.items():
            config = ScoreConfig(data="-", teacher=str(folder), output="-", dtype="bfloat16")
            try:
                teacher = load_sharded_teacher(config, torch.device("cpu"), folder, "digest")
            except TeacherError as exc:
                seen[name] = {"error": str(exc)}
                continue
            model = teacher.model
            ref = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16)
            ref_params = dict(ref.named_parameters(remove_duplicate=False))
            seen[name] = {
                "fingerprint": teacher.fingerprint,
                "vocab": teacher.vocab_size,
                "tied": model.lm_head.weight is model.model.embed_tokens.weight,
                "empty parts": sum(p.to_local().numel() == 0 for p in model.parameters()),
                "differ": sorted(
                    [
                        n
                        for n, p in model.named_parameters(remove_duplicate=False)
                        if p.dtype != ref_params[n].dtype
                        or not torch.equal(p.full_tensor(), ref_params[n])
                    ]
                    + [
                        n
                        for n, b in model.named_buffers()
                        if b.dtype != ref.get_buffer(n).dtype
                        or not torch.equal(b, ref.get_buffer(n))
                    ]
                ),
            }
            ids = torch.tensor([[1, 5, 9, 3, 66, 0, 7]])
            with torch.no_grad():
                same = torch.equal(model(input_ids=ids).logits, ref(input_ids=ids).logits)
            seen[name]["same logits"] = same
        (out / f"load-rank{rank}.json").write_text(json.dumps(seen))
        dist.destroy_process_group()


def test_sharded_loading_gives_the_weights_buffers_and_logits_of_from_pretrained(tmp_path):
    folders = _save_teachers(tmp_path)
    assert (folders["untied"] / "model.safetensors.index.json").is_file()
    assert len(list(folders["untied"].glob("*.safetensors"))) >= 4
    run_ranks(_loader_worker, (folders, tmp_path), tmp_path, world=3)
    seen = [json.loads((tmp_path / f"load-rank{r}.json").read_text()) for r in range(3)]
    for rank in seen:
        for name in ("tied", "untied", "mixtral"):
            assert rank[name] | {"empty parts": None} == {
                "fingerprint": "digest",
                "vocab": 67,
                "tied": name == "tied",
                "differ": [],
                "same logits": True,
                "empty parts": None,
            }, name
        assert rank["renamed"]["error"].startswith(
            f"teacher {folders['renamed']}: its checkpoint holds no tensor for ['lm_head.weight', "
        )
        assert "save the teacher with save_pretrained" in rank["renamed"]["error"]
    # rank 2 holds no rows of the 4-row k_proj and v_proj weights of the 2 layers
    assert [rank["tied"]["empty parts"] for rank in seen] == [0, 0, 4]
