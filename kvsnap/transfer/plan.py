"""Copy plans: turn "these device blocks of this tensor to those host pages" into copy descriptors.

A descriptor is one ``(source address, destination address, size)`` triple; a job's
descriptors are three int64 numpy arrays that every pointer-based backend executes. Building
them is the host-side hot path of every transfer, so it is vectorized: per :class:`PageRef` a
fragment template is unrolled once from its copy runs, and a batch of blocks becomes an outer
sum of block base addresses and template offsets — no Python loop per block or per fragment.

Host pages hold canonical pages. A host page may hold several device blocks
(``blocks_per_chunk``), as in vLLM's CPU offload, where the first chunk of a batch may start
``skip`` sub-blocks in. Adjacent descriptors that continue each other on both sides are merged,
so a run of consecutive blocks becomes one copy.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvsnap.layout import CacheLayout, PageRef


class Direction(str, enum.Enum):
    """Which way a transfer goes: from the engine cache to host pages, or back."""

    DEVICE_TO_HOST = "device_to_host"
    HOST_TO_DEVICE = "host_to_device"


@dataclass(frozen=True)
class FragmentTemplate:
    """One ref's copy runs unrolled: per fragment its offset in the local and the canonical page."""

    local_offsets: np.ndarray
    canonical_offsets: np.ndarray
    sizes: np.ndarray
    bytes_per_block: int

    @classmethod
    def from_ref(cls, ref: PageRef) -> FragmentTemplate:
        local, canonical, sizes = ref.mapping.fragments()
        return cls(local, canonical, sizes, int(sizes.sum()))

    @property
    def num_fragments(self) -> int:
        return len(self.sizes)


@dataclass(frozen=True)
class HostPages:
    """Canonical pages of one tensor in host memory.

    Chunk ``c`` starts at ``data_ptr + c * chunk_stride_bytes`` and holds ``blocks_per_chunk``
    consecutive canonical pages of ``page_size_bytes`` each.
    """

    data_ptr: int
    num_chunks: int
    chunk_stride_bytes: int
    page_size_bytes: int
    blocks_per_chunk: int = 1

    @classmethod
    def contiguous(cls, data_ptr: int, num_pages: int, page_size_bytes: int) -> HostPages:
        """``num_pages`` canonical pages back to back at ``data_ptr``."""
        return cls(data_ptr, num_pages, page_size_bytes, page_size_bytes)


@dataclass(frozen=True)
class PageCopy:
    """Blocks of one canonical tensor between the device cache and host pages.

    Device block ``device_block_ids[i]`` pairs with the ``i``-th host page in the enumeration
    of ``host_chunk_ids`` (each chunk expanded into its ``blocks_per_chunk`` pages, the first
    ``skip`` pages dropped). ``snapshot_block_ids`` number the canonical blocks the same way on
    every TP rank, which is what writer election keys on; by default the host page numbers.
    """

    name: str
    device_block_ids: np.ndarray
    host: HostPages
    host_chunk_ids: np.ndarray
    skip: int = 0
    snapshot_block_ids: np.ndarray | None = None

    @property
    def num_blocks(self) -> int:
        return len(self.device_block_ids)


@dataclass(frozen=True)
class Descriptors:
    """Copy descriptors: ``sizes[i]`` bytes from address ``src[i]`` to address ``dst[i]``."""

    src: np.ndarray
    dst: np.ndarray
    sizes: np.ndarray

    @property
    def num_bytes(self) -> int:
        return int(self.sizes.sum())

    def __len__(self) -> int:
        return len(self.sizes)

    @classmethod
    def empty(cls) -> Descriptors:
        empty = np.empty(0, dtype=np.int64)
        return cls(empty, empty, empty)


@dataclass(frozen=True)
class ResolvedCopy:
    """A validated :class:`PageCopy`: the pages this rank moves, as device block ids and host
    page addresses (at device to host, blocks another rank is elected to write are dropped)."""

    copy: PageCopy
    ref: PageRef
    device_block_ids: np.ndarray
    host_addresses: np.ndarray

    @property
    def num_bytes(self) -> int:
        """Bytes this rank moves: its local bytes of every page."""
        return len(self.device_block_ids) * self.ref.mapping.local_bytes


