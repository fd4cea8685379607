"""The cases ``kvsnap bench`` measures: page sizes, job sizes, synthetic caches, and the timer.

A :class:`TransferCase` is one job: a random, sorted set of ``block_ids`` of an engine cache
(allocated by :func:`kvsnap.layout.allocate.allocate_cache` and filled with random bytes),
copied to or from canonical pages at the start of a page-locked host buffer.
:func:`transfer_cases` yields every case of a matrix; a :class:`Measurement` is one method timed
on one case in one direction.
"""

from __future__ import annotations

import platform
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvsnap.layout.allocate import AllocatedCache, allocate_cache
from kvsnap.transfer import available_backends
from kvsnap.transfer.pinned import PinnedPool
from kvsnap.transfer.plan import Direction, HostPages, PageCopy

KiB, MiB = 1 << 10, 1 << 20
#: Canonical page size -> (tokens per block, KV heads, head dim) in bfloat16.
HEAD_PAGES = {
    2 * KiB: (16, 1, 64),
    16 * KiB: (16, 4, 128),
    128 * KiB: (32, 16, 128),
    2 * MiB: (256, 32, 128),
}
#: The canonical page sizes ``kvsnap bench`` measures.
PAGE_SIZES = tuple(HEAD_PAGES)
#: MLA pages: a 512-wide bfloat16 latent, 1 KiB per token.
MLA_LATENT = 512
#: The layout the calibration is derived from: vLLM's split NHD cache (one fragment per page).
CALIBRATION_LAYOUT = "vllm-nhd"
NUM_LAYERS = 2
#: Backends measured when available, in this order (``auto`` always).
KVSNAP_BACKENDS = ("auto", "cuda-batch", "triton", "torch", "cpu")
#: Largest job in bytes (block counts above it are cut down), for a full and a quick run.
JOB_BYTES_LIMIT = 256 * MiB
QUICK_JOB_BYTES_LIMIT = 16 * MiB
#: The jobs ``kvsnap bench`` measures per page size: a large one (cut to the job limit) and a
#: small one, where host time per job dominates.
LARGE_JOB_BLOCKS = 32768
SMALL_JOB_BLOCKS = 64
#: A method whose warm-up run took longer than this is timed once instead of ``repeats`` times.
SLOW_RUN_SECONDS = 0.5
#: ``cuda-batch`` takes over from the page size at which it reaches this share of the best
#: small-fragment backend: it leaves the SMs to the model, so a near-tie goes to it.
BATCH_COPY_SHARE = 0.97


@dataclass
class Measurement:
    """One method timed on one job in one direction.

    ``page_bytes`` is the canonical page size, ``blocks`` the job's block count, ``num_bytes``
    the job's canonical bytes, ``direction`` a :class:`~kvsnap.transfer.plan.Direction` value and
    ``method`` ``ceiling`` or ``kvsnap-BACKEND`` (benchmarks add their baselines). ``seconds``
    and ``gbps`` are None when the method failed or was skipped; ``note`` then says why.
    """

    layout: str
    page_bytes: int
    blocks: int
    direction: str
    method: str
    num_bytes: int
    seconds: float | None
    gbps: float | None
    ratio_to_ceiling: float | None = None
    host_us_per_block: float | None = None
    backend_used: str | None = None
    note: str | None = None


class Timer:
    """Wall time of enqueue + completion on a device (CUDA synchronizes the stream)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def sync(self) -> None:
        """Wait for everything queued on the device (nothing to wait for on the CPU)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def run(self, action: Callable[[], object]) -> float:
        """Seconds from an idle device to the completion of what ``action`` enqueues."""
        self.sync()
        start = time.perf_counter()
        if self.stream is not None:
            with torch.cuda.stream(self.stream):
                action()
        else:
            action()
        self.sync()
        return time.perf_counter() - start


def resolve_device(device: str | torch.device) -> torch.device:
    """``device`` as a concrete ``cpu`` or ``cuda:N`` device.

    Raises ``ValueError`` for other device types, when CUDA is asked for but unavailable, and for
    a CUDA index this process cannot see.
    """
    try:
        resolved = torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"not a torch device: {device!r} ({exc})") from None
    if resolved.type == "cpu":
        return resolved
    if resolved.type != "cuda":
        raise ValueError(f"device must be cuda or cpu, not {resolved.type!r}")
    if not torch.cuda.is_available():
        raise ValueError(f"no CUDA device: torch {torch.__version__} sees no GPU")
    index = torch.cuda.current_device() if resolved.index is None else resolved.index
    if index >= torch.cuda.device_count():
        raise ValueError(f"no CUDA device {index}: {torch.cuda.device_count()} visible")
    return torch.device("cuda", index)


