"""Shared fixtures: the tokenizer zoo (built once per session) and tables built from it.

The zoo (and what loading a tokenizer derives) is kept in ``$CROSSKD_CACHE_DIR`` when that is
set (so repeated local runs reuse it), else in a fresh temporary folder of this process, removed
at its exit: the suite never writes to the user's own cache.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest

if not os.environ.get("CROSSKD_CACHE_DIR"):
    os.environ["CROSSKD_CACHE_DIR"] = tempfile.mkdtemp(prefix="crosskd-cache-")
    atexit.register(shutil.rmtree, os.environ["CROSSKD_CACHE_DIR"], ignore_errors=True)
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def zoo_cache() -> Path:
    """Where zoo tokenizers are built for this session."""
    return Path(os.environ["CROSSKD_CACHE_DIR"])


@pytest.fixture(scope="session")
def zoo(zoo_cache: Path):
    """``zoo(name, **kwargs)`` -> a LoadedTokenizer, loaded once per name and arguments."""
    from crosskd.tokenization import load_tokenizer

    loaded: dict = {}

    def get(name: str):
        if name not in loaded:
            loaded[name] = load_tokenizer(f"zoo:{name}", cache_dir=zoo_cache)
        return loaded[name]

    return get


@pytest.fixture(scope="session")
def built_table(zoo):
    """``built_table(src_name, dst_name)`` -> the SubTokenTable, built once per direction."""
    from crosskd.tables import build_table

    built: dict = {}

    def get(src: str, dst: str):
        if (src, dst) not in built:
            built[src, dst] = build_table(zoo(src), zoo(dst), progress=False)
        return built[src, dst]

    return get


@pytest.fixture(scope="session")
def tiktoken_encoding():
    """``tiktoken_encoding(name)`` -> a tiktoken Encoding over the same BPE ranks as the zoo's
    ``llama3`` or ``qwen3`` (an independent BPE implementation; no specials, regex unused)."""
    import tiktoken

    from crosskd.zoo import bpe_ranks

    made: dict = {}

    def get(name: str):
        if name not in made:
            made[name] = tiktoken.Encoding(
                name, pat_str=r".", mergeable_ranks=bpe_ranks(name), special_tokens={}
            )
        return made[name]

    return get


@pytest.fixture(scope="session")
def s3():
    """An S3FileSystem talking to a moto server on 127.0.0.1 with throwaway credentials and a
    bucket ``crosskd-test`` (one server per session: moto's backends are process-wide)."""
    s3fs = pytest.importorskip("s3fs")
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    patch = pytest.MonkeyPatch()
    for key, value in {
        "AWS_ACCESS_KEY_ID": "crosskd-test",
        "AWS_SECRET_ACCESS_KEY": "crosskd-test",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": f"http://{host}:{port}",
    }.items():
        patch.setenv(key, value)
    s3fs.S3FileSystem.clear_instance_cache()
    fs = s3fs.S3FileSystem()
    fs.mkdir("crosskd-test")
    yield fs
    s3fs.S3FileSystem.clear_instance_cache()
    patch.undo()
    server.stop()


@pytest.fixture(scope="session")
def train_inputs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Tiny students, teachers, tables, prepared data and caches of the training tests, built
    once (:func:`train_inputs.make_train_inputs`)."""
    from train_inputs import make_train_inputs

    return make_train_inputs(tmp_path_factory.mktemp("train-inputs"))
