"""BLAKE3 of pages on the device (``kvsnap/transfer/page_blake3.py``), run by Triton's interpreter
on CPU tensors: digests bit-identical with the ``blake3`` package for pages of one block to 32
KiB at scattered offsets of one buffer, the check launch flagging exactly the altered pages,
the tiled path for pages of more chunks than lanes, and the kernel's tree (pairs level by level,
a last odd node carried up) shown to be BLAKE3's for every chunk count the kernel takes.

The interpreter must be chosen before Triton is imported (the kernel's helpers are made at
import), so the kernel runs in one child process for all of the default run's cases. It
spends 1-3 s on a page size of 1 KiB or more (16 compressions in turn, ~1,200 tensor
operations each): the default run takes the sizes that reach every branch of the kernel and
``--run-slow`` the rest of the list. Compiled on a GPU, with thousands of pages:
``tests/transfer/test_page_blake3_gpu.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from kvsnap.transfer import page_blake3
from kvsnap.transfer.page_blake3 import KernelShape
from tests.support.blake3_pages import host_digests, scattered_pages

ROOT = Path(__file__).resolve().parents[2]
#: Sizes that, with the cases below, reach every branch of the kernel: one partial block
#: (rooted at its only block), two blocks, one whole chunk (rooted at its last block), 18
#: chunks (MLA's 16 tokens x 576 x 2 bytes: lanes past the page, a tree of 18 in 32 lanes), 32
#: whole chunks.
BRANCH_SIZES = [4, 68, 1024, 18 << 10, 32 << 10]
#: The rest of the sizes the kernel is held to (6 chunks: the check case's size).
MORE_SIZES = [64, 1020, 1028, 2048, 3 * 1024, 5 * 1024 + 12, 7 * 1024, 16 << 10]
#: 6 chunks, the last one a partial block of 12 bytes (a tree of 6 in 8 lanes): a byte flipped
#: in the first block, in a middle chunk, in the last whole block and in the last partial
#: block; a stored digest with one word changed; the unaltered pages' digests are the
#: package's.
CHECK_CASE = {
    "page_bytes": 5 * 1024 + 12,
    "count": 7,
    "seed": 3,
    "flips": [[1, 0], [2, 2 * 1024 + 500], [3, 5 * 1024 - 1], [5, 5 * 1024 + 11]],
    "stored_flips": [[4, 5]],
}
#: 3 chunks (the last one 68 bytes) in tiles of 2 lanes (a whole tile, then a tile of one
#: chunk, merged at the end), word loads, 3 pages in a program of 4.
TILED_CASE = {"page_bytes": 2 * 1024 + 68, "count": 3, "seed": 5, "shape": [2, 4, 1, False]}
#: 5 pages, 2 a program: the last program has one page and a slot past the end.
SPREAD_CASE = {"page_bytes": 68, "count": 5, "seed": 9, "shape": [1, 2, 4, True]}


def interpreted(cases: list[dict[str, Any]]) -> list[Any]:
    """What the kernel gives for ``cases``, run by Triton's interpreter on host memory in a
    fresh process (tests/support/blake3_interpreted_child.py)."""
    done = subprocess.run(
        [sys.executable, "-m", "tests.support.blake3_interpreted_child", json.dumps(cases)],
        cwd=ROOT,
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def expected_digests(case: dict[str, Any]) -> list[list[int]]:
    _, _, pages = scattered_pages(case["page_bytes"], case["count"], case["seed"])
    return host_digests(pages).tolist()


def digest_case(page_bytes: int) -> dict[str, Any]:
    return {"page_bytes": page_bytes, "count": 3, "seed": page_bytes}


@pytest.fixture(scope="module")
def results() -> list[Any]:
    """One interpreter process for the default run's cases, in this order: the branch sizes,
    the check, the tiled case, the spread case."""
    cases = [digest_case(size) for size in BRANCH_SIZES]
    return interpreted([*cases, CHECK_CASE, TILED_CASE, SPREAD_CASE])


@pytest.mark.parametrize("index", range(len(BRANCH_SIZES)), ids=map(str, BRANCH_SIZES))
def test_digests_are_blake3s(index: int, results: list[Any]) -> None:
    case = digest_case(BRANCH_SIZES[index])
    assert results[index] == expected_digests(case), case


@pytest.mark.slow
def test_digests_are_blake3s_for_more_sizes() -> None:
    cases = [digest_case(size) for size in MORE_SIZES]
    for case, got in zip(cases, interpreted(cases), strict=True):
        assert got == expected_digests(case), case


def test_check_flags_exactly_the_altered_pages(results: list[Any]) -> None:
    assert results[len(BRANCH_SIZES)] == [1, 0, 0, 0, 0, 0, 1]


def test_pages_of_more_chunks_than_lanes_go_through_in_tiles(results: list[Any]) -> None:
    assert results[len(BRANCH_SIZES) + 1] == expected_digests(TILED_CASE)


def test_pages_spread_over_programs(results: list[Any]) -> None:
    assert results[len(BRANCH_SIZES) + 2] == expected_digests(SPREAD_CASE)


def test_no_pages_launches_nothing() -> None:
    empty = torch.zeros(0, 8, dtype=torch.int32)
    words = torch.zeros(0, dtype=torch.int64)
    page_blake3.launch_page_blake3_at_words(torch.zeros(64, dtype=torch.uint8), words, 64, empty)
    flags = torch.zeros(0, dtype=torch.int64)
    page_blake3.launch_page_blake3_checks_at_words(
        torch.zeros(64, dtype=torch.uint8), words, 64, empty, flags
    )


# --------------------------------------------------------------------------------------------
# The tree


def blake3_tree(first: int, count: int) -> object:
    """BLAKE3's tree over chunks ``first .. first + count - 1`` as nested pairs, as the spec
    defines it: the left subtree holds the largest power of two of chunks short of the whole."""
    if count == 1:
        return first
    left = 1 << ((count - 1).bit_length() - 1)
    return (blake3_tree(first, left), blake3_tree(first + left, count - left))


def paired_tree(nodes: list[object]) -> object:
    """The kernel's merge: level by level, node ``2j`` with ``2j + 1``, a last odd node carried
    up unchanged."""
    while len(nodes) > 1:
        nodes = [
            (nodes[i], nodes[i + 1]) if i + 1 < len(nodes) else nodes[i]
            for i in range(0, len(nodes), 2)
        ]
    return nodes[0]


def tiled_tree(count: int, lanes: int) -> object:
    """The kernel's tiled path: each tile of ``lanes`` chunks merged alone, then the tiles."""
    tiles = [paired_tree(list(range(t, min(t + lanes, count)))) for t in range(0, count, lanes)]
    return paired_tree(tiles)


