"""Second preimages of XXH3-64: a page of chosen bytes with another page's xxh3-64.

An attacker's tool, kept for the tests that prove a signed snapshot refuses forged pages. It
shows why xxh3-64 (``kvsnap.block_checksums``) can catch accidents but cannot bind a page to
a signature: :func:`forge_page` turns any page into one with a chosen xxh3-64 by changing
four of its 8-byte words, in seconds on one core.

**XXH3's long path** (inputs over 240 bytes, default secret, seed 0). Eight 64-bit lanes
``acc[0..7]`` take the input in 64-byte stripes. A stripe of words ``w[0..7]`` read with keys
``k[0..7]`` (secret words) adds, for each lane ``i``::

    acc[i]     += lo32(w[i] ^ k[i]) * hi32(w[i] ^ k[i])
    acc[i ^ 1] += w[i]

Every 16 stripes (1,024 bytes) the lanes are *scrambled* (``acc ^= acc >> 47; acc ^= key;
acc *= PRIME32_1``), the only step that mixes one stripe's input into another's effect. The
stripes of the last, partial block follow the last scramble, then the *last stripe* (the
input's final 64 bytes, with its own keys). Then the lanes are merged and avalanched::

    h = len * PRIME64_1 + sum over j < 4 of fold64((acc[2j] ^ m[2j]) * (acc[2j+1] ^ m[2j+1]))
    digest = avalanche(h)

``fold64`` is the low 64 bits xor the high 64 bits of a 128-bit product, ``m`` are secret
words, and ``avalanche`` (xorshift 37, multiply by an odd constant, xorshift 32) is a
bijection of 64-bit words, so a digest fixes ``h`` and ``h`` is what a forger must hit.

**The free words.** Take the first stripe after the last scramble (byte ``B = 1024 *
((len - 1) // 1024)``; 0 for pages of up to 1,024 bytes, which have no scramble) and in it
the words of lanes 0, 2, 4, 6: bytes ``B``, ``B + 16``, ``B + 32``, ``B + 48``
(:func:`forged_word_offsets`). Each is read once, after the last
scramble and outside the last stripe (which starts at ``len - 64``), so it changes only lanes
``2j`` and ``2j + 1`` of its own pair, additively, and nothing mixes them before the merge.
With the other words fixed, the word ``x`` of pair ``j`` gives the merge term::

    T_j(x) = fold64((A[2j] + lo32(x ^ k) * hi32(x ^ k)) ^ m[2j], (A[2j+1] + x) ^ m[2j+1])

(``A``: the lanes without that word). A forgery is four words with ``T_0 + T_1 + T_2 + T_3 =
unavalanche(target) - len * PRIME64_1 (mod 2^64)``: four independent lists whose sum must
hit one value, Wagner's 4-list generalized birthday problem (CRYPTO 2002).

**The search.** Each list holds ``N = 2^22`` terms of distinct candidate words
(splitmix64 of a counter that the seed and attempt fix). Lists 0 and 1 are joined on the low
22 bits (pairs whose sum is 0 there), lists 2 and 3 likewise (sums equal to the target
there); each join keeps about ``N^2 / 2^22 = 2^22`` pairs. A pair from each whose full sums
add up to the target is a forgery: the low 22 bits hold already, the other 42 by chance, so
an attempt expects ``2^22 * 2^22 / 2^42 = 4`` of them (Poisson: it finds none with
probability ``e^-4``, under 2 %). A failed attempt retries with fresh candidates, at most
:data:`MAX_ATTEMPTS` times (all fail with probability under ``10^-10``). Work: ``O(N log N)``
with ``N = 2^22``, a little over ``2^(64/3)`` so that an attempt expects 4 solutions, where
brute force takes ``2^64`` tries (a plain birthday search finds collisions of two pages it
makes, not a page with a digest it is given). Measured on the 2-core VM, 2026-12-06 (numpy,
one thread): 2 to 3.5 s of CPU time a page of any size (the wall time on an idle machine),
and about 350 MiB peak RSS, 26 MiB of it the interpreter and numpy (the four lists, then the
two joins' pairs with int32 indices). Everything is deterministic for a given seed.

Supported: pages of more than 240 bytes in whole 8-byte words with at least 120 bytes from
``B`` to the end (so that the four words end before the last stripe begins): every multiple
of 1,024 bytes (4 KiB, 16 KiB, 18 KiB, 32 KiB pages) and most other sizes. A size whose last
scramble leaves 8 to 112 bytes (1,032 or 2,104, say) is refused with ``ValueError``.
"""

