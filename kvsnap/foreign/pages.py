"""Where each key and value element sits inside a foreign page, and decoding pages with it.

A :class:`PageOrder` gives, for every ``(token, head, dim)`` of a page's heads, the element
offset of its key and of its value from the page's start. A :class:`FileOrder` tiles such pages
over a whole file (every layer, every worker's heads), so that a file decodes with one gather
for its keys and one for its values. The gathers are numpy's, one thread each: how fast a
conversion runs does not depend on torch's thread pool, which a busy CPU stalls. torch is
imported by the functions that make tensors: recognising, describing and verifying a foreign
path need none (the CLI's ``inspect`` and ``verify`` of one start without it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from kvsnap.errors import LayoutError

from .base import ForeignProblem

if TYPE_CHECKING:
    import torch

#: Named orders of pages whose ``(token, head)`` cells hold key then value (vLLM's CUDA
#: attention backends, FLASH_ATTN and TRITON_ATTN): heads inside tokens (vLLM's ``LBNHC``,
#: its CUDA default) or tokens inside heads (``LBHNC``).
CELL_ORDERS = ("cells-nhd", "cells-hnd")


@dataclass(frozen=True)
class PageOrder:
    """Element offsets of one page's keys and values, each ``(block_size, heads, head_dim)``."""

    key: np.ndarray
    value: np.ndarray
    name: str

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(block_size, heads, head_dim)`` of the pages this order decodes."""
        return tuple(self.key.shape)  # type: ignore[return-value]

    @property
    def elements(self) -> int:
        """Elements one page holds: every key and value element once."""
        return 2 * int(self.key.size)

    def decode(self, page: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The canonical key and value pages of ``page`` (a 1-D tensor of the page's elements)."""
        if page.numel() != self.elements:
            raise LayoutError(
                f"a page of {page.numel()} elements does not fit the {self.name} order "
                f"of {self.shape} keys and values ({self.elements} elements)"
            )
        words = _words(page)
        return _as_dtype(words[self.key], page.dtype), _as_dtype(words[self.value], page.dtype)


@dataclass(frozen=True)
class FileOrder:
    """Element offsets of every key and value of a file of pages, each ``(layers, block_size,
    heads, head_dim)``: per layer, each worker's page decoded by its :class:`PageOrder` into
    that worker's slice of the heads."""

    key: np.ndarray
    value: np.ndarray

    def decode(self, elements: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Every layer's canonical keys and values of ``elements`` (the file's elements as one
        1-D numpy array of any dtype): one single-threaded gather each."""
        return np.take(elements, self.key), np.take(elements, self.value)


def tile_pages(order: PageOrder, page_starts: Sequence[Sequence[int]]) -> FileOrder:
    """The :class:`FileOrder` of a file whose page of layer ``l`` and worker ``w`` starts at
    element ``page_starts[l][w]``; worker ``w`` holds heads ``w * heads .. (w + 1) * heads``
    of the ``order``'s ``heads`` per page."""
    starts = np.asarray(page_starts, dtype=np.int64)
    layers, workers = starts.shape
    block, heads, dim = order.shape
    # (layers, workers, block, heads, dim) -> (layers, block, workers * heads, dim).
    key = starts[:, :, None, None, None] + order.key[None, None]
    value = starts[:, :, None, None, None] + order.value[None, None]
    shape = (layers, block, workers * heads, dim)
    key = np.ascontiguousarray(key.transpose(0, 2, 1, 3, 4)).reshape(shape)
    value = np.ascontiguousarray(value.transpose(0, 2, 1, 3, 4)).reshape(shape)
    return FileOrder(key=key, value=value)


#: numpy integer types of each element size: a gather moves the bits, whatever the dtype.
_WORDS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _words(tensor: torch.Tensor) -> np.ndarray:
    """``tensor`` (CPU, contiguous) as a numpy array of unsigned words of its element size."""
    import torch

    return tensor.contiguous().view(torch.uint8).numpy().view(_WORDS[tensor.element_size()])


def _as_dtype(words: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """Words gathered by :func:`_words` back as a tensor of ``dtype``."""
    import torch

    return torch.from_numpy(np.ascontiguousarray(words)).view(dtype)


def decode_bytes(
    data: bytes | bytearray, dtype: torch.dtype, order: FileOrder
) -> tuple[torch.Tensor, torch.Tensor]:
    """The canonical keys and values, ``(layers, block_size, heads, head_dim)`` tensors of
    ``dtype``, of a file's bytes ``data`` laid out as ``order`` says."""
    size = dtype.itemsize
    elements = np.frombuffer(data, dtype=_WORDS[size], count=len(data) // size)
    key, value = order.decode(elements)
    return _as_dtype(key, dtype), _as_dtype(value, dtype)


def cell_order(name: str, block_size: int, heads: int, head_dim: int) -> PageOrder:
    """The order of a ``cells-nhd`` or ``cells-hnd`` page: each cell is key ‖ value."""
    tokens, head_ids, dims = np.indices((block_size, heads, head_dim), dtype=np.int64)
    if name == "cells-nhd":
        cell = tokens * heads + head_ids
    elif name == "cells-hnd":
        cell = head_ids * block_size + tokens
    else:
        raise LayoutError(f"unknown page order {name!r} (known: {', '.join(CELL_ORDERS)})")
    key = cell * 2 * head_dim + dims
    return PageOrder(key=key, value=key + head_dim, name=name)


def load_page_order(path: Path) -> PageOrder:
    """A page order saved as ``.npz`` with int64 arrays ``key`` and ``value`` of one shape
    ``(block_size, heads, head_dim)`` (an engine kernel's order, learned by probing it)."""
    try:
        with np.load(path, allow_pickle=False) as saved:
            key, value = saved["key"], saved["value"]
    except (OSError, KeyError, ValueError) as error:
        raise LayoutError(f"{path}: not a page order file ({error})") from None
    if key.shape != value.shape or key.ndim != 3 or key.dtype.kind != "i":
        raise LayoutError(f"{path}: key and value must be integer arrays of one 3-D shape")
    both = np.concatenate([key.ravel(), value.ravel()])
    if np.unique(both).size != both.size or both.min() < 0 or both.max() >= both.size:
        raise LayoutError(f"{path}: the offsets are not each element of the page exactly once")
    return PageOrder(key=key.astype(np.int64), value=value.astype(np.int64), name=path.name)


def own_tensor(words: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """A tensor of its own (the words may view the read-only bytes of the file)."""
    import torch

    return torch.from_numpy(np.array(words, order="C")).view(dtype)


def size_problems(files: list[Path], expected: int | None) -> list[ForeignProblem]:
    """Files of a size other than ``expected`` (or, unknown, than most of them have); empty ones."""
    sizes: dict[int, list[Path]] = {}
    for path in files:
        sizes.setdefault(path.stat().st_size, []).append(path)
    if expected is not None:
        return [
            ForeignProblem(str(page), f"{size} bytes, a file here has {expected}")
            for size, pages in sizes.items()
            if size != expected
            for page in pages
        ]
    if len(sizes) <= 1:
        return [ForeignProblem(str(page), "an empty file") for page in sizes.get(0, [])]
    common = max(sizes, key=lambda size: len(sizes[size]))
    return [
        ForeignProblem(str(page), f"{size} bytes, the other files have {common}")
        for size, pages in sizes.items()
        if size != common
        for page in pages
    ]
