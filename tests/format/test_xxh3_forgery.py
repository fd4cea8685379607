"""The attacker's tool of the page-forgery tests (tests/support/xxh3_forgery.py): a page of one
tenant's bytes given another page's xxh3-64 by a 4-list birthday search, which is why xxh3-64
checksums cannot bind a page to a signature."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash

from tests.support.xxh3_forgery import forge_page, forged_word_offsets, supports


def tenant_pages(page_bytes: int, seed: int) -> tuple[bytes, bytes]:
    """Two random pages: tenant X's (the bytes to serve) and tenant Y's (the digest to hit)."""
    rng = np.random.default_rng(seed)
    return rng.bytes(page_bytes), rng.bytes(page_bytes)


def changed_words(page: bytes, other: bytes) -> set[int]:
    """Byte offsets of the 8-byte words in which two pages of one size differ."""
    return {at for at in range(0, len(page), 8) if page[at : at + 8] != other[at : at + 8]}


def assert_forged(forged: bytes, mine: bytes, theirs: bytes) -> None:
    """``forged`` is ``mine`` with only the documented words changed, and carries the xxh3-64
    of ``theirs``, a different page."""
    assert len(forged) == len(mine)
    assert xxhash.xxh3_64_intdigest(forged) == xxhash.xxh3_64_intdigest(theirs)
    assert xxhash.xxh3_64_intdigest(forged) != xxhash.xxh3_64_intdigest(mine)
    assert forged != theirs
    changed = changed_words(forged, mine)
    assert changed and changed <= set(forged_word_offsets(len(mine)))


@pytest.fixture(scope="module")
def forged_32k() -> tuple[bytes, bytes, bytes]:
    """A 32 KiB page of X forged to Y's xxh3-64 with seed 0 (one search, ~2-3 s)."""
    mine, theirs = tenant_pages(32768, 1)
    return forge_page(mine, xxhash.xxh3_64_intdigest(theirs), seed=0), mine, theirs


def test_a_32k_page_gets_another_pages_xxh3_by_changing_four_documented_words(
    forged_32k,
) -> None:
    forged, mine, theirs = forged_32k
    assert_forged(forged, mine, theirs)
    # The words lie after the last scramble (byte 31,744) and before the last stripe.
    assert forged_word_offsets(32768) == (31744, 31760, 31776, 31792)


def test_the_same_seed_forges_the_same_page(forged_32k) -> None:
    forged, mine, theirs = forged_32k
    assert forge_page(mine, xxhash.xxh3_64_intdigest(theirs), seed=0) == forged


@pytest.mark.parametrize(
    ("page_bytes", "reason"),
    [
        (240, "240 bytes"),  # XXH3's short path
        (1028, "8-byte words"),
        (1032, "no stripe there ends before its last stripe"),  # 8 bytes after the scramble
        (2160, "no stripe there ends before its last stripe"),  # 112 bytes after it
    ],
)
def test_sizes_it_cannot_forge_are_refused_saying_why(page_bytes: int, reason: str) -> None:
    assert not supports(page_bytes)
    with pytest.raises(ValueError, match=reason):
        forge_page(bytes(page_bytes), 0)


def test_supported_sizes_include_every_page_kvsnap_writes() -> None:
    assert all(supports(size) for size in (248, 1024, 1144, 4096, 16384, 18432, 32768))
    assert forged_word_offsets(1144) == (1024, 1040, 1056, 1072)  # the smallest margin, 120 bytes


@pytest.mark.slow
@pytest.mark.parametrize("page_bytes", [248, 1144, 4096, 16384, 18432, 32760])
def test_pages_of_other_sizes_are_forged_too(page_bytes: int) -> None:
    mine, theirs = tenant_pages(page_bytes, page_bytes)
    assert_forged(forge_page(mine, xxhash.xxh3_64_intdigest(theirs)), mine, theirs)


@pytest.mark.slow
def test_another_seed_forges_another_page_with_the_same_digest(forged_32k) -> None:
    forged, mine, theirs = forged_32k
    other = forge_page(mine, xxhash.xxh3_64_intdigest(theirs), seed=1)
    assert_forged(other, mine, theirs)
    assert other != forged
