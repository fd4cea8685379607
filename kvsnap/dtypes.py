"""The one dtype table: every element type kvsnap stores, under each name it goes by.

A KV dtype has a snapshot name (``"bfloat16"``, what kvsnap's metadata records), a safetensors
name (``"BF16"``, what the file's header records), a torch dtype and an element size. Index
tensors (``I64``/``U64``) exist only under their safetensors names. Every other module asks this
one; none keeps a table of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvsnap.errors import LayoutError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class ElementType:
    """One element type: its names, its torch dtype and its size in bytes.

    The torch dtype is looked up on first use (:attr:`torch`): reading a snapshot's header,
    checksums and metadata does not import torch (the CLI's ``inspect`` and ``verify`` start
    without it).
    """

    name: str | None  # the snapshot name; None for types that are never KV (index tensors)
    safetensors: str
    torch_name: str  # the attribute of the ``torch`` module
    size: int

    @property
    def torch(self) -> torch.dtype:
        import torch

        return getattr(torch, self.torch_name)


_TYPES = (
    ElementType("bfloat16", "BF16", "bfloat16", 2),
    ElementType("float16", "F16", "float16", 2),
    ElementType("float32", "F32", "float32", 4),
    ElementType("float64", "F64", "float64", 8),
    ElementType("float8_e4m3fn", "F8_E4M3", "float8_e4m3fn", 1),
    ElementType("float8_e5m2", "F8_E5M2", "float8_e5m2", 1),
    ElementType("int8", "I8", "int8", 1),
    ElementType("uint8", "U8", "uint8", 1),
    ElementType(None, "I64", "int64", 8),
    ElementType(None, "U64", "uint64", 8),
)

#: KV dtypes by snapshot name.
KV_DTYPES: dict[str, ElementType] = {t.name: t for t in _TYPES if t.name is not None}
#: Every element type by safetensors name (KV and index tensors).
SAFETENSORS_TYPES: dict[str, ElementType] = {t.safetensors: t for t in _TYPES}

#: Integer word names by size (``WORD_DTYPES``: the torch dtypes), for moving raw bytes a word
#: at a time.
_WORD_NAMES = {8: "int64", 4: "int32", 2: "int16", 1: "uint8"}


def __getattr__(name: str) -> Any:
    # ``WORD_DTYPES`` needs torch: built on first use, so that importing this module does not.
    if name == "WORD_DTYPES":
        import torch

        return {size: getattr(torch, word) for size, word in _WORD_NAMES.items()}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def kv_dtype_name(dtype: torch.dtype) -> str:
    """The snapshot name of a torch KV dtype (``torch.bfloat16`` -> ``"bfloat16"``).

    Raises :class:`~kvsnap.errors.LayoutError` for a dtype kvsnap does not store.
    """
    for element in KV_DTYPES.values():
        if element.torch == dtype:
            return element.name  # type: ignore[return-value]
    raise LayoutError(f"unsupported KV dtype {dtype}; supported: {', '.join(KV_DTYPES)}")


def kv_element(name: str) -> ElementType:
    """The KV element type of a snapshot dtype name; :class:`~kvsnap.errors.LayoutError` if
    unknown (without importing torch)."""
    element = KV_DTYPES.get(name)
    if element is None:
        raise LayoutError(f"unknown KV dtype {name!r}; supported: {', '.join(KV_DTYPES)}")
    return element


def kv_torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a snapshot dtype name; :class:`~kvsnap.errors.LayoutError` if unknown."""
    return kv_element(name).torch
