"""Registered engine tensors and the complete description of one rank's cache.

* :class:`CacheTensor`: a registered engine tensor seen as ``num_blocks`` blocks of bytes, block
  ``b`` starting ``b * block_stride_bytes`` after ``data_ptr``.
* :class:`PageRef`: one (layer, part) inside one cache tensor, with the
  :class:`~kvsnap.layout.mapping.CanonicalPageMapping` (copy runs) from local page bytes to
  canonical page bytes.
* :class:`CacheLayout`: geometry, tensors and page references, checked on construction.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvsnap.caches import register_cache_clear
from kvsnap.errors import LayoutError
from kvsnap.layout.geometry import KVGeometry, canonical_name
from kvsnap.layout.mapping import CanonicalPageMapping, coverage


@dataclass(frozen=True)
class PageRef:
    """One (layer, part) of the model inside one registered cache tensor."""

    tensor_index: int
    layer: int
    part: str
    mapping: CanonicalPageMapping

    @functools.cached_property
    def name(self) -> str:
        return canonical_name(self.layer, self.part)


@dataclass(frozen=True)
class CacheTensor:
    """A registered engine tensor seen as ``num_blocks`` blocks of bytes.

    Block ``b`` starts at ``data_ptr + b * block_stride_bytes``; a :class:`PageRef`'s runs give
    offsets from there, and may reach past ``block_stride_bytes`` (a contiguous per-layer tensor
    cut into blocks along its sequence axis has each head's rows far apart).
    """

    tensor: torch.Tensor
    num_blocks: int
    block_stride_bytes: int
    data_ptr: int

    @property
    def device(self) -> torch.device:
        return self.tensor.device

    @property
    def storage_span(self) -> tuple[int, int]:
        """``(first, end)`` addresses of the memory this tensor's storage owns."""
        storage = self.tensor.untyped_storage()
        return storage.data_ptr(), storage.data_ptr() + storage.nbytes()


@dataclass
class CacheLayout:
    """A complete description of one rank's KV cache: geometry, tensors and page references.

    Built by the constructors below (or by an engine integration); construction checks that
    every run stays inside its tensor's storage and that this rank's runs cover each canonical
    page at most once. :func:`check_tiling` checks a full set of ranks covers it exactly once.
    """

    geometry: KVGeometry
    tensors: list[CacheTensor]
    refs: list[PageRef]
    encoding: str
    tp_rank: int = 0
    tp_size: int = 1
    _by_name: dict[str, PageRef] = field(init=False, repr=False)
    _num_blocks: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not 0 <= self.tp_rank < self.tp_size:
            raise LayoutError(f"tp_rank {self.tp_rank} is outside tp_size {self.tp_size}")
        self._by_name = {}
        for ref in self.refs:
            if ref.name in self._by_name:
                raise LayoutError(f"{ref.name} is described twice in one layout")
            if not 0 <= ref.tensor_index < len(self.tensors):
                raise LayoutError(
                    f"{ref.name} points at tensor {ref.tensor_index}, which is not registered"
                )
            self._by_name[ref.name] = ref
            _check_runs_inside_tensor(ref, self.tensors[ref.tensor_index])
            _check_no_canonical_overlap(ref.name, ref.mapping)
        expected = set(self.geometry.tensor_names())
        missing = expected - self._by_name.keys()
        extra = self._by_name.keys() - expected
        if missing or extra:
            raise LayoutError(
                f"layout does not match its geometry: missing {sorted(missing)[:4]}, "
                f"unexpected {sorted(extra)[:4]}"
            )
        # Asked on every restore; a layout's tensors are fixed once it is checked.
        self._num_blocks = min(tensor.num_blocks for tensor in self.tensors)

    @property
    def num_blocks(self) -> int:
        """Blocks addressable in every registered tensor."""
        return self._num_blocks

    @property
    def device(self) -> torch.device:
        return self.tensors[0].device

    def ref(self, name: str) -> PageRef:
        """The page reference for canonical tensor ``name`` (``layers.0.key``)."""
        return self._by_name[name]

    def describe(self) -> str:
        tp = f", TP rank {self.tp_rank}/{self.tp_size}" if self.tp_size > 1 else ""
        return f"{self.encoding}: {self.geometry.describe()}, {self.num_blocks} blocks{tp}"


def _check_runs_inside_tensor(ref: PageRef, tensor: CacheTensor) -> None:
    first, end = tensor.storage_span
    last_block_start = tensor.data_ptr + (tensor.num_blocks - 1) * tensor.block_stride_bytes
    for run in ref.mapping.runs:
        lowest = (
            tensor.data_ptr + run.local_offset + min(0, (run.num_fragments - 1) * run.local_stride)
        )
        highest = (
            last_block_start
            + run.local_offset
            + max(0, (run.num_fragments - 1) * run.local_stride)
            + run.fragment_size
        )
        if lowest < first or highest > end:
            raise LayoutError(f"{ref.name}: a copy run reaches outside its tensor's memory ({run})")
        canonical_end = run.canonical_offset + (run.num_fragments - 1) * run.canonical_stride
        if (
            run.canonical_offset < 0
            or canonical_end + run.fragment_size > ref.mapping.canonical_page_size_bytes
        ):
            raise LayoutError(f"{ref.name}: a copy run reaches outside the canonical page ({run})")


def _check_no_canonical_overlap(name: str, mapping: CanonicalPageMapping) -> None:
    if _writes_a_byte_twice(mapping):
        raise LayoutError(f"{name}: copy runs write some canonical bytes twice")


# Every layer of a cache usually maps its page the same way: the mapping is checked once.
@functools.lru_cache(maxsize=256)
def _writes_a_byte_twice(mapping: CanonicalPageMapping) -> bool:
    return bool(mapping.canonical_page_size_bytes and coverage(mapping).max(initial=0) > 1)


register_cache_clear(_writes_a_byte_twice.cache_clear)


class LayoutTemplate:
    """A checked :class:`CacheLayout` without its tensors, to lay over new tensors of the same
    shapes, strides, dtype and device (a cache allocated anew per call, as transformers'
    ``DynamicCache`` is) without building and checking the layout again.

    Holds no tensor, so keeping one keeps no cache alive.
    """

    def __init__(self, layout: CacheLayout) -> None:
        # The layout's own object without tensors: copied per use, so no check runs again
        # (its page references and name map are never modified after construction).
        self._skeleton = copy.copy(layout)
        self._skeleton.tensors = []
        self._tensors = [
            (t.num_blocks, t.block_stride_bytes, _place(t.tensor)) for t in layout.tensors
        ]

    def over(self, tensors: Sequence[torch.Tensor], *, check_all: bool = True) -> CacheLayout:
        """The layout with ``tensors[i]`` in place of its tensor ``i``. Raises
        :class:`LayoutError` when a tensor differs from the one it replaces in shape, strides,
        dtype, device or offset into its storage, or has a smaller storage: only then do the
        copy runs, checked once, stay inside it.

        ``check_all=False`` checks the first tensor only, for tensors made exactly as the
        template's were (the same indexing of a new buffer of the same shape, dtype and
        device), whose places then match by construction: ~1.5 us a tensor saved."""
        if len(tensors) != len(self._tensors):
            raise LayoutError(f"the layout has {len(self._tensors)} tensors, {len(tensors)} given")
        moved = []
        for index, ((num_blocks, stride, place), tensor) in enumerate(
            zip(self._tensors, tensors, strict=True)
        ):
            if check_all or index == 0:
                now = _place(tensor)
                if now[:-1] != place[:-1] or now[-1] < place[-1]:
                    raise LayoutError(
                        f"tensor {index} is not laid out as the template's ({now} against {place})"
                    )
            moved.append(CacheTensor(tensor, num_blocks, stride, tensor.data_ptr()))
        layout = copy.copy(self._skeleton)
        layout.tensors = moved
        return layout


def _place(tensor: torch.Tensor) -> tuple[object, ...]:
    """What a copy run's bounds depend on: shape, strides, dtype, device, the offset into the
    storage, and last the storage's size."""
    return (
        tensor.shape,
        tensor.stride(),
        tensor.dtype,
        tensor.device,
        tensor.storage_offset(),
        tensor.untyped_storage().nbytes(),
    )
