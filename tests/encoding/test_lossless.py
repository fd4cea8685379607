"""The lossless encoding: bit-exact round trips of real KV (the built-in model's prefill) and of
every float width, chunked reads, the raw fallbacks, and the ratio on real bf16 KV."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from kvsnap.encoding import lossless, lossless_table
from tests.support.prefill_kv import built_in_kv


def _pages(tensor: torch.Tensor) -> np.ndarray:
    return tensor.contiguous().view(torch.uint8).numpy().reshape(tensor.shape[0], -1)


def _decoded(encoded: lossless.LosslessTensor, **options) -> np.ndarray:
    out = np.full((encoded.num_pages, encoded.page_bytes), 0xA5, dtype=np.uint8)
    lossless.decode_pages(encoded, out, **options)
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_real_kv_round_trips_bit_exact_in_every_chunking(dtype):
    kv = built_in_kv(256, dtype)
    page_bytes = _pages(kv["layers.0.key"]).shape[1]
    # One page a chunk, three pages a chunk (the last chunk shorter), one chunk for all.
    for chunk_bytes in (page_bytes, 3 * page_bytes, 1 << 30):
        for name, tensor in kv.items():
            pages = _pages(tensor)
            encoded = lossless.encode_pages(pages, tensor.element_size(), chunk_bytes=chunk_bytes)
            assert encoded is not None, name
            assert encoded.stored_bytes < 0.95 * pages.nbytes
            expected_chunks = -(-len(pages) // lossless.chunk_pages(page_bytes, chunk_bytes))
            assert len(encoded.chunk_table) == expected_chunks
            np.testing.assert_array_equal(_decoded(encoded), pages)


def test_bf16_kv_of_the_built_in_model_is_at_least_a_fifth_smaller():
    kv = built_in_kv(256, torch.bfloat16)
    raw = stored = 0
    for tensor in kv.values():
        encoded = lossless.encode_pages(_pages(tensor), 2)
        raw += tensor.numel() * 2
        stored += tensor.numel() * 2 if encoded is None else encoded.stored_bytes
    assert raw / stored >= 1.25


def test_threads_encode_and_decode_the_same_bytes_as_one_thread():
    pages = _pages(built_in_kv(256, torch.bfloat16)["layers.1.value"])
    alone = lossless.encode_pages(pages, 2, chunk_bytes=4 * pages.shape[1])
    with ThreadPoolExecutor(4) as pool:
        threaded = lossless.encode_pages(pages, 2, chunk_bytes=4 * pages.shape[1], executor=pool)
        assert alone is not None and threaded is not None
        np.testing.assert_array_equal(threaded.chunk_table, alone.chunk_table)
        np.testing.assert_array_equal(threaded.data, alone.data)
        np.testing.assert_array_equal(_decoded(threaded, executor=pool), pages)


@pytest.mark.parametrize("word_bytes", [2, 4, 8])
def test_planes_split_and_join_back_for_every_word_width(word_bytes):
    words = np.random.default_rng(word_bytes).integers(0, 256, 64 * word_bytes, dtype=np.uint8)
    planes = lossless.split_planes(words, word_bytes)
    assert planes.shape == (word_bytes, 64)
    # Plane b holds byte b of each little-endian word.
    np.testing.assert_array_equal(planes[word_bytes - 1], words[word_bytes - 1 :: word_bytes])
    out = np.zeros_like(words)
    lossless.join_planes(list(planes), out)
    np.testing.assert_array_equal(out, words)


def test_float64_pages_round_trip():
    generator = torch.Generator().manual_seed(3)
    values = torch.randn(6, 4, 2, 8, dtype=torch.float64, generator=generator)
    pages = _pages(values)
    encoded = lossless.encode_pages(pages, 8, chunk_bytes=2 * pages.shape[1])
    assert encoded is not None
    np.testing.assert_array_equal(_decoded(encoded), pages)


def test_a_tensor_that_does_not_shrink_is_left_raw():
    random_bytes = np.random.default_rng(0).integers(0, 256, (8, 4096), dtype=np.uint8)
    assert lossless.encode_pages(random_bytes, 2) is None


def test_one_byte_elements_are_never_encoded():
    zeros = np.zeros((8, 4096), dtype=np.uint8)  # compressible, but fp8 stays raw
    assert lossless.encode_pages(zeros, 1) is None


def test_an_incompressible_plane_is_stored_raw_beside_a_coded_one():
    rng = np.random.default_rng(1)
    # High bytes all one exponent, low bytes random: plane 1 coded, plane 0 raw.
    words = (0x3F00 | rng.integers(0, 256, 64 * 1024)).astype("<u2")
    pages = words.view(np.uint8).reshape(16, -1)
    encoded = lossless.encode_pages(pages, 2)
    assert encoded is not None
    row = encoded.chunk_table[0]
    start = lossless.PLANES_START
    assert row[start] == lossless.CODEC_RAW and row[start + 1] == pages.size // 2
    assert row[start + 2] == lossless.CODEC_ZSTD and row[start + 3] < pages.size // 20
    np.testing.assert_array_equal(_decoded(encoded), pages)


def test_chunks_covering_a_page_range_decode_exactly_those_pages():
    pages = _pages(built_in_kv(256, torch.bfloat16)["layers.2.key"])
    encoded = lossless.encode_pages(pages, 2, chunk_bytes=3 * pages.shape[1])
    assert encoded is not None
    table = encoded.chunk_table
    for first, stop in [(0, 1), (2, 3), (2, 7), (15, 16), (0, 16), (5, 5)]:
        chunks = lossless_table.chunks_covering(table, first, stop)
        covered = set()
        for chunk in chunks:
            row = table[chunk]
            start, count = int(row[lossless.FIRST_PAGE]), int(row[lossless.NUM_PAGES])
            offset = int(row[lossless.OFFSET])
            length = int(row[lossless.PLANES_START + 1 :: 2].sum())
            out = np.empty((count, pages.shape[1]), dtype=np.uint8)
            lossless.decode_chunk(
                row, encoded.data[offset : offset + length], out.reshape(-1), word_bytes=2
            )
            np.testing.assert_array_equal(out, pages[start : start + count])
            covered.update(range(start, start + count))
        assert set(range(first, stop)) <= covered
        # No chunk more than needed: dropping the first or last would lose a page.
        if len(chunks) and stop > first:
            starts, counts = table[:, lossless.FIRST_PAGE], table[:, lossless.NUM_PAGES]
            head, last = chunks[0], chunks[-1]
            assert int(starts[head]) <= first < int(starts[head] + counts[head])
            assert int(starts[last]) < stop <= int(starts[last] + counts[last])