from __future__ import annotations

import numpy as np
import xxhash

__all__ = ["LIST_BITS", "MAX_ATTEMPTS", "forge_page", "forged_word_offsets", "supports"]

#: log2 of the candidates per list, and of the low bits the first joins match on.
LIST_BITS = 22
#: Attempts with fresh candidates before :func:`forge_page` gives up.
MAX_ATTEMPTS = 6

#: XXH3's default 192-byte secret (``XXH3_kSecret`` in xxhash.h).
_SECRET = bytes.fromhex(
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671f"
    "cb79e64eccc0e578825ad07dccff7221b8084674f743248ee03590e6813a264c"
    "3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364"
    "eac5ac8334d3ebc3c581a0fffa1363eb170ddd51b7f0da49d316552629d4689e"
    "2b16be587d47a1fc8ff8b8d17ad031ce45cb3a8f95160428afd7fbcabb4b407e"
)
_PRIME32_1 = 0x9E3779B1
_PRIME64_1 = 0x9E3779B185EBCA87
_INITIAL_LANES = (
    0xC2B2AE3D,  # PRIME32_3
    _PRIME64_1,
    0xC2B2AE3D27D4EB4F,  # PRIME64_2
    0x165667B19E3779F9,  # PRIME64_3
    0x85EBCA77C2B2AE63,  # PRIME64_4
    0x85EBCA77,  # PRIME32_2
    0x27D4EB2F165667C5,  # PRIME64_5
    _PRIME32_1,
)
_AVALANCHE = 0x165667919E3779F9
_MASK64 = (1 << 64) - 1
_STRIPE = 64
_BLOCK = 1024  # 16 stripes between scrambles
_MERGE_AT = 11  # secret offset of the merge keys
_LAST_STRIPE_AT = len(_SECRET) - _STRIPE - 7
_SCRAMBLE_AT = len(_SECRET) - _STRIPE
_FREE_LANES = (0, 2, 4, 6)  # one free word per lane pair (2j, 2j + 1)
_CHUNK = 1 << 20  # candidates computed per numpy pass, which bounds the temporaries


def _secret_word(offset: int) -> int:
    return int.from_bytes(_SECRET[offset : offset + 8], "little")


def _mul32(value: int) -> int:
    """lo32(value) * hi32(value), what a data word xor its key adds to its own lane."""
    return (value & 0xFFFFFFFF) * (value >> 32)


