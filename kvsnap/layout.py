"""What an engine's paged KV cache bytes mean, and how each local page maps onto the canonical page.

Every engine stores a block of KV differently: K and V split or packed into one row, tokens
outermost (NHD) or heads outermost (HND), one tensor per layer or one for all layers, a
tensor-parallel rank holding only some heads. kvsnap never interprets those bytes in the hot
path; instead this module describes each cache once, as:

* :class:`KVGeometry`: the model-level shape of one block (layers, KV heads, head dim, tokens
  per block, dtype, or an MLA latent). It defines the **canonical page**: per layer and part
  (``key``/``value``, or ``latent`` for MLA) one block of all KV heads and all tokens, token-major:
  ``(block_size, num_kv_heads, head_dim)`` (``(block_size, latent_dim)`` for MLA), contiguous.
  Snapshots store canonical pages, so any layout can restore into any other.
* :class:`CacheTensor`: a registered engine tensor seen as ``num_blocks`` blocks of bytes, block
  ``b`` starting ``b * block_stride_bytes`` after ``data_ptr``.
* :class:`PageRef`: one (layer, part) inside one cache tensor, with the
  :class:`CanonicalPageMapping` (copy runs) from local page bytes to canonical page bytes.

The constructors at the bottom build a :class:`CacheLayout` from the real tensors engines use;
all of them go through :func:`strided_page_runs`, which derives the copy runs from a tensor
view's strides, so a new layout is a few lines and never a new copy loop.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kvsnap.errors import LayoutError

KEY, VALUE, LATENT = "key", "value", "latent"
KV_PARTS = (KEY, VALUE)
MLA_PARTS = (LATENT,)

#: dtype names as stored in snapshots, mapped to torch dtypes.
DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float64": torch.float64,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
    "uint8": torch.uint8,
}
#: The same dtypes under safetensors' names.
SAFETENSORS_DTYPES: dict[str, str] = {
    "bfloat16": "BF16",
    "float16": "F16",
    "float32": "F32",
    "float64": "F64",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "int8": "I8",
    "uint8": "U8",
}


def dtype_name(dtype: torch.dtype) -> str:
    """The snapshot name of a torch dtype (``torch.bfloat16`` -> ``"bfloat16"``)."""
    for name, candidate in DTYPES.items():
        if candidate == dtype:
            return name
    raise LayoutError(f"unsupported KV dtype {dtype}; supported: {', '.join(DTYPES)}")


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for a snapshot dtype name."""
    try:
        return DTYPES[name]
    except KeyError:
        raise LayoutError(f"unknown KV dtype {name!r}; supported: {', '.join(DTYPES)}") from None