def test_pairing_level_by_level_is_blake3s_tree() -> None:
    assert paired_tree(list(range(5))) == (((0, 1), (2, 3)), 4)
    assert paired_tree(list(range(7))) == (((0, 1), (2, 3)), ((4, 5), 6))
    for count in range(1, page_blake3.MAX_PAGE_BYTES // page_blake3.CHUNK_BYTES + 1):
        tree = blake3_tree(0, count)
        assert paired_tree(list(range(count))) == tree, count
        for lanes in (1, 2, 8, 32):
            assert tiled_tree(count, lanes) == tree, (count, lanes)


# --------------------------------------------------------------------------------------------
# Sizes and shapes


def test_supported_sizes() -> None:
    assert page_blake3.supports(4) and page_blake3.supports(18 << 10)
    assert page_blake3.supports(page_blake3.MAX_PAGE_BYTES)
    assert not page_blake3.supports(0) and not page_blake3.supports(6)
    assert not page_blake3.supports(page_blake3.MAX_PAGE_BYTES + 4)
    with pytest.raises(ValueError, match="hashed on the host"):
        page_blake3.launch_page_blake3_at_words(
            torch.zeros(64, dtype=torch.uint8),
            torch.zeros(1, dtype=torch.int64),
            6,
            torch.zeros(1, 8, dtype=torch.int32),
        )


def test_default_shapes() -> None:
    assert page_blake3.default_shape(32 << 10) == KernelShape(32, 8, 4, True)
    assert page_blake3.default_shape(18 << 10) == KernelShape(32, 8, 4, True)
    assert page_blake3.default_shape(64) == KernelShape(1, 256, 4, True)
    assert page_blake3.default_shape(1 << 20).chunk_lanes == 32
    with pytest.raises(ValueError, match="power of two"):
        KernelShape(chunk_lanes=3, pages_per_program=1)
