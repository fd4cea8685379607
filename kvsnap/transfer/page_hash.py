"""xxh3-64 of canonical pages on the GPU, bit-identical to ``xxhash.xxh3_64_intdigest``.

A snapshot stores the xxh3-64 of every page. Hashing on the host serializes on the GIL
(python-xxhash holds it), so a 268 MB restore spent longer hashing than reading. Pages pass
through the device staging buffer anyway: :func:`launch_page_digests` hashes each there, one
program per page, in the same pass over the slot the copy makes. Restores compare the digests
with the stored ones on the device and the scatter skips any page that differs; captures bring
the digests back with the data.

This is XXH3's long-input path (inputs over 240 bytes) with the default secret and seed 0:
stripes of 64 bytes accumulated into 8 lanes, a scramble every 1,024 bytes, the last stripe at
the end of the input, then the lanes merged and avalanched. Lanes are held as even and odd
halves so that ``acc[i ^ 1] += data[i]`` is a swap of halves, not a shuffle. Pages of 240 bytes
or less, or not a multiple of 8 bytes, are hashed on the host (:func:`supports`).
"""

from __future__ import annotations

import numpy as np
import torch

from kvsnap.transfer.triton_copy import kernel_for, tl, triton

#: XXH3's default 192-byte secret (``XXH3_kSecret``).
_SECRET = bytes.fromhex(
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671f"
    "cb79e64eccc0e578825ad07dccff7221b8084674f743248ee03590e6813a264c"
    "3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364"
    "eac5ac8334d3ebc3c581a0fffa1363eb170ddd51b7f0da49d316552629d4689e"
    "2b16be587d47a1fc8ff8b8d17ad031ce45cb3a8f95160428afd7fbcabb4b407e"
)
_PRIME32_1 = 0x9E3779B1
_PRIME32_2 = 0x85EBCA77
_PRIME32_3 = 0xC2B2AE3D
_PRIME64_1 = 0x9E3779B185EBCA87
_PRIME64_2 = 0xC2B2AE3D27D4EB4F
_PRIME64_3 = 0x165667B19E3779F9
_PRIME64_4 = 0x85EBCA77C2B2AE63
_PRIME64_5 = 0x27D4EB2F165667C5
_STRIPE = 64
_STRIPES_PER_BLOCK = (len(_SECRET) - _STRIPE) // 8  # 16
_BLOCK = _STRIPE * _STRIPES_PER_BLOCK  # 1,024 bytes between scrambles


def _words(offset: int, count: int = 8) -> list[int]:
    """``count`` little-endian u64 of the secret from byte ``offset`` (any alignment)."""
    return [
        int.from_bytes(_SECRET[offset + 8 * i : offset + 8 * i + 8], "little") for i in range(count)
    ]


def _signed(values: list[int]) -> list[int]:
    """u64 bit patterns as int64 values (what a torch int64 tensor can hold)."""
    return [value - (1 << 64) if value >= 1 << 63 else value for value in values]


def constant_table(page_bytes: int) -> np.ndarray:
    """The kernel's constants for pages of ``page_bytes`` (int64 bit patterns): 16 stripes x 8
    stripe keys, 8 scramble keys, 8 last-stripe keys, 8 merge keys, 8 initial lanes, then
    ``page_bytes * PRIME64_1``."""
    stripe_keys = [word for stripe in range(_STRIPES_PER_BLOCK) for word in _words(8 * stripe)]
    scramble = _words(len(_SECRET) - _STRIPE)
    last = _words(len(_SECRET) - _STRIPE - 7)
    merge = _words(11)
    initial = [
        _PRIME32_3,
        _PRIME64_1,
        _PRIME64_2,
        _PRIME64_3,
        _PRIME64_4,
        _PRIME32_2,
        _PRIME64_5,
        _PRIME32_1,
    ]
    start = [(page_bytes * _PRIME64_1) % (1 << 64)]
    return np.array(
        _signed(stripe_keys + scramble + last + merge + initial + start), dtype=np.int64
    )


def supports(page_bytes: int) -> bool:
    """Whether pages of ``page_bytes`` take XXH3's long path, in whole 8-byte words."""
    return page_bytes > 240 and page_bytes % 8 == 0


