"""Page checksums hashed without the GIL are the xxh3-64 python-xxhash computes."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash

from kvsnap.format import hashing


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


def test_the_gil_free_hash_is_used_where_xxhash_exports_it(monkeypatch):
    assert hashing._XXH3_64 is not None
    calls = []
    real = hashing._XXH3_64
    monkeypatch.setattr(
        hashing, "_XXH3_64", lambda address, size: calls.append(size) or real(address, size)
    )
    data = np.arange(4096, dtype=np.uint8)
    hashing.block_digests(data, 1024)
    assert calls == [1024] * 4