@dataclass(frozen=True)
class KVGeometry:
    """The model-level shape of one KV block, which fixes the canonical page.

    Standard attention sets ``num_kv_heads`` and ``head_dim``; MLA sets ``latent_dim`` instead
    (and leaves the other two at 0). ``attention_types`` names each layer's attention
    (``"full"``, ``"sliding"`` or ``"mla"``); empty means ``"full"`` (or ``"mla"``) everywhere.
    """

    num_layers: int
    block_size: int
    dtype: str
    num_kv_heads: int = 0
    head_dim: int = 0
    latent_dim: int = 0
    attention_types: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        torch_dtype(self.dtype)
        if self.num_layers <= 0 or self.block_size <= 0:
            raise LayoutError(f"num_layers and block_size must be positive: {self}")
        if self.latent_dim:
            if self.num_kv_heads or self.head_dim:
                raise LayoutError("an MLA geometry has latent_dim and no num_kv_heads/head_dim")
        elif self.num_kv_heads <= 0 or self.head_dim <= 0:
            raise LayoutError(f"num_kv_heads and head_dim must be positive: {self}")
        if self.attention_types and len(self.attention_types) != self.num_layers:
            raise LayoutError(
                f"attention_types names {len(self.attention_types)} layers, "
                f"the geometry has {self.num_layers}"
            )
        if not self.attention_types:
            default = "mla" if self.is_mla else "full"
            object.__setattr__(self, "attention_types", (default,) * self.num_layers)

    @property
    def is_mla(self) -> bool:
        return self.latent_dim > 0

    @property
    def parts(self) -> tuple[str, ...]:
        return MLA_PARTS if self.is_mla else KV_PARTS

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=torch_dtype(self.dtype)).element_size()

    @property
    def canonical_page_shape(self) -> tuple[int, ...]:
        """Shape of one canonical page of one (layer, part), in elements."""
        if self.is_mla:
            return (self.block_size, self.latent_dim)
        return (self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def canonical_page_size_bytes(self) -> int:
        return math.prod(self.canonical_page_shape) * self.element_size

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block over all layers and parts."""
        return self.canonical_page_size_bytes * self.num_layers * len(self.parts)

    def tensor_names(self) -> list[str]:
        """Canonical tensor names in snapshot order: ``layers.{i}.{part}``."""
        return [
            canonical_name(layer, part) for layer in range(self.num_layers) for part in self.parts
        ]

    def describe(self) -> str:
        if self.is_mla:
            heads = f"latent {self.latent_dim}"
        else:
            heads = f"{self.num_kv_heads} KV heads x head dim {self.head_dim}"
        return f"{self.num_layers} layers, {heads}, {self.block_size} tokens/block, {self.dtype}"


def canonical_name(layer: int, part: str) -> str:
    """The snapshot tensor name of one layer part: ``layers.3.key``."""
    return f"layers.{layer}.{part}"


@dataclass(frozen=True)
class CopyRun:
    """``num_fragments`` equal fragments from a local page onto the canonical page.

    Fragment ``i`` covers ``[local_offset + i*local_stride, +fragment_size)`` of the local page
    (offsets from the block's start in its :class:`CacheTensor`) and lands at
    ``[canonical_offset + i*canonical_stride, +fragment_size)`` of the canonical page.
    """

    local_offset: int
    local_stride: int
    canonical_offset: int
    canonical_stride: int
    fragment_size: int
    num_fragments: int

    @property
    def num_bytes(self) -> int:
        return self.fragment_size * self.num_fragments


@dataclass(frozen=True)
class CanonicalPageMapping:
    """How one rank's local page bytes tile (part of) the canonical page.

    When several ranks hold identical bytes (GQA with more TP ranks than KV heads, or an MLA
    latent replicated on every rank), only one of them writes each block at capture:
    block ``b`` is written by the rank whose ``writer_index == b % num_writers``.
    """

    canonical_page_size_bytes: int
    runs: tuple[CopyRun, ...]
    num_writers: int = 1
    writer_index: int = 0

    @functools.cached_property
    def local_bytes(self) -> int:
        """Bytes of the canonical page this rank holds (computed once: the planner's hot path)."""
        return sum(run.num_bytes for run in self.runs)

    def is_writer(self, canonical_block_ids: np.ndarray) -> np.ndarray:
        """Boolean mask: which of these snapshot blocks this rank writes at capture."""
        return np.asarray(canonical_block_ids) % self.num_writers == self.writer_index

    def fragments(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Unrolled ``(local_offsets, canonical_offsets, sizes)``, one entry per fragment."""
        local, canonical, sizes = [], [], []
        for run in self.runs:
            steps = np.arange(run.num_fragments, dtype=np.int64)
            local.append(run.local_offset + steps * run.local_stride)
            canonical.append(run.canonical_offset + steps * run.canonical_stride)
            sizes.append(np.full(run.num_fragments, run.fragment_size, dtype=np.int64))
        if not sizes:
            empty = np.empty(0, dtype=np.int64)
            return empty, empty, empty
        return np.concatenate(local), np.concatenate(canonical), np.concatenate(sizes)


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

    @property
    def num_blocks(self) -> int:
        """Blocks addressable in every registered tensor."""
        return min(tensor.num_blocks for tensor in self.tensors)

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


def _coverage(mapping: CanonicalPageMapping) -> np.ndarray:
    """How many times each canonical byte is written by ``mapping`` (int16 per byte)."""
    counts = np.zeros(mapping.canonical_page_size_bytes + 1, dtype=np.int32)
    _, canonical, sizes = mapping.fragments()
    np.add.at(counts, canonical, 1)
    np.add.at(counts, canonical + sizes, -1)
    return np.cumsum(counts[:-1])


def _check_no_canonical_overlap(name: str, mapping: CanonicalPageMapping) -> None:
    if mapping.canonical_page_size_bytes and _coverage(mapping).max(initial=0) > 1:
        raise LayoutError(f"{name}: copy runs write some canonical bytes twice")


def check_tiling(layouts: Sequence[CacheLayout]) -> None:
    """Check that the elected writers of all ranks tile every canonical page exactly once.

    ``layouts`` holds one layout per TP rank (same geometry). For each canonical tensor and
    each block residue modulo the writers' count, the writing ranks' runs must cover every
    canonical byte exactly once; otherwise a capture would leave holes or race. Raises
    :class:`LayoutError` naming the tensor and the uncovered or doubly covered bytes.
    """
    if not layouts:
        raise LayoutError("check_tiling needs at least one layout")
    geometry = layouts[0].geometry
    ranks = sorted(layout.tp_rank for layout in layouts)
    if ranks != list(range(layouts[0].tp_size)):
        raise LayoutError(f"check_tiling needs every TP rank once, got ranks {ranks}")
    for name in geometry.tensor_names():
        mappings = [layout.ref(name).mapping for layout in layouts]
        period = math.lcm(*(mapping.num_writers for mapping in mappings))
        for block_residue in range(period):
            total = np.zeros(geometry.canonical_page_size_bytes, dtype=np.int32)
            for mapping in mappings:
                if block_residue % mapping.num_writers == mapping.writer_index:
                    total += _coverage(mapping)
            if (total != 1).any():
                wrong = np.flatnonzero(total != 1)
                raise LayoutError(
                    f"{name}: elected writers cover canonical bytes {wrong[0]}..{wrong[-1]} "
                    f"{int(total[wrong[0]])} times for blocks = {block_residue} mod {period} "
                    "(each byte must be written exactly once)"
                )


# --------------------------------------------------------------------------------------------
# Deriving copy runs from strides


def strided_page_runs(
    *,
    element_size: int,
    offset_bytes: int,
    token_stride: int,
    head_stride: int,
    dim_stride: int,
    block_size: int,
    num_local_heads: int,
    head_dim: int,
    num_total_heads: int,
    first_head: int,
) -> tuple[CopyRun, ...]:
    """Copy runs from a strided local page onto the canonical token-major page.

    The local page holds ``num_local_heads`` heads starting at global head ``first_head``; its
    element ``(token, head, dim)`` sits ``offset_bytes + token*token_stride + head*head_stride``
    bytes from the block start (strides in elements, except ``offset_bytes``). The canonical
    page holds all ``num_total_heads`` heads contiguously, token-major. Fragments adjacent on
    both sides are merged, and equally spaced fragments are folded into one run, so an NHD
    TP=1 page becomes a single run and an HND page one run per head.
    """
    if dim_stride != 1:
        raise LayoutError("the head dimension must be contiguous (stride 1) in the engine cache")
    fragment = head_dim * element_size
    tokens = np.arange(block_size, dtype=np.int64)[:, None]
    heads = np.arange(num_local_heads, dtype=np.int64)[None, :]
    local = offset_bytes + (tokens * token_stride + heads * head_stride) * element_size
    canonical = (tokens * num_total_heads + first_head + heads) * fragment
    return fold_fragments(local.ravel(), canonical.ravel(), fragment)


def fold_fragments(
    local: np.ndarray, canonical: np.ndarray, fragment_size: int
) -> tuple[CopyRun, ...]:
    """Compress equal-size fragments into as few :class:`CopyRun` as possible.

    Fragments contiguous on both sides are first merged into larger ones (when they all group
    evenly), then arithmetic progressions become runs; both the canonical and the local order
    are tried and the shorter result is kept. The bytes described never change.
    """
    by_canonical = _fold_in_order(
        local, canonical, fragment_size, np.argsort(canonical, kind="stable")
    )
    by_local = _fold_in_order(local, canonical, fragment_size, np.argsort(local, kind="stable"))
    return by_canonical if len(by_canonical) <= len(by_local) else by_local


def _fold_in_order(
    local: np.ndarray, canonical: np.ndarray, size: int, order: np.ndarray
) -> tuple[CopyRun, ...]:
    local, canonical = local[order], canonical[order]
    if len(local) > 1:
        adjacent = (np.diff(local) == size) & (np.diff(canonical) == size)
        group = _uniform_group_length(adjacent)
        local, canonical, size = local[::group], canonical[::group], size * group
    runs: list[CopyRun] = []
    start, count = 0, len(local)
    while start < count:
        end = start + 1
        local_step = canonical_step = size
        if end < count:
            local_step = int(local[end] - local[start])
            canonical_step = int(canonical[end] - canonical[start])
            end += 1
            while (
                end < count
                and local[end] - local[end - 1] == local_step
                and canonical[end] - canonical[end - 1] == canonical_step
            ):
                end += 1
        runs.append(
            CopyRun(
                int(local[start]),
                local_step,
                int(canonical[start]),
                canonical_step,
                size,
                end - start,
            )
        )
        start = end
    return tuple(runs)


def _uniform_group_length(adjacent: np.ndarray) -> int:
    """Largest g such that fragments form consecutive groups of g that are internally contiguous."""
    count = len(adjacent) + 1
    breaks = np.flatnonzero(~adjacent) + 1  # indices where a new group starts
    starts = np.concatenate(([0], breaks))
    lengths = np.diff(np.concatenate((starts, [count])))
    group = int(np.gcd.reduce(lengths))
    return max(group, 1)


# --------------------------------------------------------------------------------------------
# Tensor-parallel head assignment


@dataclass(frozen=True)
class HeadShard:
    """Which global KV heads one TP rank holds, and whether it is an elected writer."""

    first_head: int
    num_local_heads: int
    num_writers: int
    writer_index: int


def head_shard(num_kv_heads: int, tp_rank: int, tp_size: int) -> HeadShard:
    """The KV heads a TP rank holds, the way vLLM and Megatron shard them.

    With ``tp_size <= num_kv_heads`` each rank holds a contiguous slice; with more ranks than
    heads, ``tp_size / num_kv_heads`` consecutive ranks replicate one head and take turns writing.
    """
    if tp_size <= num_kv_heads:
        if num_kv_heads % tp_size:
            raise LayoutError(f"{num_kv_heads} KV heads do not split evenly over TP {tp_size}")
        per_rank = num_kv_heads // tp_size
        return HeadShard(tp_rank * per_rank, per_rank, 1, 0)
    if tp_size % num_kv_heads:
        raise LayoutError(f"TP {tp_size} is not a multiple of {num_kv_heads} KV heads")
    replication = tp_size // num_kv_heads
    return HeadShard(tp_rank // replication, 1, replication, tp_rank % replication)


# --------------------------------------------------------------------------------------------
# Constructors from real tensors


def _byte_offset(view: torch.Tensor, base: torch.Tensor) -> int:
    return view.data_ptr() - base.data_ptr()


class _LayoutBuilder:
    """Accumulates tensors and refs for one layout; keeps the constructors short."""

    def __init__(self, geometry: KVGeometry, tp_rank: int, tp_size: int) -> None:
        self.geometry = geometry
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.tensors: list[CacheTensor] = []
        self.refs: list[PageRef] = []

    def add_tensor(self, tensor: torch.Tensor, block_stride_elements: int, num_blocks: int) -> int:
        self.tensors.append(
            CacheTensor(
                tensor=tensor,
                num_blocks=num_blocks,
                block_stride_bytes=block_stride_elements * tensor.element_size(),
                data_ptr=tensor.data_ptr(),
            )
        )
        return len(self.tensors) - 1

    def add_heads_part(
        self,
        tensor_index: int,
        layer: int,
        part: str,
        page_view: torch.Tensor,
        shard: HeadShard,
    ) -> None:
        """``page_view``: block 0's (tokens, local_heads, head_dim) view inside the tensor."""
        base = self.tensors[tensor_index].tensor
        tokens, local_heads, head_dim = page_view.shape
        runs = strided_page_runs(
            element_size=page_view.element_size(),
            offset_bytes=_byte_offset(page_view, base),
            token_stride=page_view.stride(0),
            head_stride=page_view.stride(1),
            dim_stride=page_view.stride(2),
            block_size=tokens,
            num_local_heads=local_heads,
            head_dim=head_dim,
            num_total_heads=self.geometry.num_kv_heads,
            first_head=shard.first_head,
        )
        self._add(tensor_index, layer, part, runs, shard)

    def add_latent_part(
        self, tensor_index: int, layer: int, page_view: torch.Tensor, shard: HeadShard
    ) -> None:
        """``page_view``: block 0's (tokens, latent_dim) view inside the tensor."""
        base = self.tensors[tensor_index].tensor
        runs = strided_page_runs(
            element_size=page_view.element_size(),
            offset_bytes=_byte_offset(page_view, base),
            token_stride=page_view.stride(0),
            head_stride=0,
            dim_stride=page_view.stride(1),
            block_size=page_view.shape[0],
            num_local_heads=1,
            head_dim=page_view.shape[1],
            num_total_heads=1,
            first_head=0,
        )
        self._add(tensor_index, layer, LATENT, runs, shard)

    def _add(
        self, tensor_index: int, layer: int, part: str, runs: tuple[CopyRun, ...], shard: HeadShard
    ) -> None:
        mapping = CanonicalPageMapping(
            canonical_page_size_bytes=self.geometry.canonical_page_size_bytes,
            runs=runs,
            num_writers=shard.num_writers,
            writer_index=shard.writer_index,
        )
        self.refs.append(PageRef(tensor_index, layer, part, mapping))

    def build(self, encoding: str) -> CacheLayout:
        return CacheLayout(
            geometry=self.geometry,
            tensors=self.tensors,
            refs=self.refs,
            encoding=encoding,
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
        )


def _geometry(
    num_layers: int,
    block_size: int,
    dtype: torch.dtype,
    num_kv_heads: int,
    head_dim: int,
    attention_types: Sequence[str] | None,
) -> KVGeometry:
    return KVGeometry(
        num_layers=num_layers,
        block_size=block_size,
        dtype=dtype_name(dtype),
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        attention_types=tuple(attention_types or ()),
    )


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise LayoutError(message)


def _tp_shard(num_kv_heads: int, local_heads: int, tp_rank: int, tp_size: int) -> HeadShard:
    shard = head_shard(num_kv_heads, tp_rank, tp_size)
    _require(
        shard.num_local_heads == local_heads,
        f"the cache holds {local_heads} KV heads per rank, but {num_kv_heads} heads over TP "
        f"{tp_size} give {shard.num_local_heads}",
    )
    return shard


def _uniform_layers(
    kv_caches: Sequence[torch.Tensor], shape_text: str, ndim: int, *, pair_dim: int | None = None
) -> torch.Tensor:
    """Layer 0's tensor, after checking every layer has its shape and dtype.

    ``pair_dim`` names a dimension that must have size 2 (K and V); ``shape_text`` is the
    expected shape as the error shows it.
    """
    _require(len(kv_caches) > 0, "no KV cache tensors given")
    first = kv_caches[0]
    _require(
        first.dim() == ndim and (pair_dim is None or first.shape[pair_dim] == 2),
        f"expected {shape_text}, got {tuple(first.shape)}",
    )
    for layer, cache in enumerate(kv_caches):
        _require(
            cache.shape == first.shape and cache.dtype == first.dtype,
            f"layer {layer} differs from layer 0: {tuple(cache.shape)} {cache.dtype}",
        )
    return first


def _sharded_builder(
    first: torch.Tensor,
    *,
    num_layers: int,
    block_size: int,
    local_heads: int,
    head_dim: int,
    num_kv_heads: int | None,
    tp_rank: int,
    tp_size: int,
    attention_types: Sequence[str] | None,
) -> tuple[_LayoutBuilder, HeadShard]:
    """A builder for a head-sharded cache and the rank's shard (``num_kv_heads``: the total)."""
    total_heads = num_kv_heads or local_heads * tp_size
    geometry = _geometry(
        num_layers, block_size, first.dtype, total_heads, head_dim, attention_types
    )
    shard = _tp_shard(total_heads, local_heads, tp_rank, tp_size)
    return _LayoutBuilder(geometry, tp_rank, tp_size), shard


def vllm_split_layout(
    kv_caches: Sequence[torch.Tensor],
    *,
    num_kv_heads: int | None = None,
    tp_rank: int = 0,
    tp_size: int = 1,
    attention_types: Sequence[str] | None = None,
) -> CacheLayout:
    """vLLM's split cache: per layer ``(num_blocks, 2, block_size, heads, head_dim)``.

    The shape is the logical one; the physical order may be NHD or HND (vLLM allocates HND
    physically and permutes), and the runs follow the real strides either way.
    ``num_kv_heads`` is the model's total (default: the local count times ``tp_size``).
    """
    first = _uniform_layers(
        kv_caches, "(num_blocks, 2, block_size, heads, head_dim)", 5, pair_dim=1
    )
    num_blocks, _, block_size, local_heads, head_dim = first.shape
    builder, shard = _sharded_builder(
        first,
        num_layers=len(kv_caches),
        block_size=block_size,
        local_heads=local_heads,
        head_dim=head_dim,
        num_kv_heads=num_kv_heads,
        tp_rank=tp_rank,
        tp_size=tp_size,
        attention_types=attention_types,
    )
    for layer, cache in enumerate(kv_caches):
        index = builder.add_tensor(cache, cache.stride(0), num_blocks)
        builder.add_heads_part(index, layer, KEY, cache[0, 0], shard)
        builder.add_heads_part(index, layer, VALUE, cache[0, 1], shard)
    physical = "hnd" if first.stride(3) > first.stride(2) else "nhd"
    return builder.build(f"vllm-split-{physical}")


def vllm_legacy_layout(
    kv_caches: Sequence[torch.Tensor],
    *,
    num_kv_heads: int | None = None,
    tp_rank: int = 0,
    tp_size: int = 1,
    attention_types: Sequence[str] | None = None,
) -> CacheLayout:
    """The older vLLM layout: per layer ``(2, num_blocks, block_size, heads, head_dim)``.

    K and V are two block-major halves of one tensor; each half is registered as its own tensor.
    """
    first = _uniform_layers(
        kv_caches, "(2, num_blocks, block_size, heads, head_dim)", 5, pair_dim=0
    )
    _, num_blocks, block_size, local_heads, head_dim = first.shape
    builder, shard = _sharded_builder(
        first,
        num_layers=len(kv_caches),
        block_size=block_size,
        local_heads=local_heads,
        head_dim=head_dim,
        num_kv_heads=num_kv_heads,
        tp_rank=tp_rank,
        tp_size=tp_size,
        attention_types=attention_types,
    )
    for layer, cache in enumerate(kv_caches):
        for part_index, part in enumerate(KV_PARTS):
            half = cache[part_index]
            index = builder.add_tensor(half, half.stride(0), num_blocks)
            builder.add_heads_part(index, layer, part, half[0], shard)
    return builder.build("vllm-legacy")


def packed_layout(
    kv_caches: Sequence[torch.Tensor],
    *,
    num_kv_heads: int | None = None,
    tp_rank: int = 0,
    tp_size: int = 1,
    attention_types: Sequence[str] | None = None,
) -> CacheLayout:
    """The packed layout: per layer ``(num_blocks, heads, block_size, 2 * head_dim)``, K then V."""
    first = _uniform_layers(kv_caches, "(num_blocks, heads, block_size, 2*head_dim)", 4)
    _require(first.shape[3] % 2 == 0, f"the last dimension {first.shape[3]} is not 2*head_dim")
    num_blocks, local_heads, block_size, packed_dim = first.shape
    head_dim = packed_dim // 2
    builder, shard = _sharded_builder(
        first,
        num_layers=len(kv_caches),
        block_size=block_size,
        local_heads=local_heads,
        head_dim=head_dim,
        num_kv_heads=num_kv_heads,
        tp_rank=tp_rank,
        tp_size=tp_size,
        attention_types=attention_types,
    )
    for layer, cache in enumerate(kv_caches):
        index = builder.add_tensor(cache, cache.stride(0), num_blocks)
        page = cache[0].transpose(0, 1)  # (block_size, heads, 2*head_dim)
        builder.add_heads_part(index, layer, KEY, page[..., :head_dim], shard)
        builder.add_heads_part(index, layer, VALUE, page[..., head_dim:], shard)
    return builder.build("packed")


def mla_layout(
    kv_caches: Sequence[torch.Tensor],
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    attention_types: Sequence[str] | None = None,
) -> CacheLayout:
    """MLA: per layer ``(num_blocks, block_size, latent_dim)``, replicated on every TP rank."""
    first = _uniform_layers(kv_caches, "(num_blocks, block_size, latent_dim)", 3)
    num_blocks, block_size, latent_dim = first.shape
    geometry = KVGeometry(
        num_layers=len(kv_caches),
        block_size=block_size,
        dtype=dtype_name(first.dtype),
        latent_dim=latent_dim,
        attention_types=tuple(attention_types or ()),
    )
    shard = HeadShard(0, 1, tp_size, tp_rank)
    builder = _LayoutBuilder(geometry, tp_rank, tp_size)
    for layer, cache in enumerate(kv_caches):
        index = builder.add_tensor(cache, cache.stride(0), num_blocks)
        builder.add_latent_part(index, layer, cache[0], shard)
    return builder.build("mla")


def cross_layer_layout(
    cache: torch.Tensor,
    *,
    num_kv_heads: int | None = None,
    tp_rank: int = 0,
    tp_size: int = 1,
    attention_types: Sequence[str] | None = None,
) -> CacheLayout:
    """One tensor for all layers: ``(num_blocks, num_layers, 2, block_size, heads, head_dim)``."""
    _require(
        cache.dim() == 6 and cache.shape[2] == 2,
        "expected (num_blocks, num_layers, 2, block_size, heads, head_dim), "
        f"got {tuple(cache.shape)}",
    )
    num_blocks, num_layers, _, block_size, local_heads, head_dim = cache.shape
    total_heads = num_kv_heads or local_heads * tp_size
    geometry = _geometry(
        num_layers, block_size, cache.dtype, total_heads, head_dim, attention_types
    )
    shard = _tp_shard(total_heads, local_heads, tp_rank, tp_size)
    builder = _LayoutBuilder(geometry, tp_rank, tp_size)
    index = builder.add_tensor(cache, cache.stride(0), num_blocks)
    for layer in range(num_layers):
        builder.add_heads_part(index, layer, KEY, cache[0, layer, 0], shard)
        builder.add_heads_part(index, layer, VALUE, cache[0, layer, 1], shard)
    return builder.build("cross-layer")


def flat_paged_layout(
    key_caches: Sequence[torch.Tensor],
    value_caches: Sequence[torch.Tensor],
    *,
    block_size: int,
    attention_types: Sequence[str] | None = None,
) -> CacheLayout:
    """A flat paged cache: per layer K and V tensors ``(num_blocks * block_size, heads, head_dim)``.

    This is transformers' continuous-batching ``PagedAttentionCache`` storage, where block ``b``
    is rows ``b*block_size .. (b+1)*block_size``.
    """
    _require(
        len(key_caches) == len(value_caches) > 0, "need one key and one value tensor per layer"
    )
    first = key_caches[0]
    _require(
        first.dim() == 3,
        f"expected (num_blocks * block_size, heads, head_dim), got {tuple(first.shape)}",
    )
    rows, heads, head_dim = first.shape
    _require(
        rows % block_size == 0, f"{rows} rows are not a whole number of {block_size}-token blocks"
    )
    geometry = _geometry(len(key_caches), block_size, first.dtype, heads, head_dim, attention_types)
    shard = HeadShard(0, heads, 1, 0)
    builder = _LayoutBuilder(geometry, 0, 1)
    for layer, (keys, values) in enumerate(zip(key_caches, value_caches, strict=True)):
        for part, tensor in ((KEY, keys), (VALUE, values)):
            _require(
                tensor.shape == first.shape and tensor.dtype == first.dtype,
                f"layer {layer} {part} differs: {tuple(tensor.shape)}",
            )
            index = builder.add_tensor(tensor, tensor.stride(0) * block_size, rows // block_size)
            builder.add_heads_part(index, layer, part, tensor[:block_size], shard)
    return builder.build("flat-paged")


def contiguous_layout(
    key_states: Sequence[torch.Tensor],
    value_states: Sequence[torch.Tensor],
    *,
    block_size: int,
    batch_index: int = 0,
    attention_types: Sequence[str] | None = None,
) -> CacheLayout:
    """Contiguous per-layer ``(batch, heads, seq, head_dim)`` tensors (``DynamicCache``) as blocks.

    Block ``b`` of the chosen batch row is tokens ``b*block_size .. (b+1)*block_size``; a
    sequence whose length is not a multiple of ``block_size`` leaves its last block partial,
    which capture handles by padding (see :mod:`kvsnap.engines.transformers`).
    """
    _require(
        len(key_states) == len(value_states) > 0, "need one key and one value tensor per layer"
    )
    first = key_states[0]
    _require(first.dim() == 4, f"expected (batch, heads, seq, head_dim), got {tuple(first.shape)}")
    _, heads, seq_len, head_dim = first.shape
    _require(
        seq_len % block_size == 0,
        f"sequence length {seq_len} is not a whole number of {block_size}-token blocks",
    )
    geometry = _geometry(len(key_states), block_size, first.dtype, heads, head_dim, attention_types)
    shard = HeadShard(0, heads, 1, 0)
    builder = _LayoutBuilder(geometry, 0, 1)
    for layer, (keys, values) in enumerate(zip(key_states, value_states, strict=True)):
        for part, tensor in ((KEY, keys), (VALUE, values)):
            _require(
                tensor.shape == first.shape, f"layer {layer} {part} differs: {tuple(tensor.shape)}"
            )
            row = tensor[batch_index]  # (heads, seq, head_dim)
            index = builder.add_tensor(row, row.stride(1) * block_size, seq_len // block_size)
            builder.add_heads_part(index, layer, part, row[:, :block_size].transpose(0, 1), shard)
    return builder.build("contiguous-hnd")