class CopyPlanner:
    """Builds descriptors for one :class:`CacheLayout`; templates are computed once, here."""

    def __init__(self, layout: CacheLayout) -> None:
        self.layout = layout
        self._templates = {ref.name: FragmentTemplate.from_ref(ref) for ref in layout.refs}

    def template(self, name: str) -> FragmentTemplate:
        return self._templates[name]

    def resolve(self, copy: PageCopy, direction: Direction) -> ResolvedCopy:
        """Check ``copy`` against the layout and elect this rank's pages.

        Raises ``KeyError`` for an unknown tensor and ``ValueError`` for block ids out of range,
        host pages of the wrong size or too few host pages.
        """
        return self.resolve_job([copy], direction)[0]

    def resolve_job(self, copies: Sequence[PageCopy], direction: Direction) -> list[ResolvedCopy]:
        """:meth:`resolve` for every copy of a job.

        The copies of one job usually share their arrays (the same blocks of every layer, the
        same host chunk ids), so each array is converted and range-checked once per job.
        """
        checked: dict[tuple[int, int], np.ndarray] = {}

        def in_range(values: np.ndarray, limit: int, what: str) -> np.ndarray:
            key = (id(values), limit)
            array = checked.get(key)
            if array is None:
                array = np.asarray(values, dtype=np.int64)
                if array.ndim != 1:
                    raise ValueError(f"{what} must be one-dimensional")
                if len(array) and (array.min() < 0 or array.max() >= limit):
                    raise ValueError(
                        f"{what} must lie in [0, {limit}), got {array.min()}..{array.max()}"
                    )
                checked[key] = array
            return array

        resolved = []
        for copy in copies:
            ref = self.layout.ref(copy.name)
            tensor = self.layout.tensors[ref.tensor_index]
            if copy.host.page_size_bytes != ref.mapping.canonical_page_size_bytes:
                raise ValueError(
                    f"{copy.name}: host pages are {copy.host.page_size_bytes} bytes, "
                    f"the canonical page is {ref.mapping.canonical_page_size_bytes}"
                )
            device_blocks = in_range(
                copy.device_block_ids, tensor.num_blocks, f"{copy.name}: device block ids"
            )
            chunks = in_range(copy.host_chunk_ids, copy.host.num_chunks, "host chunk ids")
            host_pages, page_numbers = host_page_addresses(
                copy.host, chunks, copy.skip, len(device_blocks), checked=True
            )
            if direction is Direction.DEVICE_TO_HOST and ref.mapping.num_writers > 1:
                snapshot_blocks = (
                    page_numbers
                    if copy.snapshot_block_ids is None
                    else np.asarray(copy.snapshot_block_ids)
                )
                writes = ref.mapping.is_writer(snapshot_blocks)
                device_blocks, host_pages = device_blocks[writes], host_pages[writes]
            resolved.append(ResolvedCopy(copy, ref, device_blocks, host_pages))
        return resolved

    def descriptors(
        self,
        copies: Sequence[PageCopy | ResolvedCopy],
        direction: Direction,
        *,
        merge: bool = True,
    ) -> Descriptors:
        """All descriptors of a job, in order: copy by copy, block by block, fragment by fragment.

        At device-to-host, blocks this rank is not the elected writer of are left out. With
        ``merge`` (the default), descriptors of one copy continuing each other on both sides
        become one; descriptors of different copies are never merged.
        """
        parts = [self._copy_descriptors(copy, direction) for copy in copies]
        # Merge within each copy only: two copies' memory can be adjacent without being one
        # allocation, and the driver refuses a copy that spans two allocations.
        parts = [merge_adjacent(part) if merge else part for part in parts if len(part)]
        if not parts:
            return Descriptors.empty()
        src = np.concatenate([part.src for part in parts])
        dst = np.concatenate([part.dst for part in parts])
        sizes = np.concatenate([part.sizes for part in parts])
        return Descriptors(src, dst, sizes)

    def _copy_descriptors(self, copy: PageCopy | ResolvedCopy, direction: Direction) -> Descriptors:
        resolved = copy if isinstance(copy, ResolvedCopy) else self.resolve(copy, direction)
        template = self._templates[resolved.ref.name]
        tensor = self.layout.tensors[resolved.ref.tensor_index]
        if template.num_fragments == 0 or len(resolved.device_block_ids) == 0:
            return Descriptors.empty()
        device_bases = tensor.data_ptr + resolved.device_block_ids * tensor.block_stride_bytes
        local = (device_bases[:, None] + template.local_offsets[None, :]).ravel()
        canonical = (resolved.host_addresses[:, None] + template.canonical_offsets[None, :]).ravel()
        count = len(device_bases)
        sizes = np.broadcast_to(template.sizes, (count, template.num_fragments)).ravel()
        if direction is Direction.DEVICE_TO_HOST:
            return Descriptors(local, canonical, sizes)
        return Descriptors(canonical, local, sizes)


def host_page_addresses(
    host: HostPages, chunk_ids: np.ndarray, skip: int, count: int, *, checked: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """Addresses and global numbers of ``count`` host pages, ``skip`` pages into ``chunk_ids``.

    Page ``j`` of chunk ``c`` has global number ``c * blocks_per_chunk + j``. ``checked`` says
    the caller already verified that ``chunk_ids`` is an int64 array within ``host``.
    """
    chunks = chunk_ids if checked else np.asarray(chunk_ids, dtype=np.int64)
    per_chunk = host.blocks_per_chunk
    if not 0 <= skip < per_chunk:
        raise ValueError(f"skip must lie in [0, {per_chunk}), got {skip}")
    if not checked and len(chunks) and (chunks.min() < 0 or chunks.max() >= host.num_chunks):
        raise ValueError(
            f"host chunk ids must lie in [0, {host.num_chunks}), got {chunks.min()}..{chunks.max()}"
        )
    if per_chunk == 1:
        pages = chunks
        addresses = host.data_ptr + chunks * host.chunk_stride_bytes
    else:
        sub_pages = np.arange(per_chunk, dtype=np.int64)
        pages = (chunks[:, None] * per_chunk + sub_pages[None, :]).ravel()
        addresses = (
            host.data_ptr
            + chunks[:, None] * host.chunk_stride_bytes
            + sub_pages[None, :] * host.page_size_bytes
        ).ravel()
    available = len(pages) - skip
    if available < count:
        raise ValueError(
            f"{count} device blocks need {count} host pages, the chunks give {available}"
        )
    return addresses[skip : skip + count], pages[skip : skip + count]


def merge_adjacent(descriptors: Descriptors) -> Descriptors:
    """Merge each descriptor into its predecessor when it continues it on both sides.

    The result copies exactly the same bytes to the same places in the same order of
    first touch; it only has fewer, larger descriptors.
    """
    src, dst, sizes = descriptors.src, descriptors.dst, descriptors.sizes
    if len(sizes) < 2:
        return descriptors
    continues = (src[1:] == src[:-1] + sizes[:-1]) & (dst[1:] == dst[:-1] + sizes[:-1])
    if not continues.any():
        return descriptors
    starts = np.flatnonzero(np.concatenate(([True], ~continues)))
    return Descriptors(src[starts], dst[starts], np.add.reduceat(sizes, starts))
