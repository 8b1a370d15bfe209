"""Checkpoint parts on remote storage are read by byte ranges: the rows of dimension 0 a rank
needs, against the same file memory-mapped from a local disk (moto's S3 server)."""

from __future__ import annotations

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from crosskd.train.checkpoint import _RangedFile


class _Counting:
    """The real filesystem, counting the bytes each read returns."""

    def __init__(self, fs) -> None:
        self.fs, self.fetched = fs, 0

    def cat_file(self, path, start, end):
        data = self.fs.cat_file(path, start=start, end=end)
        self.fetched += len(data)
        return data


def test_regions_read_by_range_equal_the_local_file(s3, tmp_path):
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "weight": torch.randn(1000, 64, generator=gen),
        "half": torch.randn(10, 3, generator=gen).to(torch.bfloat16),
        "steps": torch.tensor(7.0),
        "rng": torch.randint(0, 255, (5056,), dtype=torch.uint8, generator=gen),
        "empty": torch.zeros(0, 4),
    }
    local = tmp_path / "rank-00000.safetensors"
    save_file(tensors, str(local))
    s3.put(str(local), "crosskd-test/ckpt/rank-00000.safetensors")
    counting = _Counting(s3)
    remote = _RangedFile(counting, "crosskd-test/ckpt/rank-00000.safetensors")
    header = counting.fetched
    assert sorted(remote.keys()) == sorted(tensors)
    with safe_open(str(local), framework="pt") as mapped:
        boxes = {
            "weight": [
                (slice(250, 500), slice(0, 64)),
                (slice(0, 1000), slice(8, 16)),
                (slice(999, 1000), slice(0, 64)),
                (),
            ],
            "half": [(slice(3, 7), slice(1, 3)), ()],
            "steps": [()],
            "rng": [(slice(0, 5056),), (slice(100, 100),)],
            "empty": [(slice(0, 0), slice(0, 4)), ()],
        }
        for key, cases in boxes.items():
            for box in cases:
                want = mapped.get_slice(key)[box] if box else mapped.get_tensor(key)
                got = remote.region(key, box)
                assert got.dtype == want.dtype and torch.equal(got, want), (key, box)
    # Rows 250..499 of a 1000 x 64 float32 tensor: a quarter of it, and nothing else.
    counting.fetched = 0
    remote.region("weight", (slice(250, 500), slice(0, 64)))
    assert counting.fetched == 250 * 64 * 4
    assert header < 1000
