"""The one dtype table: every element type kvsnap stores, under each name it goes by.

A KV dtype has a snapshot name (``"bfloat16"``, what kvsnap's metadata records), a safetensors
name (``"BF16"``, what the file's header records), a torch dtype and an element size. Index
tensors (``I64``/``U64``) exist only under their safetensors names. Every other module asks this
one; none keeps a table of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ElementType:
    """One element type: its names, its torch dtype and its size in bytes."""

    name: str | None  # the snapshot name; None for types that are never KV (index tensors)
    safetensors: str
    torch: torch.dtype
    size: int


_TYPES = (
    ElementType("bfloat16", "BF16", torch.bfloat16, 2),
    ElementType("float16", "F16", torch.float16, 2),
    ElementType("float32", "F32", torch.float32, 4),
    ElementType("float64", "F64", torch.float64, 8),
    ElementType("float8_e4m3fn", "F8_E4M3", torch.float8_e4m3fn, 1),
    ElementType("float8_e5m2", "F8_E5M2", torch.float8_e5m2, 1),
    ElementType("int8", "I8", torch.int8, 1),
    ElementType("uint8", "U8", torch.uint8, 1),
    ElementType(None, "I64", torch.int64, 8),
    ElementType(None, "U64", torch.uint64, 8),
)

#: KV dtypes by snapshot name.
KV_DTYPES: dict[str, ElementType] = {t.name: t for t in _TYPES if t.name is not None}
#: Every element type by safetensors name (KV and index tensors).
SAFETENSORS_TYPES: dict[str, ElementType] = {t.safetensors: t for t in _TYPES}

#: Unsigned integer words by size, for moving raw bytes a word at a time.
WORD_DTYPES: dict[int, torch.dtype] = {
    8: torch.int64,
    4: torch.int32,
    2: torch.int16,
    1: torch.uint8,
}


def kv_dtype_name(dtype: torch.dtype) -> str:
    """The snapshot name of a torch KV dtype (``torch.bfloat16`` -> ``"bfloat16"``).

    Raises :class:`~kvsnap.errors.LayoutError` for a dtype kvsnap does not store.
    """
    for element in KV_DTYPES.values():
        if element.torch == dtype:
            return element.name  # type: ignore[return-value]
    from kvsnap.errors import LayoutError

    raise LayoutError(f"unsupported KV dtype {dtype}; supported: {', '.join(KV_DTYPES)}")


def kv_torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a snapshot dtype name; :class:`~kvsnap.errors.LayoutError` if unknown."""
    element = KV_DTYPES.get(name)
    if element is None:
        from kvsnap.errors import LayoutError

        raise LayoutError(f"unknown KV dtype {name!r}; supported: {', '.join(KV_DTYPES)}")
    return element.torch
