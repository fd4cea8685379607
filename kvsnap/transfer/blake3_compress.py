"""BLAKE3's compression function as Triton code on ``uint32`` tensors, one compression per
element, for the page kernel of :mod:`kvsnap.transfer.page_blake3`.

A compression is 7 rounds of 8 quarter-rounds (BLAKE3's G) of 32-bit adds, xors and rotations,
12 instructions a quarter-round once compiled for sm_90: a rotation's two shifts become one
funnel shift, ``a + b + m`` one three-input add. The rounds are unrolled, so the message
permutation between them is renaming while the kernel is traced (a loop over the rounds kept
the permutation as register moves: 255 instructions a round for two lanes instead of 192).
"""

from __future__ import annotations

from kvsnap.transfer.triton_copy import tl, triton

if triton is not None:

    @triton.jit
    def iv(shape: tl.constexpr):
        """BLAKE3's initial chaining value (SHA-256's), the key of plain hash mode, as 8 uint32
        tensors of ``shape``."""
        return (
            tl.full(shape, 0x6A09E667, tl.uint32), tl.full(shape, 0xBB67AE85, tl.uint32),
            tl.full(shape, 0x3C6EF372, tl.uint32), tl.full(shape, 0xA54FF53A, tl.uint32),
            tl.full(shape, 0x510E527F, tl.uint32), tl.full(shape, 0x9B05688C, tl.uint32),
            tl.full(shape, 0x1F83D9AB, tl.uint32), tl.full(shape, 0x5BE0CD19, tl.uint32),
        )  # fmt: skip

    @triton.jit
    def _quarter_round(a, b, c, d, mx, my):
        """BLAKE3's G function. Sums wrap modulo 2**32 (no overflow check: Triton's interpreter
        would spend most of its time on it). Each rotation is a pair of shifts, which the
        compiler makes one funnel shift (``SHF.L.W`` on sm_90)."""
        a = tl.add(tl.add(a, b, sanitize_overflow=False), mx, sanitize_overflow=False)
        d = d ^ a
        d = (d >> 16) | (d << 16)
        c = tl.add(c, d, sanitize_overflow=False)
        b = b ^ c
        b = (b >> 12) | (b << 20)
        a = tl.add(tl.add(a, b, sanitize_overflow=False), my, sanitize_overflow=False)
        d = d ^ a
        d = (d >> 8) | (d << 24)
        c = tl.add(c, d, sanitize_overflow=False)
        b = b ^ c
        b = (b >> 7) | (b << 25)
        return a, b, c, d

    @triton.jit
    def _round(
        s0, s1, s2, s3, s4, s5, s6, s7, s8, s9, s10, s11, s12, s13, s14, s15,
        m0, m1, m2, m3, m4, m5, m6, m7, m8, m9, m10, m11, m12, m13, m14, m15,
    ):  # fmt: skip
        """One round: the columns, then the diagonals."""
        s0, s4, s8, s12 = _quarter_round(s0, s4, s8, s12, m0, m1)
        s1, s5, s9, s13 = _quarter_round(s1, s5, s9, s13, m2, m3)
        s2, s6, s10, s14 = _quarter_round(s2, s6, s10, s14, m4, m5)
        s3, s7, s11, s15 = _quarter_round(s3, s7, s11, s15, m6, m7)
        s0, s5, s10, s15 = _quarter_round(s0, s5, s10, s15, m8, m9)
        s1, s6, s11, s12 = _quarter_round(s1, s6, s11, s12, m10, m11)
        s2, s7, s8, s13 = _quarter_round(s2, s7, s8, s13, m12, m13)
        s3, s4, s9, s14 = _quarter_round(s3, s4, s9, s14, m14, m15)
        return s0, s1, s2, s3, s4, s5, s6, s7, s8, s9, s10, s11, s12, s13, s14, s15

    @triton.jit
    def compress(
        h0, h1, h2, h3, h4, h5, h6, h7,
        m0, m1, m2, m3, m4, m5, m6, m7, m8, m9, m10, m11, m12, m13, m14, m15,
        counter, block_len, flags,
    ):  # fmt: skip
        """The first 8 words of BLAKE3's compression of block ``m`` under chaining value ``h``
        (the next chaining value, or the digest of a ``ROOT`` compression). ``counter``'s
        high word is 0: a page has fewer than 2**32 chunks."""
        s0, s1, s2, s3, s4, s5, s6, s7 = h0, h1, h2, h3, h4, h5, h6, h7
        s8, s9, s10, s11, _, _, _, _ = iv(h0.shape)
        s12 = tl.zeros(h0.shape, tl.uint32) + counter
        s13 = tl.zeros(h0.shape, tl.uint32)
        s14 = tl.zeros(h0.shape, tl.uint32) + block_len
        s15 = tl.zeros(h0.shape, tl.uint32) + flags
        for _ in tl.static_range(7):
            s0, s1, s2, s3, s4, s5, s6, s7, s8, s9, s10, s11, s12, s13, s14, s15 = _round(
                s0, s1, s2, s3, s4, s5, s6, s7, s8, s9, s10, s11, s12, s13, s14, s15,
                m0, m1, m2, m3, m4, m5, m6, m7, m8, m9, m10, m11, m12, m13, m14, m15,
            )  # fmt: skip
            # BLAKE3's message permutation (the last one is dead code).
            m0, m1, m2, m3, m4, m5, m6, m7, m8, m9, m10, m11, m12, m13, m14, m15 = (
                m2, m6, m3, m10, m7, m0, m4, m13, m1, m11, m12, m5, m9, m14, m15, m8,
            )  # fmt: skip
        return s0 ^ s8, s1 ^ s9, s2 ^ s10, s3 ^ s11, s4 ^ s12, s5 ^ s13, s6 ^ s14, s7 ^ s15