if triton is not None:

    @triton.jit
    def _accumulate(acc_even, acc_odd, words, at, keys, half, low32):
        """One 64-byte stripe at word ``at`` into the lanes, with the 8 keys at ``keys``."""
        data_even = tl.load(words + at + half).to(tl.uint64, bitcast=True)
        data_odd = tl.load(words + at + half + 1).to(tl.uint64, bitcast=True)
        mixed_even = data_even ^ tl.load(keys + half).to(tl.uint64, bitcast=True)
        mixed_odd = data_odd ^ tl.load(keys + half + 1).to(tl.uint64, bitcast=True)
        # acc[i ^ 1] += data[i]: the odd lanes take the even data and the even lanes the odd.
        acc_even += data_odd + (mixed_even & low32) * (mixed_even >> 32)
        acc_odd += data_even + (mixed_odd & low32) * (mixed_odd >> 32)
        return acc_even, acc_odd

    @triton.jit
    def _scramble(acc, keys, prime32_1):
        """The scramble at the end of each 1 KiB block: ``acc`` with its top bits folded in,
        xored with the scramble keys at ``keys``, times PRIME32_1."""
        return ((acc ^ (acc >> 47)) ^ tl.load(keys).to(tl.uint64, bitcast=True)) * prime32_1

    @triton.jit
    def _fold(left, right, low32):
        """The low 64 bits xor the high 64 bits of each 128-bit product ``left * right``."""
        left_lo, left_hi = left & low32, left >> 32
        right_lo, right_hi = right & low32, right >> 32
        lo_lo = left_lo * right_lo
        hi_lo = left_hi * right_lo
        lo_hi = left_lo * right_hi
        cross = (lo_lo >> 32) + (hi_lo & low32) + lo_hi
        upper = (hi_lo >> 32) + (cross >> 32) + left_hi * right_hi
        lower = (cross << 32) | (lo_lo & low32)
        return lower ^ upper

    def _page_digest_kernel(
        words,
        page_words,
        constants,
        out,
        stored,
        PAGE_BYTES: tl.constexpr,
        CHECK: tl.constexpr,
    ):
        """xxh3-64 of the page at word ``page_words[p]`` of ``words``, into ``out[p]``; with
        ``CHECK``, ``out[p]`` is 1 where it equals ``stored[p]`` and 0 where it does not.

        ``constants`` is :func:`constant_table`: stripe keys at 0, scramble keys at 128,
        last-stripe keys at 136, merge keys at 144, initial lanes at 152, the seed at 160.
        """
        page = tl.program_id(0)
        base = tl.load(page_words + page)
        half = tl.arange(0, 4) * 2  # even lanes; odd lanes are half + 1
        # Every constant typed u64: a signed operand would make a later shift arithmetic.
        low32 = tl.full([4], 0xFFFFFFFF, tl.uint64)
        prime32_1 = tl.full([4], 0x9E3779B1, tl.uint64)
        acc_even = tl.load(constants + 152 + half).to(tl.uint64, bitcast=True)
        acc_odd = tl.load(constants + 153 + half).to(tl.uint64, bitcast=True)
        num_blocks: tl.constexpr = (PAGE_BYTES - 1) // 1024
        for block in range(num_blocks):
            for stripe in tl.static_range(16):
                acc_even, acc_odd = _accumulate(
                    acc_even,
                    acc_odd,
                    words,
                    base + block * 128 + stripe * 8,
                    constants + stripe * 8,
                    half,
                    low32,
                )
            acc_even = _scramble(acc_even, constants + 128 + half, prime32_1)
            acc_odd = _scramble(acc_odd, constants + 129 + half, prime32_1)
        last_stripes: tl.constexpr = ((PAGE_BYTES - 1) - 1024 * num_blocks) // 64
        for stripe in tl.static_range(last_stripes):
            acc_even, acc_odd = _accumulate(
                acc_even,
                acc_odd,
                words,
                base + num_blocks * 128 + stripe * 8,
                constants + stripe * 8,
                half,
                low32,
            )
        # The last stripe, at the end of the page, with its own keys.
        acc_even, acc_odd = _accumulate(
            acc_even, acc_odd, words, base + PAGE_BYTES // 8 - 8, constants + 136, half, low32
        )
        left = acc_even ^ tl.load(constants + 144 + half).to(tl.uint64, bitcast=True)
        right = acc_odd ^ tl.load(constants + 145 + half).to(tl.uint64, bitcast=True)
        seed = tl.load(constants + 160).to(tl.uint64, bitcast=True)
        result = seed + tl.sum(_fold(left, right, low32), 0)
        result = result ^ (result >> 37)
        result = result * 0x165667919E3779F9
        result = result ^ (result >> 32)
        digest = result.to(tl.int64, bitcast=True)
        if CHECK:
            tl.store(out + page, (digest == tl.load(stored + page)).to(tl.int64))
        else:
            tl.store(out + page, digest)


def launch_page_digests(
    buffer: torch.Tensor,
    page_offsets: torch.Tensor,
    page_bytes: int,
    constants: torch.Tensor,
    digests: torch.Tensor,
) -> None:
    """Enqueue the xxh3-64 of ``len(page_offsets)`` pages of ``buffer`` (uint8, pages at
    ``page_offsets`` bytes, 8-byte aligned) into ``digests`` (int64 bit patterns), on the
    current stream. ``constants`` is :func:`constant_table` on the buffer's device."""
    launch_page_digests_at_words(buffer, page_offsets // 8, page_bytes, constants, digests)


def launch_page_digests_at_words(
    buffer: torch.Tensor,
    page_words: torch.Tensor,
    page_bytes: int,
    constants: torch.Tensor,
    digests: torch.Tensor,
) -> None:
    """:func:`launch_page_digests` with the pages' offsets given in 8-byte words (one kernel
    launch fewer, for callers that upload the offsets anyway)."""
    if not supports(page_bytes):
        raise ValueError(f"pages of {page_bytes} bytes are hashed on the host")
    count = len(page_words)
    if count == 0:
        return
    words = buffer.view(torch.int64)
    kernel_for(_page_digest_kernel)[(count,)](
        words, page_words, constants, digests, digests, PAGE_BYTES=page_bytes, CHECK=False
    )


def launch_page_checks_at_words(
    buffer: torch.Tensor,
    page_words: torch.Tensor,
    page_bytes: int,
    constants: torch.Tensor,
    stored: torch.Tensor,
    page_ok: torch.Tensor,
) -> None:
    """Enqueue, per page at ``page_words`` (8-byte words) of ``buffer``, whether its xxh3-64
    equals ``stored`` (int64 bit patterns): ``page_ok`` gets 1 where it does and 0 where it
    does not (int64), on the current stream. One launch: a restore checks every page it
    scatters, and a separate compare would cost two more launches per piece."""
    if not supports(page_bytes):
        raise ValueError(f"pages of {page_bytes} bytes are hashed on the host")
    count = len(page_words)
    if count == 0:
        return
    kernel_for(_page_digest_kernel)[(count,)](
        buffer.view(torch.int64),
        page_words,
        constants,
        page_ok,
        stored,
        PAGE_BYTES=page_bytes,
        CHECK=True,
    )
