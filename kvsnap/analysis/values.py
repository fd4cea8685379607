"""KV bytes as numbers: a snapshot's pages decoded to float32 (or float64) with numpy alone.

The analysis reads KV without torch (``kvsnap inspect --stats`` and ``kvsnap diff`` start and
run without it, in bounded memory): each stored dtype has a decoder from its raw bytes into a
float array the caller owns. Every KV dtype widens exactly: bfloat16 is the top half of a
float32, float8 e5m2 the top byte of a float16, float8 e4m3fn a table of its 256 values.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from kvsnap.dtypes import kv_element

#: Decodes ``raw`` (the stored bytes, as uint8) into ``out`` (a float array of as many elements).
Decoder = Callable[[np.ndarray, np.ndarray], None]


def compute_dtype(first: str, second: str | None = None) -> np.dtype:
    """The dtype KV of snapshot dtypes ``first`` (and ``second``) is analysed in: float64 when
    either is float64, else float32, which holds every other KV dtype exactly."""
    wide = "float64" in (first, second)
    return np.dtype(np.float64 if wide else np.float32)


def _e4m3fn_table() -> np.ndarray:
    """The 256 values of float8 e4m3fn (no infinities; S.1111.111 is NaN)."""
    codes = np.arange(256)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exponent = (codes >> 3) & 0xF
    mantissa = codes & 0x7
    normal = (1.0 + mantissa / 8.0) * 2.0 ** (exponent - 7.0)
    subnormal = (mantissa / 8.0) * 2.0**-6
    values = sign * np.where(exponent == 0, subnormal, normal)
    values[(codes & 0x7F) == 0x7F] = np.nan
    return values


_E4M3FN = _e4m3fn_table()


def decoder(dtype: str, into: np.dtype) -> Decoder:
    """The decoder of snapshot dtype ``dtype`` into float arrays of dtype ``into``."""
    kv_element(dtype)  # an unknown name is refused here, with the names kvsnap stores
    table = _E4M3FN.astype(into)

    def bfloat16(raw: np.ndarray, out: np.ndarray) -> None:
        words = raw.view(np.uint16)
        if out.dtype == np.float32:
            np.left_shift(words, 16, out=out.view(np.uint32), dtype=np.uint32)
        else:
            out[...] = np.left_shift(words, 16, dtype=np.uint32).view(np.float32)

    def float8_e5m2(raw: np.ndarray, out: np.ndarray) -> None:
        halves = np.left_shift(raw, 8, dtype=np.uint16).view(np.float16)
        np.copyto(out, halves, casting="unsafe")

    def float8_e4m3fn(raw: np.ndarray, out: np.ndarray) -> None:
        np.take(table, raw, out=out)

    stored = _NUMPY_TYPES.get(dtype, np.dtype(np.uint8))

    def plain(raw: np.ndarray, out: np.ndarray) -> None:
        np.copyto(out, raw.view(stored), casting="unsafe")

    special = {"bfloat16": bfloat16, "float8_e5m2": float8_e5m2, "float8_e4m3fn": float8_e4m3fn}
    return special.get(dtype, plain)


#: The numpy dtypes numpy reads natively.
_NUMPY_TYPES: dict[str, np.dtype[Any]] = {
    "float16": np.dtype(np.float16),
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
    "int8": np.dtype(np.int8),
    "uint8": np.dtype(np.uint8),
}


def decode(raw: np.ndarray, dtype: str, into: np.dtype | None = None) -> np.ndarray:
    """``raw`` bytes of snapshot dtype ``dtype`` as a new float array (float32 by default)."""
    target = compute_dtype(dtype) if into is None else into
    out = np.empty(raw.size // kv_element(dtype).size, dtype=target)
    decoder(dtype, target)(raw.reshape(-1), out)
    return out
