"""The transfer handler: ordered, asynchronous copy jobs between one cache and host pages.

One :class:`TransferHandler` serves one direction (capture: device to host; restore: host to
device), the way vLLM's CPU offload worker does. A job is a list of
:class:`~kvsnap.transfer.plan.PageCopy`; :meth:`TransferHandler.submit` validates it whole, then
enqueues it on a pooled CUDA stream that first waits for the previous job's end event (so jobs
run in submission order) and, at device to host, for the compute stream that writes the KV.
Descriptor backends receive the job in pieces planned copy by copy, so the device copies one
piece while the host plans the next; the ``torch`` backend receives the copies themselves.
Streams, timing events and page-locked descriptor buffers are pooled and recycled when a job
is collected. A copy that fails fails its own job (``success=False``), never the handler.

On a cache in host memory (no CUDA) the same jobs run synchronously inside ``submit`` and are
collected the same way, so the CPU test suite exercises the handler's bookkeeping.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvsnap.layout import CacheLayout
from kvsnap.transfer.backends import available_backends, make_backend
from kvsnap.transfer.base import CopyBackend, CopyJob, TransferResult, on_stream
from kvsnap.transfer.plan import CopyPlanner, Descriptors, Direction, PageCopy, ResolvedCopy
from kvsnap.transfer.policy import choose_backend

#: Default :attr:`TransferHandler.flush_descriptors`: large enough that launches and driver
#: calls are amortized (~1-2 ms of copying), small enough that the device starts early.
FLUSH_DESCRIPTORS = 1 << 16


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


@dataclass
class _InflightJob:
    """A submitted CUDA job whose completion has not been observed yet."""

    job_id: int
    num_bytes: int
    backend: str
    stream: torch.cuda.Stream
    start_event: torch.cuda.Event
    end_event: torch.cuda.Event
    buffers: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # pinned descriptors
    error: str | None  # set when the backend raised while enqueueing


class TransferHandler:
    """Ordered asynchronous copy jobs in one direction between ``layout``'s cache and host pages.

    Args:
        layout: the cache (on CUDA or in host memory).
        direction: :attr:`Direction.DEVICE_TO_HOST` (capture) or ``HOST_TO_DEVICE`` (restore).
        backend: ``"auto"``, a backend name (``cpu``, ``torch``, ``triton``, ``cuda-batch``) or a
            :class:`CopyBackend` instance. ``auto`` picks per job (see
            :func:`kvsnap.transfer.policy.choose_backend`): ``cpu`` without CUDA; on CUDA the
            driver batch copy for fragments of 2 MiB and more, the ``torch`` staging gather
            below that, the Triton kernel when a capture writes partial host pages (TP).
        compute_stream: the stream that writes the KV. Device-to-host jobs wait for it (default:
            the device's current stream at each ``submit``); host-to-device jobs wait for it only
            when it is given (an engine that zeroes reallocated blocks on it passes it).
        merge: merge descriptors that continue each other (consecutive blocks) into one.
        backend_options: per backend name, keyword options for its constructor, e.g.
            ``{"torch": {"staging_bytes": 16 << 20}}``.
        flush_descriptors: a descriptor backend receives the job in pieces of about this many
            descriptors, planned copy by copy, so copying overlaps the planning of the rest.

    ``backend_name`` is the backend a fixed choice resolved to, or under ``auto`` the one it
    picks for a job of one block of every tensor; each :class:`TransferResult` names the
    backend that ran it. The handler is safe to call from several threads.
    """

    def __init__(
        self,
        layout: CacheLayout,
        direction: Direction,
        *,
        backend: str | CopyBackend = "auto",
        compute_stream: torch.cuda.Stream | None = None,
        merge: bool = True,
        backend_options: Mapping[str, Mapping[str, Any]] | None = None,
        flush_descriptors: int = FLUSH_DESCRIPTORS,
    ) -> None:
        self.layout = layout
        self.direction = Direction(direction)
        self.merge = merge
        #: Descriptors planned before the handler hands them to a descriptor backend.
        self.flush_descriptors = max(1, flush_descriptors)
        self.planner = CopyPlanner(layout)
        self.device = layout.device
        self._on_cuda = self.device.type == "cuda"
        self._device_index = (
            (self.device.index if self.device.index is not None else torch.cuda.current_device())
            if self._on_cuda
            else None
        )
        self._compute_stream = compute_stream
        self._backend_options = {
            name: dict(options) for name, options in (backend_options or {}).items()
        }
        self._backends: dict[str, CopyBackend] = {}
        self._available: frozenset[str] | None = None
        self._fixed: CopyBackend | None = None
        if isinstance(backend, CopyBackend):
            self._fixed = backend
            self._backends[backend.name] = backend
        elif backend != "auto":
            self._fixed = self._backend(backend)
        self.backend_name = (
            self._fixed.name if self._fixed is not None else self._auto_name_for_pages()
        )
        #: Why the last rejected ``submit`` returned False.
        self.last_rejection: str | None = None
        self._lock = threading.RLock()
        self._closed = False
        self._inflight: deque[_InflightJob] = deque()
        self._done: OrderedDict[int, TransferResult] = OrderedDict()
        self._last_submitted: _InflightJob | None = None
        self._stream_pool: list[torch.cuda.Stream] = []
        self._event_pool: list[torch.cuda.Event] = []
        self._buffer_pool: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    # ----------------------------------------------------------------------------------------
    # backends

    def _backend(self, name: str) -> CopyBackend:
        backend = self._backends.get(name)
        if backend is None:
            backend = make_backend(
                name, self.layout, self.direction, **self._backend_options.get(name, {})
            )
            self._backends[name] = backend
        return backend

    def _auto_name_for_pages(self) -> str:
        names = [ref.name for ref in self.layout.refs]
        return self._choose(names, [1] * len(names))

    def _choose(self, names: Sequence[str], counts: Sequence[int]) -> str:
        """The ``auto`` backend for copies of ``counts[i]`` blocks of tensor ``names[i]``."""
        fragments = total = 0
        whole_pages = True
        for name, count in zip(names, counts, strict=True):
            template = self.planner.template(name)
            fragments += count * template.num_fragments
            total += count * template.bytes_per_block
            mapping = self.layout.ref(name).mapping
            whole_pages &= mapping.local_bytes == mapping.canonical_page_size_bytes
        mean = total / fragments if fragments else 0.0
        if self._available is None:
            # Probed once: probing every backend costs more host time than a small job's copy.
            self._available = frozenset(available_backends(self.device))
        return choose_backend(self.device, self.direction, mean, whole_pages, self._available)

    def _validate(self, copies: Sequence[PageCopy]) -> tuple[list[ResolvedCopy], int, int]:
        """Check every copy before anything runs: ``(resolved copies, bytes moved, upper bound
        on descriptors)``, so that a job is either rejected whole or planned and enqueued."""
        resolved = self.planner.resolve_job(copies, self.direction)
        total_bytes = sum(copy.num_bytes for copy in resolved)
        max_descriptors = sum(
            len(copy.device_block_ids) * self.planner.template(copy.ref.name).num_fragments
            for copy in resolved
        )
        return resolved, total_bytes, max_descriptors

    # ----------------------------------------------------------------------------------------
    # submission

    def submit(self, job_id: int, copies: Sequence[PageCopy]) -> bool:
        """Validate and enqueue one job; False (with :attr:`last_rejection` set) if rejected.

        A job is rejected after :meth:`shutdown`, when ``job_id`` is still pending, or when its
        copies are invalid (unknown tensor, block ids out of range, wrong host page size, too
        few host pages); nothing of a rejected job runs. An accepted job produces exactly one
        :class:`TransferResult`; on CPU it has already run when ``submit`` returns. Descriptor
        backends get the job in pieces of about :attr:`flush_descriptors` descriptors, planned
        copy by copy, so the device starts copying while the host plans the rest.
        """
        with self._lock:
            if self._closed:
                return self._reject(f"job {job_id}: the handler is shut down")
            if job_id in self._done or any(job.job_id == job_id for job in self._inflight):
                return self._reject(f"job {job_id} is already pending")
            try:
                resolved, num_bytes, max_descriptors = self._validate(copies)
            except (ValueError, KeyError, TypeError) as exc:
                return self._reject(f"job {job_id}: {_describe(exc)}")
            try:
                backend = self._fixed or self._backend(
                    self._choose(
                        [c.name for c in copies], [len(c.device_block_ids) for c in copies]
                    )
                )
            except Exception as exc:
                self._done[job_id] = TransferResult(job_id, False, 0, 0.0, _describe(exc))
                return True
            if self._on_cuda:
                self._submit_cuda(job_id, resolved, num_bytes, max_descriptors, backend)
            else:
                self._run_now(job_id, resolved, num_bytes, backend)
            self.last_rejection = None
            return True

    def _reject(self, reason: str) -> bool:
        self.last_rejection = reason
        return False

    def _enqueue(
        self,
        job_id: int,
        copies: Sequence[ResolvedCopy],
        backend: CopyBackend,
        stream: torch.cuda.Stream | None,
        buffers: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    ) -> None:
        """Hand the job to ``backend``: whole (torch), or planned and executed in pieces."""
        if not backend.uses_descriptors:
            backend.execute(CopyJob(job_id, copies, Descriptors.empty(), stream))
            return
        pending: list[Descriptors] = []
        pending_copies: list[ResolvedCopy] = []
        offset = 0

        def flush() -> None:
            nonlocal offset
            count = sum(len(part) for part in pending)
            if count == 0:
                return
            if buffers is None:
                arrays = [
                    np.concatenate([part.src for part in pending]),
                    np.concatenate([part.dst for part in pending]),
                    np.concatenate([part.sizes for part in pending]),
                ]
                pinned = None
            else:
                pinned = tuple(buffer[offset : offset + count] for buffer in buffers)
                arrays = [tensor.numpy() for tensor in pinned]
                start = 0
                for part in pending:
                    end = start + len(part)
                    arrays[0][start:end] = part.src
                    arrays[1][start:end] = part.dst
                    arrays[2][start:end] = part.sizes
                    start = end
            descriptors = Descriptors(*arrays)
            backend.execute(CopyJob(job_id, list(pending_copies), descriptors, stream, pinned))
            offset += count
            pending.clear()
            pending_copies.clear()

        planned = 0
        for copy in copies:
            descriptors = self.planner.descriptors([copy], self.direction, merge=self.merge)
            pending.append(descriptors)
            pending_copies.append(copy)
            planned += len(descriptors)
            if planned >= self.flush_descriptors:
                flush()
                planned = 0
        flush()

    def _run_now(
        self, job_id: int, copies: Sequence[ResolvedCopy], num_bytes: int, backend: CopyBackend
    ) -> None:
        start = time.perf_counter()
        try:
            self._enqueue(job_id, copies, backend, None, None)
        except Exception as exc:
            elapsed = time.perf_counter() - start
            result = TransferResult(job_id, False, 0, elapsed, _describe(exc), backend.name)
        else:
            elapsed = time.perf_counter() - start
            result = TransferResult(job_id, True, num_bytes, elapsed, None, backend.name)
        self._done[job_id] = result

    def _submit_cuda(
        self,
        job_id: int,
        copies: Sequence[ResolvedCopy],
        num_bytes: int,
        max_descriptors: int,
        backend: CopyBackend,
    ) -> None:
        buffers = self._take_buffers(max_descriptors) if backend.uses_descriptors else None
        stream = self._stream_pool.pop() if self._stream_pool else torch.cuda.Stream(self.device)
        start_event = self._new_event()
        end_event = self._new_event()
        waits_for = self._compute_stream
        if waits_for is None and self.direction is Direction.DEVICE_TO_HOST:
            # Capture reads KV the model may still be writing: order after the compute stream.
            waits_for = torch.cuda.current_stream(self._device_index)
        if waits_for is not None:
            stream.wait_stream(waits_for)
        previous = self._last_submitted
        if previous is not None and any(job is previous for job in self._inflight):
            stream.wait_event(previous.end_event)
        error = None
        # Backends launch on the current device: make it the cache's (rarely needed, so skipped
        # when it already is: entering torch.cuda.device costs as much as a copy's launch).
        on_device = (
            contextlib.nullcontext()
            if torch.cuda.current_device() == self._device_index
            else torch.cuda.device(self._device_index)
        )
        with on_device, on_stream(stream):
            start_event.record(stream)
            try:
                self._enqueue(job_id, copies, backend, stream, buffers)
            except Exception as exc:
                # Enqueue failures fail this job only; the end event is still recorded so the
                # next job's chain and this job's completion stay well defined.
                error = _describe(exc)
            end_event.record(stream)
        inflight = _InflightJob(
            job_id, num_bytes, backend.name, stream, start_event, end_event, buffers, error
        )
        self._inflight.append(inflight)
        self._last_submitted = inflight

    def _new_event(self) -> torch.cuda.Event:
        return self._event_pool.pop() if self._event_pool else torch.cuda.Event(enable_timing=True)

    def _take_buffers(self, count: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        for index, buffers in enumerate(self._buffer_pool):
            if buffers[0].numel() >= count:
                return self._buffer_pool.pop(index)
        capacity = max(1024, 1 << max(count - 1, 0).bit_length())
        return tuple(  # type: ignore[return-value]
            torch.empty(capacity, dtype=torch.int64, pin_memory=True) for _ in range(3)
        )

    # ----------------------------------------------------------------------------------------
    # completion

    def _finish(self, job: _InflightJob, sync_error: str | None) -> None:
        """Turn a completed (or failed) in-flight job into its result and recycle its resources."""
        error = job.error or sync_error
        seconds = 0.0
        if sync_error is None:
            try:
                seconds = job.start_event.elapsed_time(job.end_event) / 1000.0
            except RuntimeError as exc:
                error = error or _describe(exc)
        if error is None:
            result = TransferResult(job.job_id, True, job.num_bytes, seconds, None, job.backend)
        else:
            result = TransferResult(job.job_id, False, 0, seconds, error, job.backend)
        self._done[job.job_id] = result
        if sync_error is None:
            # Only resources of jobs known complete are reused; a job whose stream reported an
            # error may still be referenced by the device, so its buffers are dropped instead.
            self._stream_pool.append(job.stream)
            self._event_pool.extend((job.start_event, job.end_event))
            if job.buffers is not None:
                self._buffer_pool.append(job.buffers)

    def _poll(self) -> None:
        while self._inflight:
            job = self._inflight[0]
            try:
                complete = job.end_event.query()
            except RuntimeError as exc:
                self._inflight.popleft()
                self._finish(job, _describe(exc))
                continue
            if not complete:
                return
            self._inflight.popleft()
            self._finish(job, None)

    def _finish_through(self, job_id: int) -> str | None:
        """Block until job ``job_id`` (and so every earlier job) completes; collect them all.

        Returns the synchronization error, if one occurred; the failing job and every job
        after it up to ``job_id`` are then reported failed without waiting any further.
        """
        with self._lock:
            target = next((job for job in self._inflight if job.job_id == job_id), None)
        if target is None:
            return None
        sync_error = None
        try:
            target.end_event.synchronize()
        except RuntimeError as exc:
            sync_error = _describe(exc)
        with self._lock:
            while self._inflight:
                job = self._inflight.popleft()
                self._finish(job, sync_error)
                if job is target:
                    break
        return sync_error

    def get_finished(self) -> list[TransferResult]:
        """Results of the jobs completed since the last call, in submission order.

        Never blocks. Jobs already returned by :meth:`wait` are not repeated.
        """
        with self._lock:
            self._poll()
            results = list(self._done.values())
            self._done.clear()
            return results

    def wait(self, job_ids: Iterable[int]) -> list[TransferResult]:
        """Block until the given jobs complete and return their results, in submission order.

        The returned results are removed from what :meth:`get_finished` reports. Ids that are
        neither pending nor uncollected (unknown, or already collected) are ignored.
        """
        wanted = set(job_ids)
        with self._lock:
            order = [job.job_id for job in self._inflight if job.job_id in wanted]
        if order:
            # Jobs complete in submission order, so waiting for the last one waits for all.
            self._finish_through(order[-1])
        with self._lock:
            self._poll()
            return [self._done.pop(job_id) for job_id in list(self._done) if job_id in wanted]

    @property
    def num_pending(self) -> int:
        """Jobs submitted whose results have not been collected yet."""
        with self._lock:
            return len(self._inflight) + len(self._done)

    def shutdown(self) -> None:
        """Stop accepting jobs, wait for the submitted ones and release streams, events and buffers.

        Results of the drained jobs stay available to :meth:`get_finished`. If a job's stream
        reports an error while draining, the remaining jobs are marked failed without waiting
        for them and the error is raised after the resources are released. Calling it again
        does nothing.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            last = self._inflight[-1].job_id if self._inflight else None
        sync_error = self._finish_through(last) if last is not None else None
        with self._lock:
            self._stream_pool.clear()
            self._event_pool.clear()
            self._buffer_pool.clear()
            self._last_submitted = None
            backends = list(self._backends.values())
            self._backends.clear()
        for backend in backends:
            backend.close()
        if sync_error is not None:
            raise RuntimeError(f"a transfer failed while draining the handler: {sync_error}")

    def __enter__(self) -> TransferHandler:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()
