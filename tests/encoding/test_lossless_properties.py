"""Properties of the lossless encoding over generated pages: every word width (2, 4, 8 bytes),
page sizes of any whole number of words, chunk sizes that are not a whole number of pages, and
bytes that code (float-like words, zeros) or do not (random bytes). Whatever the encoder decides
per plane and per tensor, the pages come back bit-exact; the stored bytes decode by the format
doc's recipe alone (an independent decoder), the same bytes come out of one thread or several,
and chunks decode in any order."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsnap.encoding import lossless
from tests.support.format_doc import doc_recipe

# A base dependency; absent only where the tree runs uninstalled (the GPU machine's image).
pytest.importorskip("zstandard")

KINDS = ("float-like", "float-like", "mixed", "zeros", "random")
EXAMPLES = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@st.composite
def tensors(draw) -> tuple[np.ndarray, int, int, str]:
    """``(pages, word_bytes, chunk_bytes, kind)``: ``uint8`` pages ``(num_pages, page_bytes)``."""
    word = draw(st.sampled_from(lossless.ENCODED_WORD_BYTES))
    words_per_page = draw(st.integers(1, 700))
    num_pages = draw(st.integers(1, 20))
    page_bytes = word * words_per_page
    chunk_bytes = draw(st.integers(1, 7 * page_bytes + word))
    kind = draw(st.sampled_from(KINDS))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    pages = rng.integers(0, 256, (num_pages, page_bytes), dtype=np.uint8)
    words = pages.reshape(num_pages, words_per_page, word)
    if kind == "zeros":
        pages[:] = 0
    elif kind in ("float-like", "mixed"):
        # A float's top byte (sign and high exponent bits) is one value here, the next byte
        # one of a few: what codes in real KV. "mixed" leaves every other page random.
        chosen = slice(None) if kind == "float-like" else slice(None, None, 2)
        words[chosen, :, -1] = rng.integers(0, 256)
        words[chosen, :, -2] = rng.choice(rng.integers(0, 256, 4), words[chosen, :, -2].shape)
    return pages, word, chunk_bytes, kind


def _decoded(encoded: lossless.LosslessTensor, executor=None) -> np.ndarray:
    out = np.full((encoded.num_pages, encoded.page_bytes), 0xA5, dtype=np.uint8)
    lossless.decode_pages(encoded, out, executor=executor, tensor="layers.0.key")
    return out


@pytest.fixture(scope="module")
def pool():
    with ThreadPoolExecutor(3) as executor:
        yield executor


@EXAMPLES
@given(tensors())
def test_any_pages_round_trip_bit_exact_through_one_thread_or_three(pool, case):
    pages, word, chunk_bytes, kind = case
    encoded = lossless.encode_pages(pages, word, chunk_bytes=chunk_bytes)
    words_per_chunk = lossless.chunk_pages(pages.shape[1], chunk_bytes) * pages.shape[1] // word
    if kind == "float-like" and pages.shape[1] // word >= 128 and words_per_chunk >= 128:
        # Its top plane codes to a few bytes a frame: the tensor must be encoded.
        assert encoded is not None
    if encoded is None:
        return
    assert encoded.stored_bytes <= (1 - lossless.MIN_SAVING) * pages.nbytes
    np.testing.assert_array_equal(_decoded(encoded), pages)
    np.testing.assert_array_equal(_decoded(encoded, pool), pages)
    threaded = lossless.encode_pages(pages, word, chunk_bytes=chunk_bytes, executor=pool)
    assert threaded is not None
    np.testing.assert_array_equal(threaded.chunk_table, encoded.chunk_table)
    np.testing.assert_array_equal(threaded.data, encoded.data)


@EXAMPLES
@given(tensors())
def test_the_format_docs_recipe_decodes_what_the_encoder_wrote(case):
    pages, word, chunk_bytes, _ = case
    encoded = lossless.encode_pages(pages, word, chunk_bytes=chunk_bytes)
    if encoded is None:
        return
    decoded = doc_recipe()["lossless_pages"](
        encoded.data, encoded.chunk_table, encoded.num_pages, encoded.page_bytes, word
    )
    np.testing.assert_array_equal(decoded.reshape(pages.shape), pages)


@EXAMPLES
@given(tensors(), st.randoms(use_true_random=False))
def test_chunks_decode_in_any_order_each_into_its_own_pages(case, order: random.Random):
    pages, word, chunk_bytes, _ = case
    encoded = lossless.encode_pages(pages, word, chunk_bytes=chunk_bytes)
    if encoded is None:
        return
    out = np.full_like(pages, 0xA5)
    seen: list[tuple[int, int]] = []
    tasks = lossless.chunk_decoders(
        encoded, out, after=lambda first, written: seen.append((first, len(written)))
    )
    assert len(tasks) == len(encoded.chunk_table)
    order.shuffle(tasks)
    lossless.run_tasks(tasks)
    np.testing.assert_array_equal(out, pages)
    # Each chunk's check saw exactly its own pages, and together they saw every page once.
    table = encoded.chunk_table
    expected = sorted(
        zip(
            table[:, lossless.FIRST_PAGE].tolist(),
            (table[:, lossless.NUM_PAGES] * pages.shape[1]).tolist(),
            strict=True,
        )
    )
    assert sorted(seen) == expected
