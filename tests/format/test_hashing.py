"""Page checksums, on the host and on the device, are the xxh3-64 python-xxhash computes."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import xxhash

from kvsnap.format import hashing
from kvsnap.transfer import page_hash


@pytest.mark.parametrize("page_bytes", [1, 7, 256, 4096, 32768])
def test_block_digests_match_xxhash_on_random_pages(page_bytes):
    data = np.random.default_rng(page_bytes).integers(0, 256, page_bytes * 9, dtype=np.uint8)
    want = [
        xxhash.xxh3_64_intdigest(data[i * page_bytes : (i + 1) * page_bytes].tobytes())
        for i in range(9)
    ]
    assert hashing.block_digests(data, page_bytes).tolist() == want
    assert (
        hashing.block_digests(memoryview(data.tobytes()), page_bytes).tolist() == want
    )  # readonly
    assert hashing.block_digests(data[page_bytes:], page_bytes).tolist() == want[1:]


_DEVICE_HASH_CHECK = """
import sys
import numpy as np, torch, xxhash
from kvsnap.transfer import page_hash
for page_bytes in map(int, sys.argv[1:]):
    data = np.random.default_rng(page_bytes).integers(0, 256, page_bytes * 3, dtype=np.uint8)
    digests = torch.zeros(3, dtype=torch.int64)
    page_hash.launch_page_digests(
        torch.from_numpy(data.copy()), torch.arange(3, dtype=torch.int64) * page_bytes,
        page_bytes, torch.from_numpy(page_hash.constant_table(page_bytes)), digests)
    want = [xxhash.xxh3_64_intdigest(data[i * page_bytes:(i + 1) * page_bytes].tobytes())
            for i in range(3)]
    got = digests.numpy().view(np.uint64).tolist()
    print(page_bytes, "ok" if got == want else f"MISMATCH {got} {want}")
"""


def test_the_device_kernel_hashes_like_xxhash():
    # The GPU kernel, run on host memory by Triton's interpreter (compiled on the GPU:
    # tests/pipeline/test_pipeline_gpu.py).
    # The interpreter must be chosen before Triton is imported: a fresh process.
    sizes = ["248", "256", "1024", "1032", "2048", "4096", "18432", "32768"]
    done = subprocess.run(
        [sys.executable, "-c", _DEVICE_HASH_CHECK, *sizes],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [word for size in sizes for word in (size, "ok")]


def test_pages_outside_the_long_path_are_left_to_the_host():
    assert not page_hash.supports(240) and not page_hash.supports(1020)
    assert page_hash.supports(248) and page_hash.supports(32768)