def device_name(device: torch.device) -> str:
    """The GPU's name, or the host processor's for a CPU device."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or "cpu"


def measured_backends(device: torch.device) -> list[str]:
    """``auto`` and every registered backend available on ``device``, built-in ones first."""
    available = available_backends(device)
    known = [name for name in KVSNAP_BACKENDS if name == "auto" or name in available]
    return known + [name for name in available if name not in KVSNAP_BACKENDS]


def geometry_for(kind: str, page_size_bytes: int) -> dict[str, int]:
    """The :func:`~kvsnap.layout.allocate.allocate_cache` geometry of bfloat16 pages this size."""
    if kind == "mla":
        return {"block_size": page_size_bytes // (MLA_LATENT * 2), "latent_dim": MLA_LATENT}
    block_size, num_kv_heads, head_dim = HEAD_PAGES[page_size_bytes]
    return {"block_size": block_size, "num_kv_heads": num_kv_heads, "head_dim": head_dim}


def job_block_counts(
    kind: str, page_size_bytes: int, block_counts: Sequence[int], job_bytes_limit: int
) -> list[int]:
    """The distinct job sizes in blocks, each cut so that a job moves at most the limit."""
    parts = 1 if kind == "mla" else 2
    block_bytes = page_size_bytes * parts * NUM_LAYERS
    return sorted({min(count, job_bytes_limit // block_bytes) for count in block_counts})


def random_cache(
    kind: str, page_size_bytes: int, num_blocks: int, device: torch.device
) -> AllocatedCache:
    """A two-layer bfloat16 cache of layout ``kind`` filled with random bytes."""
    cache = allocate_cache(
        kind,
        num_layers=NUM_LAYERS,
        num_blocks=num_blocks,
        dtype=torch.bfloat16,
        device=device,
        fill="empty",
        **geometry_for(kind, page_size_bytes),
    )
    for tensor in cache.tensors:
        tensor.view(torch.uint8).random_(0, 256)  # arbitrary bit patterns, NaNs too
    return cache


@dataclass
class TransferCase:
    """One job: ``block_ids`` of ``cache`` to and from canonical pages at the start of ``host``.

    ``host`` is page-locked uint8 memory (on CUDA) at least :attr:`job_bytes` long;
    ``device_buffer`` is as long, on the cache's device, for the ceiling.
    """

    cache: AllocatedCache
    block_ids: np.ndarray
    host: torch.Tensor
    device_buffer: torch.Tensor
    timer: Timer
    repeats: int
    backend_options: Mapping[str, Mapping[str, Any]] | None = None

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)

    @property
    def tensor_names(self) -> list[str]:
        return self.cache.layout.geometry.tensor_names()

    @property
    def page_size_bytes(self) -> int:
        return self.cache.layout.geometry.canonical_page_size_bytes

    @property
    def job_bytes(self) -> int:
        return self.num_blocks * self.page_size_bytes * len(self.tensor_names)

    def copies(self) -> list[PageCopy]:
        """The job: each tensor's blocks to consecutive host pages, tensor after tensor."""
        count, page = self.num_blocks, self.page_size_bytes
        return [
            PageCopy(
                name,
                self.block_ids,
                HostPages.contiguous(self.host[i * count * page :].data_ptr(), count, page),
                np.arange(count),
            )
            for i, name in enumerate(self.tensor_names)
        ]

    def measurement(
        self, direction: Direction, method: str, seconds: float | None, **extra: Any
    ) -> Measurement:
        """A :class:`Measurement` of ``method`` on this job (``seconds`` None: not measured)."""
        gbps = self.job_bytes / seconds / 1e9 if seconds else None
        return Measurement(
            self.cache.kind,
            self.page_size_bytes,
            self.num_blocks,
            direction.value,
            method,
            self.job_bytes,
            seconds,
            gbps,
            **extra,
        )


def transfer_cases(
    device: torch.device,
    layouts: Sequence[str],
    page_sizes: Sequence[int],
    block_counts: Sequence[int],
    *,
    job_bytes_limit: int,
    repeats: int,
    seed: int = 0,
    backend_options: Mapping[str, Mapping[str, Any]] | None = None,
) -> Iterator[TransferCase]:
    """Every (layout, page size, job size) case, in that order, sharing one host buffer.

    Each layout and page size gets a cache twice the size of its largest job, from which each
    job's blocks are drawn at random; a case is valid until the next one is drawn.
    """
    with PinnedPool(job_bytes_limit, 1, pin=device.type == "cuda") as pool:
        host = pool.slot(0).tensor
        device_buffer = torch.empty(job_bytes_limit, dtype=torch.uint8, device=device)
        timer = Timer(device)
        rng = np.random.default_rng(seed)
        for kind in layouts:
            for page_size_bytes in page_sizes:
                counts = job_block_counts(kind, page_size_bytes, block_counts, job_bytes_limit)
                cache_blocks = 2 * max(counts)
                cache = random_cache(kind, page_size_bytes, cache_blocks, device)
                for count in counts:
                    block_ids = np.sort(rng.choice(cache_blocks, count, replace=False))
                    yield TransferCase(
                        cache, block_ids, host, device_buffer, timer, repeats, backend_options
                    )
                del cache  # free it before the next page size's cache is allocated