def _last_block_start(page_bytes: int) -> int:
    return _BLOCK * ((page_bytes - 1) // _BLOCK)


def supports(page_bytes: int) -> bool:
    """Whether :func:`forge_page` can forge pages of ``page_bytes`` bytes."""
    return (
        page_bytes > 240
        and page_bytes % 8 == 0
        and page_bytes - _last_block_start(page_bytes) >= 120
    )


def forged_word_offsets(page_bytes: int) -> tuple[int, ...]:
    """Byte offsets of the four 8-byte words :func:`forge_page` may change in a page of
    ``page_bytes``: lanes 0, 2, 4 and 6 of the first stripe after the page's last scramble."""
    if page_bytes <= 240 or page_bytes % 8:
        raise ValueError(
            f"pages of {page_bytes} bytes are not forged here: XXH3's long path takes more "
            "than 240 bytes, and the words changed are whole 8-byte words"
        )
    start = _last_block_start(page_bytes)
    if page_bytes - start < 120:
        raise ValueError(
            f"a page of {page_bytes} bytes has {page_bytes - start} bytes after its last "
            "scramble: no stripe there ends before its last stripe (at least 120 are needed)"
        )
    return tuple(start + 8 * lane for lane in _FREE_LANES)


def _lanes(words: list[int], page_bytes: int) -> list[int]:
    """XXH3's eight lanes after the last stripe, before the merge (the reference loop)."""
    acc = list(_INITIAL_LANES)

    def stripe(at: int, key_at: int) -> None:
        for lane in range(8):
            word = words[at + lane]
            acc[lane] = (acc[lane] + _mul32(word ^ _secret_word(key_at + 8 * lane))) & _MASK64
            acc[lane ^ 1] = (acc[lane ^ 1] + word) & _MASK64

    blocks = (page_bytes - 1) // _BLOCK
    for block in range(blocks):
        for index in range(_BLOCK // _STRIPE):
            stripe((block * _BLOCK + index * _STRIPE) // 8, 8 * index)
        for lane in range(8):
            mixed = acc[lane] ^ (acc[lane] >> 47) ^ _secret_word(_SCRAMBLE_AT + 8 * lane)
            acc[lane] = (mixed * _PRIME32_1) & _MASK64
    for index in range((page_bytes - 1 - blocks * _BLOCK) // _STRIPE):
        stripe((blocks * _BLOCK + index * _STRIPE) // 8, 8 * index)
    stripe((page_bytes - _STRIPE) // 8, _LAST_STRIPE_AT)
    return acc


def _unavalanche(digest: int) -> int:
    """The merged sum whose avalanche is ``digest`` (each step of the avalanche inverted)."""
    value = digest ^ (digest >> 32)  # a xorshift by 32 or more is its own inverse
    value = (value * pow(_AVALANCHE, -1, 1 << 64)) & _MASK64
    return value ^ (value >> 37)


def _splitmix64(counters: np.ndarray) -> np.ndarray:
    """A bijection of uint64 counters onto well-spread words (distinct counters, distinct
    words)."""
    value = counters + np.uint64(0x9E3779B97F4A7C15)
    value = (value ^ (value >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    value = (value ^ (value >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return value ^ (value >> np.uint64(31))


def _fold64(left: np.ndarray, right: np.ndarray) -> np.ndarray:
    """The low 64 bits xor the high 64 bits of each 128-bit product, in 32-bit halves."""
    low = np.uint64(0xFFFFFFFF)
    shift = np.uint64(32)
    left_lo, left_hi = left & low, left >> shift
    right_lo, right_hi = right & low, right >> shift
    lo_lo = left_lo * right_lo
    hi_lo = left_hi * right_lo
    cross = (lo_lo >> shift) + (hi_lo & low) + left_lo * right_hi  # cannot overflow
    upper = (hi_lo >> shift) + (cross >> shift) + left_hi * right_hi
    lower = (cross << shift) | (lo_lo & low)
    return lower ^ upper


class _Pair:
    """The merge term of lane pair ``j`` as a function of its free word."""

    def __init__(self, lanes: list[int], pair: int, old_word: int, counter_base: int) -> None:
        self.key = _secret_word(8 * _FREE_LANES[pair])
        # The lanes without the free word's contribution (both additive, both after the
        # last scramble).
        self.even = (lanes[2 * pair] - _mul32(old_word ^ self.key)) & _MASK64
        self.odd = (lanes[2 * pair + 1] - old_word) & _MASK64
        self.merge_even = _secret_word(_MERGE_AT + 16 * pair)
        self.merge_odd = _secret_word(_MERGE_AT + 16 * pair + 8)
        self.counter_base = counter_base

    def words(self, indices: np.ndarray) -> np.ndarray:
        """The candidate words at ``indices`` of this pair's list."""
        return _splitmix64(indices.astype(np.uint64) + np.uint64(self.counter_base))

    def terms(self) -> np.ndarray:
        """``T_j`` of all ``2^LIST_BITS`` candidates, computed a chunk at a time."""
        out = np.empty(1 << LIST_BITS, dtype=np.uint64)
        for start in range(0, len(out), _CHUNK):
            words = self.words(np.arange(start, min(start + _CHUNK, len(out))))
            mixed = words ^ np.uint64(self.key)
            even = np.uint64(self.even) + (mixed & np.uint64(0xFFFFFFFF)) * (mixed >> np.uint64(32))
            odd = np.uint64(self.odd) + words
            out[start : start + len(words)] = _fold64(
                even ^ np.uint64(self.merge_even), odd ^ np.uint64(self.merge_odd)
            )
        return out


def _join(left: np.ndarray, right: np.ndarray, residue: int) -> tuple[np.ndarray, ...]:
    """Every (i, j) with ``left[i] + right[j]`` equal to ``residue`` in the low
    :data:`LIST_BITS` bits, as (i, j, sum) arrays: right's indices sorted by those bits, with
    a count and a start per value, and each i paired with the run of the value it needs.
    Indices are int32 to halve the memory: about ``2^LIST_BITS`` pairs come out."""
    mask = np.uint64((1 << LIST_BITS) - 1)
    right_keys = (right & mask).astype(np.intp)
    by_key = np.argsort(right_keys).astype(np.int32)
    counts = np.bincount(right_keys, minlength=1 << LIST_BITS).astype(np.int32)
    del right_keys
    starts = np.cumsum(counts, dtype=np.int32) - counts
    wanted = ((np.uint64(residue) - left) & mask).astype(np.intp)
    matches = counts[wanted]
    del counts
    first = starts[wanted]
    del wanted, starts
    left_index = np.repeat(np.arange(len(left), dtype=np.int32), matches)
    ends = np.cumsum(matches, dtype=np.int32)
    # Each pair's rank inside its left element's group: its position minus the group's start.
    rank = np.arange(ends[-1], dtype=np.int32) - np.repeat(ends - matches, matches)
    del ends
    rank += np.repeat(first, matches)
    del first, matches
    right_index = by_key[rank]
    del rank, by_key
    return left_index, right_index, left[left_index] + right[right_index]


def _meet(front: np.ndarray, back: np.ndarray, total: int) -> list[tuple[int, int]]:
    """Every (a, b) with ``front[a] + back[b] == total`` (mod 2^64): the sums each needs,
    sorted, against ``back`` sorted (a merge, not random probes), then the few common values
    looked up."""
    wanted = np.uint64(total) - front
    wanted_sorted = np.sort(wanted)
    back_sorted = np.sort(back)
    at = np.searchsorted(back_sorted, wanted_sorted)
    np.minimum(at, len(back_sorted) - 1, out=at)
    common = np.unique(wanted_sorted[back_sorted[at] == wanted_sorted])
    del wanted_sorted, back_sorted, at
    return [
        (int(a), int(b))
        for value in common
        for a in np.flatnonzero(wanted == value)
        for b in np.flatnonzero(back == value)
    ]


def _attempt(pairs: list[_Pair], total: int) -> list[int] | None:
    """Four free words whose merge terms sum to ``total``, or ``None`` when this attempt's
    candidates hold none. Of several, the one with the smallest candidate indices (in list
    order), which no sort's order of equal keys can change."""
    low_bits = (1 << LIST_BITS) - 1
    first = _join(pairs[0].terms(), pairs[1].terms(), 0)
    second = _join(pairs[2].terms(), pairs[3].terms(), total & low_bits)
    found = [
        (int(first[0][a]), int(first[1][a]), int(second[0][b]), int(second[1][b]))
        for a, b in _meet(first[2], second[2], total)
    ]
    if not found:
        return None
    return [
        int(pair.words(np.array([index]))[0]) for pair, index in zip(pairs, min(found), strict=True)
    ]


def forge_page(replacement: bytes, target_digest: int, *, seed: int = 0) -> bytes:
    """``replacement`` with the four words at :func:`forged_word_offsets` changed so that its
    xxh3-64 (``xxhash.xxh3_64_intdigest``) is ``target_digest``. The same arguments give the
    same page. Raises ``ValueError`` for a page size it cannot forge and ``RuntimeError`` if
    :data:`MAX_ATTEMPTS` attempts find nothing (probability under ``10^-10``)."""
    if seed < 0:
        raise ValueError(f"the seed must be a non-negative integer, not {seed}")
    if not 0 <= target_digest <= _MASK64:
        raise ValueError(f"an xxh3-64 digest is an unsigned 64-bit integer, not {target_digest}")
    page_bytes = len(replacement)
    offsets = forged_word_offsets(page_bytes)
    words = np.frombuffer(replacement, dtype="<u8").tolist()
    lanes = _lanes(words, page_bytes)
    total = (_unavalanche(target_digest) - page_bytes * _PRIME64_1) & _MASK64
    for attempt in range(MAX_ATTEMPTS):
        pairs = [
            _Pair(
                lanes,
                pair,
                words[offset // 8],
                (((seed * MAX_ATTEMPTS + attempt) * len(offsets) + pair) << LIST_BITS) & _MASK64,
            )
            for pair, offset in enumerate(offsets)
        ]
        chosen = _attempt(pairs, total)
        if chosen is None:
            continue
        forged = bytearray(replacement)
        for offset, word in zip(offsets, chosen, strict=True):
            forged[offset : offset + 8] = word.to_bytes(8, "little")
        if xxhash.xxh3_64_intdigest(bytes(forged)) != target_digest:
            raise AssertionError("the forged page's xxh3-64 differs: the model of XXH3 is wrong")
        return bytes(forged)
    raise RuntimeError(
        f"no second preimage in {MAX_ATTEMPTS} attempts of 2^{LIST_BITS} candidates per list "
        f"(seed {seed}): each fails with probability about e^-4"
    )
