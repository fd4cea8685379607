"""Streaming reads of a snapshot's KV: a bounded piece at a time, the next one read while the
caller works on this one.

A :class:`BlockSource` reads blocks of one layer tensor of a snapshot, its head-range parts
put back together, into a buffer the caller owns; :func:`prefetched` runs a list of steps so
that step ``i + 1`` is read (on the readers' threads, checksums verified there) while the
caller reduces step ``i``. Memory stays at two buffers per snapshot, whatever its size.
"""

from __future__ import annotations

import concurrent.futures
import math
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

import numpy as np

from kvsnap import format as fmt
from kvsnap.analysis.readable import ReadableSnapshot
from kvsnap.dtypes import kv_element

#: Bytes of stored KV one step reads from one snapshot (two such buffers per snapshot are in
#: use at a time in each lane: the one being reduced and the one being read).
STEP_BYTES = 4 << 20
#: Threads that reduce at once, each its own share of the tensors: numpy lets go of the GIL
#: inside its loops, so two lanes keep both cores of a small machine busy.
LANES = 2

Step = TypeVar("Step")
Result = TypeVar("Result")


class BlockSource:
    """Blocks of one snapshot's layer tensors as whole canonical pages (every head), read into
    a caller's ``uint8`` buffer; a parted snapshot's parts are read side by side and their
    heads put in place."""

    def __init__(self, snapshot: ReadableSnapshot) -> None:
        self.snapshot = snapshot
        geometry = snapshot.geometry
        self.geometry = geometry
        self.block_size = geometry.block_size
        self.element_size = kv_element(geometry.dtype).size
        #: Heads and elements per head of a canonical page (MLA: one "head" of the latent).
        self.heads = 1 if geometry.is_mla else geometry.num_kv_heads
        self.dim = geometry.latent_dim if geometry.is_mla else geometry.head_dim
        self.token_bytes = self.heads * self.dim * self.element_size
        self.page_bytes = self.block_size * self.token_bytes
        self._parts = list(snapshot.parts)
        self._scratch: dict[tuple[int, int], np.ndarray] = {}

    def start(
        self, name: str, block_ids: np.ndarray, out: np.ndarray, slot: int = 0
    ) -> Callable[[], None]:
        """Begin reading blocks ``block_ids`` of tensor ``name`` into ``out`` (at least
        ``len(block_ids) * page_bytes`` bytes); the returned function waits for them. A parted
        snapshot's parts are read into scratch buffers of ``slot`` (one per part and slot)."""
        size = len(block_ids) * self.page_bytes
        if len(self._parts) == 1:
            future = self._parts[0].reader.read_pages_async(name, block_ids, out[:size])
            return lambda: future.result()
        pending = []
        for number, part in enumerate(self._parts):
            part_bytes = len(block_ids) * self.block_size * part.num_heads * self.dim
            part_bytes *= self.element_size
            scratch = self._part_buffer((number, slot), part_bytes)
            pending.append((part, scratch, part.reader.read_pages_async(name, block_ids, scratch)))

        def assemble() -> None:
            rows = len(block_ids) * self.block_size
            whole = out[:size].reshape(rows, self.heads, self.dim * self.element_size)
            for part, scratch, future in pending:
                future.result()
                heads = slice(part.first_head, part.first_head + part.num_heads)
                whole[:, heads, :] = scratch.reshape(rows, part.num_heads, -1)

        return assemble

    def _part_buffer(self, key: tuple[int, int], nbytes: int) -> np.ndarray:
        buffer = self._scratch.get(key)
        if buffer is None or buffer.size < nbytes:
            buffer = np.empty(nbytes, dtype=np.uint8)
            self._scratch[key] = buffer
        return buffer[:nbytes]


def token_blocks(record: fmt.SequenceRecord, block_size: int, start: int, stop: int) -> np.ndarray:
    """The snapshot block ids holding tokens ``[start, stop)`` of sequence ``record``
    (``start`` a multiple of ``block_size``)."""
    first, last = start // block_size, math.ceil(stop / block_size)
    return np.asarray(record.block_ids[first:last], dtype=np.int64)


def tokens_per_step(token_bytes: int, *block_sizes: int) -> int:
    """Tokens one step reads: a multiple of every block size (so that a step starts on a block
    of each snapshot), about :data:`STEP_BYTES` of KV."""
    unit = math.lcm(*block_sizes)
    return max(unit, (STEP_BYTES // max(1, token_bytes)) // unit * unit)


def prefetched(
    steps: Sequence[Step], start: Callable[[Step, int], Callable[[], Result]]
) -> Iterator[tuple[Step, Result]]:
    """Each step with its result, in order: ``start(step, slot)`` begins reading ``step`` into
    buffer ``slot`` (0 or 1, alternating) and returns the function that waits for it. Step
    ``i + 1`` is started before step ``i`` is handed over, so the reads run while the caller
    works; a buffer is reused only once the caller is done with the step it held."""
    if not steps:
        return
    pending: Callable[[], Result] | None = start(steps[0], 0)
    try:
        for index, step in enumerate(steps):
            assert pending is not None
            wait, pending = pending, None
            result = wait()
            if index + 1 < len(steps):
                pending = start(steps[index + 1], (index + 1) % 2)
            yield step, result
    finally:
        if pending is not None:  # the caller stopped early: let the read finish with its buffer
            try:
                pending()
            except Exception:  # the caller's own error is the one to report
                pass


class ByteCounter:
    """Progress of several lanes as one count: ``add(bytes)`` from any thread, passed on to
    ``progress(done, total)``; it answers ``False`` once a lane has failed (the others stop)."""

    def __init__(self, total: int, progress: Callable[[int, int], None] | None) -> None:
        self.total = total
        self.done = 0
        self.failed = False
        self._progress = progress
        self._lock = threading.Lock()

    def add(self, nbytes: int) -> bool:
        with self._lock:
            self.done += nbytes
            if self._progress is not None:
                self._progress(self.done, self.total)
            return not self.failed


def in_lanes(
    work: Sequence[Callable[[Callable[[int], bool]], Result]], counter: ByteCounter
) -> list[Result]:
    """Run each ``work(advance)`` on a thread of its own and return their results in order;
    the first error is raised once every lane has stopped (told to by ``advance``)."""
    if len(work) == 1:
        return [work[0](counter.add)]
    with concurrent.futures.ThreadPoolExecutor(len(work), "kvsnap-analysis") as pool:
        futures = [pool.submit(lane, counter.add) for lane in work]
        for future in concurrent.futures.as_completed(futures):
            if future.exception() is not None:
                counter.failed = True
        return [future.result() for future in futures]
