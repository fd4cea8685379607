"""An encoded file decoded on the host is opened from the array it was decoded into: the readers
serve the decoded file from those bytes (read-only while it is open), nothing holds a second
copy of it, and closing the snapshot lets the bytes go."""

from __future__ import annotations

import gc
import tracemalloc
import weakref
from collections.abc import Callable

import numpy as np
import pytest
import torch

import kvsnap
from kvsnap.encoded.original import read_local
from kvsnap.encoded.write import encode_file
from kvsnap.testing.caches import same_bytes
from tests.support.encoded_files import capture_real, filled_caches, real_sequences, wide_content


def _decoded_bytes_of(snapshot: kvsnap.Snapshot) -> np.ndarray:
    """The array the open snapshot's one part serves its file from."""
    (part,) = snapshot.parts
    held = part.reader.held_file()
    assert held is not None, "the decoded file is not held in memory by its reader"
    return held


@pytest.mark.parametrize("encoding", ["lossless", "fp8"])
def test_the_decoded_file_is_held_read_only_and_released_on_close(tmp_path, encoding):
    source, target = tmp_path / "kv.safetensors", tmp_path / f"kv.{encoding}.safetensors"
    content = capture_real(source, "vllm-nhd", torch.bfloat16)
    encode_file(source, target, encoding)
    snapshot = kvsnap.Snapshot.open(target)
    name = content.geometry.tensor_names()[0]
    restored = snapshot.read_tensor(name)  # an fp8 file decodes on this first CPU use
    if encoding == "lossless":
        with kvsnap.Snapshot.open(source) as original:
            assert same_bytes(restored, original.read_tensor(name))
    held = _decoded_bytes_of(snapshot)
    assert snapshot.part_files() == [str(target)]  # the decoded file goes by the encoded name
    assert not held.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        held[0] = 1
    whole = weakref.ref(held.base if held.base is not None else held)
    del held
    assert snapshot.verify() == []
    snapshot.close()
    gc.collect()
    assert whole() is None, "closing the snapshot left the decoded bytes alive"


def _traced_peak(action: Callable[[], object]) -> tuple[int, object]:
    """The peak of the memory tracemalloc sees allocated while ``action`` runs, and its result."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        result = action()
        return tracemalloc.get_traced_memory()[1] - before, result
    finally:
        tracemalloc.stop()


def test_a_lossless_open_holds_one_copy_of_the_decoded_file(tmp_path):
    # 16 layers of the 8B shape's 32 KiB pages, 8 blocks: a 10 MB decoded file. Its open reads
    # the encoded file, decodes it once and opens that array: the peak of what it allocates
    # is the encoded file as read (anonymous memory tracemalloc does not see, measured here
    # by reading it alone), the decoded file and the decode's small scratch. A copy of the
    # decoded file (an fsspec memory file, as before 2026-12-06) doubles the decoded part.
    source, target = tmp_path / "kv.safetensors", tmp_path / "kv.lossless.safetensors"
    content = wide_content(torch.bfloat16, layers=16)
    (cache,) = filled_caches(content, "vllm-nhd")
    kvsnap.capture(cache.layout, real_sequences(), source, reproducible=True)
    encode_file(source, target, "lossless")
    decoded_bytes = source.stat().st_size
    assert decoded_bytes >= 8 << 20
    with kvsnap.Snapshot.open(target):
        pass  # imports and process-wide caches warmed, outside the measure
    read_peak, _ = _traced_peak(lambda: read_local(target))
    peak, snapshot = _traced_peak(lambda: kvsnap.Snapshot.open(target))
    assert isinstance(snapshot, kvsnap.Snapshot)
    with snapshot:
        assert snapshot.verify() == []
    assert peak - read_peak < decoded_bytes * 3 // 2, (
        f"the open's peak is {peak} B ({read_peak} B of it reading the encoded file) for a "
        f"{decoded_bytes} B decoded file"
    )
