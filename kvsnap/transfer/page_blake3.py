"""BLAKE3-256 of canonical pages on the GPU, bit-identical to the ``blake3`` package.

A signed snapshot binds every page's bytes with its BLAKE3 digest (plain hash mode, no key: the
HMAC over the table of digests is what needs the key), and a restore checks each page where it
lands, in the device buffer the page crosses anyway, as it does the xxh3-64 accident check
(:mod:`kvsnap.transfer.page_hash`).

BLAKE3 cuts its input into 1 KiB chunks of 16 blocks of 64 bytes. A chunk's chaining value is
its blocks compressed in turn (the first flagged ``CHUNK_START``, the last ``CHUNK_END``, every
one with the chunk's index as counter and its length in bytes, the last block zero-padded); the
chaining values are then merged pairwise by ``PARENT`` compressions up a binary tree whose left
subtree always holds the largest power of two of chunks short of the whole, and the last
compression is flagged ``ROOT``: its first 8 output words are the digest. A one-chunk page is
rooted at its last block.

The kernel gives each chunk a lane: ``LANES`` chunks of each of ``PAGES`` pages are side by side
in one ``(PAGES, LANES)`` tensor, compressing their 16 blocks in step (the blocks of a chunk are
sequential, the chunks are not; a block's 16 words are loaded for all lanes at once, coalesced).
The tree is then merged level by level inside the program: each level pairs node ``2j`` with
``2j + 1`` (``tl.reshape`` + ``tl.split``) and carries a last odd node up unchanged. Pairing
level by level is BLAKE3's tree: after ``k`` levels the nodes are the aligned runs of ``2**k``
chunks (the last one shorter), so the root's left child is the largest power-of-two run, and
so on down (tests/transfer/test_page_blake3.py checks it for every chunk count the kernel
takes). Pages of more than ``LANES`` chunks go through in tiles of ``LANES`` chunks, each an
aligned power-of-two run and so a subtree of its own, whose roots are merged the same way.

The compression itself is :mod:`kvsnap.transfer.blake3_compress`. The blocks and the tree's
levels are loops, so the kernel holds two or three compressions (the chunks', the tree's, the
tiles'): Triton's coalescing pass walks the whole dataflow slice of every load and store, so
compile time grows with the square of the kernel's size (one compression per tree level took
minutes for 32 KiB pages) and with its loads and stores (hence whole rows at a time).

:class:`KernelShape` holds the launch's knobs (pages per program, chunk lanes per page, warps,
how a block is loaded); ``benchmarks/page_digest_cost.py`` times variants of it. Pages up to
:data:`MAX_PAGE_BYTES`, a multiple of 4 bytes long, are hashed here (:func:`supports`); others
on the host.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kvsnap.transfer.triton_copy import kernel_for, tl, triton

#: BLAKE3's chunk size.
CHUNK_BYTES = 1024
#: The largest page the kernel hashes (1,024 chunks: the tile roots fit one program's registers).
MAX_PAGE_BYTES = 1 << 20
#: BLAKE3's domain flags.
CHUNK_START, CHUNK_END, PARENT, ROOT = 1, 2, 4, 8
#: Lanes a program holds in all (pages per program x chunk lanes) by default: 2 a thread with
#: the default 4 warps. The tree's levels run at half the lanes, so for 32 KiB pages they cost
#: a thread 5 compressions to the chunks' 32 (at 1 lane a thread, 5 to 16).
DEFAULT_PROGRAM_LANES = 256
#: Chunk lanes per page by default at most (a 32 KiB page's chunks side by side).
DEFAULT_MAX_CHUNK_LANES = 32


def supports(page_bytes: int) -> bool:
    """Whether pages of ``page_bytes`` are hashed on the device: whole 4-byte words, at most
    :data:`MAX_PAGE_BYTES`."""
    return 0 < page_bytes <= MAX_PAGE_BYTES and page_bytes % 4 == 0


def chunk_count(page_bytes: int) -> int:
    """BLAKE3 chunks in a page of ``page_bytes`` (at least one)."""
    return max(1, -(-page_bytes // CHUNK_BYTES))


def _power_of_two_at_least(value: int) -> int:
    return 1 << max(0, value - 1).bit_length()


@dataclass(frozen=True)
class KernelShape:
    """How one launch lays pages over programs and lanes.

    ``chunk_lanes``: chunks of a page hashed side by side (a power of two; a page of more
    chunks goes through in tiles of that many). ``pages_per_program``: pages side by side in a
    program (a power of two). ``num_warps``: the program's warps. ``row_loads``: a block's 16
    words loaded as one ``(pages, lanes, 16)`` tile, coalesced, and handed to the lanes through
    shared memory, rather than as 16 word loads per lane (each a gather of words 1 KiB apart;
    and each memory access adds to the compile time).
    """

    chunk_lanes: int
    pages_per_program: int
    num_warps: int = 4
    row_loads: bool = True

    def __post_init__(self) -> None:
        for name in ("chunk_lanes", "pages_per_program", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two, not {value}")

    def programs(self, count: int) -> int:
        """Programs a launch over ``count`` pages runs."""
        return -(-count // self.pages_per_program)


@functools.lru_cache(maxsize=64)
def default_shape(page_bytes: int) -> KernelShape:
    """The shape used unless one is given: a lane per chunk up to
    :data:`DEFAULT_MAX_CHUNK_LANES`, pages side by side up to :data:`DEFAULT_PROGRAM_LANES`
    lanes a program, 4 warps, row loads."""
    lanes = min(_power_of_two_at_least(chunk_count(page_bytes)), DEFAULT_MAX_CHUNK_LANES)
    return KernelShape(chunk_lanes=lanes, pages_per_program=max(1, DEFAULT_PROGRAM_LANES // lanes))


if triton is not None:
    from kvsnap.transfer.blake3_compress import compress, iv

    _CHUNK_START = tl.constexpr(CHUNK_START)
    _CHUNK_END = tl.constexpr(CHUNK_END)
    _PARENT = tl.constexpr(PARENT)
    _ROOT = tl.constexpr(ROOT)

    @triton.jit
    def _quarters(x):
        """``x[..., a, b]`` for ``2a + b`` = 0, 1, 2, 3 (``x``'s last two axes of size 2)."""
        low, high = tl.split(x)
        low_low, low_high = tl.split(low)
        high_low, high_high = tl.split(high)
        return low_low, high_low, low_high, high_high

    @triton.jit
    def _word(words, at, INDEX: tl.constexpr, limit, MASKED: tl.constexpr):
        """Word ``at + INDEX`` of ``words`` as uint32; 0 from word ``limit`` on if ``MASKED``."""
        if MASKED:
            value = tl.load(words + at + INDEX, mask=INDEX < limit, other=0)
        else:
            value = tl.load(words + at + INDEX)
        return value.to(tl.uint32, bitcast=True)

    @triton.jit
    def _load_block(words, at, limit, MASKED: tl.constexpr, ROW_LOADS: tl.constexpr):
        """The 16 message words at word offsets ``at + 0..15`` of ``words``, 0 from ``limit``
        on where ``MASKED`` (the zero padding of a page's last block, and lanes past it)."""
        if ROW_LOADS:
            offsets = tl.arange(0, 16)[None, None, :]
            if MASKED:
                row = tl.load(
                    words + at[:, :, None] + offsets, mask=offsets < limit[:, :, None], other=0
                )
            else:
                row = tl.load(words + at[:, :, None] + offsets)
            # Word 8a + 4b + 2c + d at [..., a, b, c, d].
            row = tl.reshape(
                row.to(tl.uint32, bitcast=True), [at.shape[0], at.shape[1], 2, 2, 2, 2]
            )
            r0, r1, r2, r3 = _quarters(row)  # by the word's index mod 4
            m0, m4, m8, m12 = _quarters(r0)
            m1, m5, m9, m13 = _quarters(r1)
            m2, m6, m10, m14 = _quarters(r2)
            m3, m7, m11, m15 = _quarters(r3)
        else:
            m0, m1 = _word(words, at, 0, limit, MASKED), _word(words, at, 1, limit, MASKED)
            m2, m3 = _word(words, at, 2, limit, MASKED), _word(words, at, 3, limit, MASKED)
            m4, m5 = _word(words, at, 4, limit, MASKED), _word(words, at, 5, limit, MASKED)
            m6, m7 = _word(words, at, 6, limit, MASKED), _word(words, at, 7, limit, MASKED)
            m8, m9 = _word(words, at, 8, limit, MASKED), _word(words, at, 9, limit, MASKED)
            m10, m11 = _word(words, at, 10, limit, MASKED), _word(words, at, 11, limit, MASKED)
            m12, m13 = _word(words, at, 12, limit, MASKED), _word(words, at, 13, limit, MASKED)
            m14, m15 = _word(words, at, 14, limit, MASKED), _word(words, at, 15, limit, MASKED)
        return m0, m1, m2, m3, m4, m5, m6, m7, m8, m9, m10, m11, m12, m13, m14, m15

    @triton.jit
    def _chunk_chaining_values(
        words,
        base,
        first_chunk,
        PAGE_BYTES: tl.constexpr,
        LANES: tl.constexpr,
        ROW_LOADS: tl.constexpr,
    ):
        """The chaining values of chunks ``first_chunk + 0..LANES-1`` of the pages at 8-byte
        word ``base`` (``(PAGES,)``) of ``words``: 8 ``(PAGES, LANES)`` tensors. A lane past
        the page's last chunk holds garbage, which the tree never reads."""
        CHUNKS: tl.constexpr = (PAGE_BYTES + 1023) // 1024
        LAST_CHUNK_BYTES: tl.constexpr = PAGE_BYTES - (CHUNKS - 1) * 1024
        LAST_BLOCKS: tl.constexpr = (LAST_CHUNK_BYTES + 63) // 64
        LAST_BLOCK_BYTES: tl.constexpr = LAST_CHUNK_BYTES - (LAST_BLOCKS - 1) * 64
        BLOCKS: tl.constexpr = 16 if CHUNKS > 1 else LAST_BLOCKS
        # Every lane a whole chunk of the page: no masks, no per-lane flags.
        WHOLE: tl.constexpr = LAST_CHUNK_BYTES == 1024 and CHUNKS % LANES == 0
        # A one-chunk page is rooted at its last block.
        END_FLAGS: tl.constexpr = _CHUNK_END | _ROOT if CHUNKS == 1 else _CHUNK_END
        chunk = first_chunk + tl.arange(0, LANES)[None, :]
        at = base[:, None] * 2 + chunk * 256  # in 4-byte words
        counter = chunk.to(tl.uint32)
        last = chunk == CHUNKS - 1
        chunk_words = tl.where(chunk < CHUNKS - 1, 256, tl.where(last, LAST_CHUNK_BYTES // 4, 0))
        h0, h1, h2, h3, h4, h5, h6, h7 = iv(at.shape)
        for block in range(BLOCKS):
            limit = chunk_words - block * 16 + tl.zeros(at.shape, tl.int32)
            m0, m1, m2, m3, m4, m5, m6, m7, m8, m9, m10, m11, m12, m13, m14, m15 = _load_block(
                words, at + block * 16, limit, not WHOLE, ROW_LOADS
            )
            start = tl.where(block == 0, _CHUNK_START, 0)
            if WHOLE:
                flags = start | tl.where(block == 15, END_FLAGS, 0)
                block_len = 64
            else:
                ends = tl.where(last, LAST_BLOCKS - 1, 15) == block
                flags = start | tl.where(ends, END_FLAGS, 0)
                block_len = tl.where(last & ends, LAST_BLOCK_BYTES, 64)
            n0, n1, n2, n3, n4, n5, n6, n7 = compress(
                h0, h1, h2, h3, h4, h5, h6, h7,
                m0, m1, m2, m3, m4, m5, m6, m7, m8, m9, m10, m11, m12, m13, m14, m15,
                counter, block_len, flags,
            )  # fmt: skip
            if WHOLE or LAST_BLOCKS == 16:
                h0, h1, h2, h3, h4, h5, h6, h7 = n0, n1, n2, n3, n4, n5, n6, n7
            else:
                # The last chunk's lane stops at its last block.
                done = last & (block >= LAST_BLOCKS)
                h0, h1 = tl.where(done, h0, n0), tl.where(done, h1, n1)
                h2, h3 = tl.where(done, h2, n2), tl.where(done, h3, n3)
                h4, h5 = tl.where(done, h4, n4), tl.where(done, h5, n5)
                h6, h7 = tl.where(done, h6, n6), tl.where(done, h7, n7)
        return h0, h1, h2, h3, h4, h5, h6, h7

    @triton.jit
    def _halves(x):
        """The even and the odd columns of ``x`` (``(PAGES, WIDTH)``)."""
        return tl.split(tl.reshape(x, [x.shape[0], x.shape[1] // 2, 2]))

    @triton.jit
    def _pairs(x):
        """Columns ``2j`` and ``2j + 1`` of ``x`` (``(PAGES, WIDTH)``) at column ``j`` of two
        tensors of ``x``'s shape (columns ``WIDTH / 2`` on repeat the first half)."""
        even, odd = _halves(x)
        shape: tl.constexpr = [x.shape[0], x.shape[1]]
        even = tl.reshape(tl.permute(tl.join(even, even), (0, 2, 1)), shape)
        odd = tl.reshape(tl.permute(tl.join(odd, odd), (0, 2, 1)), shape)
        return even, odd

    @triton.jit
    def _first_column(x, LEVELS: tl.constexpr):
        """Column 0 of ``x`` (``(PAGES, 2**LEVELS)``), as ``(PAGES, 1)``."""
        for _ in tl.static_range(LEVELS):
            x, _ = _halves(x)
        return x

    @triton.jit
    def _merge(h0, h1, h2, h3, h4, h5, h6, h7, nodes, LEVELS: tl.constexpr, ROOTED: tl.constexpr):
        """Merge each row's first ``nodes`` chaining values (of ``2**LEVELS`` columns) up
        BLAKE3's tree: level by level, node ``2j`` with ``2j + 1``, a last odd node carried
        up. ``ROOTED``: the merge ends at the page's root, flagged ``ROOT``. Returns 8
        ``(PAGES, 1)`` tensors."""
        if LEVELS > 0:
            h0, h1, h2, h3, h4, h5, h6, h7 = _merge_levels(
                h0, h1, h2, h3, h4, h5, h6, h7, nodes, LEVELS, ROOTED
            )
        return h0, h1, h2, h3, h4, h5, h6, h7

    @triton.jit
    def _merge_levels(
        h0, h1, h2, h3, h4, h5, h6, h7, nodes, LEVELS: tl.constexpr, ROOTED: tl.constexpr
    ):
        """:func:`_merge` of at least one level. One compression in a loop over the levels,
        at half the width each time (node ``j`` of a level in column ``j``, the columns past
        the level's nodes idle), rather than one per level at shrinking widths: the same work
        for the warps once the width is below their threads, a fraction of the compile
        time."""
        l0, r0 = _halves(h0)
        l1, r1 = _halves(h1)
        l2, r2 = _halves(h2)
        l3, r3 = _halves(h3)
        l4, r4 = _halves(h4)
        l5, r5 = _halves(h5)
        l6, r6 = _halves(h6)
        l7, r7 = _halves(h7)
        node = tl.arange(0, l0.shape[1])[None, :]
        nodes = tl.zeros([], tl.int32) + nodes  # a count that changes in the loop below
        for _ in range(LEVELS):
            if ROOTED:
                flags = tl.where(nodes == 2, _PARENT | _ROOT, _PARENT)
            else:
                flags = _PARENT
            k0, k1, k2, k3, k4, k5, k6, k7 = iv(l0.shape)
            p0, p1, p2, p3, p4, p5, p6, p7 = compress(
                k0, k1, k2, k3, k4, k5, k6, k7,
                l0, l1, l2, l3, l4, l5, l6, l7, r0, r1, r2, r3, r4, r5, r6, r7,
                0, 64, flags,
            )  # fmt: skip
            paired = 2 * node + 1 < nodes
            nodes = (nodes + 1) // 2
            if LEVELS > 1:
                l0, r0 = _pairs(tl.where(paired, p0, l0))
                l1, r1 = _pairs(tl.where(paired, p1, l1))
                l2, r2 = _pairs(tl.where(paired, p2, l2))
                l3, r3 = _pairs(tl.where(paired, p3, l3))
                l4, r4 = _pairs(tl.where(paired, p4, l4))
                l5, r5 = _pairs(tl.where(paired, p5, l5))
                l6, r6 = _pairs(tl.where(paired, p6, l6))
                l7, r7 = _pairs(tl.where(paired, p7, l7))
            else:
                l0, l1 = tl.where(paired, p0, l0), tl.where(paired, p1, l1)
                l2, l3 = tl.where(paired, p2, l2), tl.where(paired, p3, l3)
                l4, l5 = tl.where(paired, p4, l4), tl.where(paired, p5, l5)
                l6, l7 = tl.where(paired, p6, l6), tl.where(paired, p7, l7)
        # The root is node 0 of the last level, left in column 0 by the last pairing.
        return (
            _first_column(l0, LEVELS - 1), _first_column(l1, LEVELS - 1),
            _first_column(l2, LEVELS - 1), _first_column(l3, LEVELS - 1),
            _first_column(l4, LEVELS - 1), _first_column(l5, LEVELS - 1),
            _first_column(l6, LEVELS - 1), _first_column(l7, LEVELS - 1),
        )  # fmt: skip

    @triton.jit
    def _tile_roots(
        words,
        base,
        PAGE_BYTES: tl.constexpr,
        LANES: tl.constexpr,
        LANE_LEVELS: tl.constexpr,
        TILES: tl.constexpr,
        TILE_LEVELS: tl.constexpr,
        ROW_LOADS: tl.constexpr,
    ):
        """The roots of each page's tiles of ``LANES`` chunks (aligned power-of-two runs, so
        subtrees of BLAKE3's tree; the last one shorter): 8 ``(PAGES, 2**TILE_LEVELS)``
        tensors, tile ``t`` in column ``t``."""
        CHUNKS: tl.constexpr = (PAGE_BYTES + 1023) // 1024
        column = tl.arange(0, 1 << TILE_LEVELS)[None, :]
        shape: tl.constexpr = [base.shape[0], 1 << TILE_LEVELS]
        t0, t1 = tl.zeros(shape, tl.uint32), tl.zeros(shape, tl.uint32)
        t2, t3 = tl.zeros(shape, tl.uint32), tl.zeros(shape, tl.uint32)
        t4, t5 = tl.zeros(shape, tl.uint32), tl.zeros(shape, tl.uint32)
        t6, t7 = tl.zeros(shape, tl.uint32), tl.zeros(shape, tl.uint32)
        for tile in range(TILES):
            h0, h1, h2, h3, h4, h5, h6, h7 = _chunk_chaining_values(
                words, base, tile * LANES, PAGE_BYTES, LANES, ROW_LOADS
            )
            nodes = tl.minimum(CHUNKS - tile * LANES, LANES)
            h0, h1, h2, h3, h4, h5, h6, h7 = _merge(
                h0, h1, h2, h3, h4, h5, h6, h7, nodes, LANE_LEVELS, False
            )
            here = column == tile
            t0, t1 = tl.where(here, h0, t0), tl.where(here, h1, t1)
            t2, t3 = tl.where(here, h2, t2), tl.where(here, h3, t3)
            t4, t5 = tl.where(here, h4, t4), tl.where(here, h5, t5)
            t6, t7 = tl.where(here, h6, t6), tl.where(here, h7, t7)
        return t0, t1, t2, t3, t4, t5, t6, t7

    @triton.jit
    def _digest_rows(h0, h1, h2, h3, h4, h5, h6, h7):
        """The 8 ``(PAGES, 1)`` digest words as one ``(PAGES, 8)`` tensor, word ``k`` in
        column ``k`` (one store or load for all: each memory access costs compile time)."""
        # Word 4a + 2b + c at [..., a, b, c]: the last join is the fastest axis.
        evens = tl.join(tl.join(h0, h4), tl.join(h2, h6))
        odds = tl.join(tl.join(h1, h5), tl.join(h3, h7))
        return tl.reshape(tl.join(evens, odds), [h0.shape[0], 8])

    def _page_blake3_kernel(
        words,
        page_words,
        out,
        stored,
        count,
        PAGE_BYTES: tl.constexpr,
        PAGES: tl.constexpr,
        LANES: tl.constexpr,
        LANE_LEVELS: tl.constexpr,
        TILE_LEVELS: tl.constexpr,
        ROW_LOADS: tl.constexpr,
        CHECK: tl.constexpr,
    ):
        """BLAKE3 of the pages at 8-byte word ``page_words[p]`` of ``words`` (int32), pages
        ``PAGES * program .. + PAGES - 1``: into ``out[p, 0..7]``, or with ``CHECK`` 1 into
        ``out[p]`` where they equal ``stored[p, 0..7]`` and 0 where they do not."""
        CHUNKS: tl.constexpr = (PAGE_BYTES + 1023) // 1024
        TILES: tl.constexpr = (CHUNKS + LANES - 1) // LANES
        page = tl.program_id(0) * PAGES + tl.arange(0, PAGES)
        live = page < count
        # A page past the end reads the buffer's first page's worth of bytes, and is not stored.
        base = tl.load(page_words + page, mask=live, other=0)
        if TILES == 1:
            h0, h1, h2, h3, h4, h5, h6, h7 = _chunk_chaining_values(
                words, base, 0, PAGE_BYTES, LANES, ROW_LOADS
            )
            h0, h1, h2, h3, h4, h5, h6, h7 = _merge(
                h0, h1, h2, h3, h4, h5, h6, h7, CHUNKS, LANE_LEVELS, True
            )
        else:
            h0, h1, h2, h3, h4, h5, h6, h7 = _tile_roots(
                words, base, PAGE_BYTES, LANES, LANE_LEVELS, TILES, TILE_LEVELS, ROW_LOADS
            )
            h0, h1, h2, h3, h4, h5, h6, h7 = _merge(
                h0, h1, h2, h3, h4, h5, h6, h7, TILES, TILE_LEVELS, True
            )
        digest = _digest_rows(h0, h1, h2, h3, h4, h5, h6, h7).to(tl.int32, bitcast=True)
        cells = page[:, None] * 8 + tl.arange(0, 8)[None, :]
        if CHECK:
            expected = tl.load(stored + cells, mask=live[:, None], other=0)
            differing = tl.sum((digest != expected).to(tl.int32), axis=1)
            tl.store(out + page, (differing == 0).to(tl.int64), mask=live)
        else:
            tl.store(out + cells, digest, mask=live[:, None])


def launch_page_blake3_at_words(
    buffer: torch.Tensor,
    page_words: torch.Tensor,
    page_bytes: int,
    digests: torch.Tensor,
    shape: KernelShape | None = None,
) -> None:
    """Enqueue, on the current stream, the BLAKE3-256 of each page at ``page_words`` (int64
    offsets in 8-byte words, on the device) of ``buffer`` (uint8) into ``digests`` (int32,
    contiguous ``(count, 8)``): row ``p`` is the digest's 8 little-endian 32-bit words."""
    _launch(buffer, page_words, page_bytes, digests, digests, shape, check=False)


def launch_page_blake3_checks_at_words(
    buffer: torch.Tensor,
    page_words: torch.Tensor,
    page_bytes: int,
    stored: torch.Tensor,
    page_ok: torch.Tensor,
    shape: KernelShape | None = None,
) -> None:
    """Enqueue, per page at ``page_words`` (8-byte words) of ``buffer``, whether its BLAKE3
    equals ``stored`` (int32, contiguous ``(count, 8)``, as :func:`launch_page_blake3_at_words`
    writes it): ``page_ok`` (int64) gets 1 where it does and 0 where it does not, on the
    current stream. One launch: a restore checks every page it scatters."""
    _launch(buffer, page_words, page_bytes, page_ok, stored, shape, check=True)


def _launch(
    buffer: torch.Tensor,
    page_words: torch.Tensor,
    page_bytes: int,
    out: torch.Tensor,
    stored: torch.Tensor,
    shape: KernelShape | None,
    check: bool,
) -> None:
    if not supports(page_bytes):
        raise ValueError(f"pages of {page_bytes} bytes are hashed on the host")
    shape = shape if shape is not None else default_shape(page_bytes)
    count = len(page_words)
    if count == 0:
        return
    tiles = -(-chunk_count(page_bytes) // shape.chunk_lanes)
    kernel_for(_page_blake3_kernel)[(shape.programs(count),)](
        buffer.view(torch.int32),
        page_words,
        out,
        stored,
        count,
        PAGE_BYTES=page_bytes,
        PAGES=shape.pages_per_program,
        LANES=shape.chunk_lanes,
        LANE_LEVELS=(shape.chunk_lanes - 1).bit_length(),
        TILE_LEVELS=(tiles - 1).bit_length(),
        ROW_LOADS=shape.row_loads,
        CHECK=check,
        num_warps=shape.num_warps,
    )
