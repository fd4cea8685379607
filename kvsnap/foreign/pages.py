"""Where each key and value element sits inside a foreign page, and decoding pages with it.

A :class:`PageOrder` gives, for every ``(token, head, dim)`` of a page's heads, the element
offset of its key and of its value from the page's start. One gather then turns a page of any
engine layout into kvsnap's canonical ``(block_size, heads, head_dim)`` key and value pages.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kvsnap.errors import LayoutError

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
        key = page[torch.from_numpy(self.key)]
        value = page[torch.from_numpy(self.value)]
        return key, value


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
