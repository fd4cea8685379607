"""Timing one case: the contiguous ceiling and kvsnap's handler with each backend.

Each method is timed from an idle device to the completion of what it enqueues; kvsnap's
handler from ``submit`` to the completed ``wait``, host planning included, and the first and
last pages of every capture are checked bit-exact on its warm-up run. A method that fails (a
driver limit, a missing entry point) becomes a measurement without a time and a note saying why.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch

from kvsnap.bench.cases import SLOW_RUN_SECONDS, Measurement, Timer, TransferCase
from kvsnap.transfer import TransferHandler
from kvsnap.transfer.plan import Direction


def median_time(timer: Timer, action: Callable[[], object], repeats: int) -> tuple[float, float]:
    """``(median seconds, warm-up seconds)``; slow actions are timed once after the warm-up."""
    warm = timer.run(action)
    runs = 1 if warm > SLOW_RUN_SECONDS else repeats
    return statistics.median(timer.run(action) for _ in range(runs)), warm


def measure_method(
    case: TransferCase, direction: Direction, method: str, action: Callable[[], object]
) -> Measurement:
    """Time ``action`` on ``case``; a failure (a driver limit, a missing entry point) is recorded
    as a measurement without a time and a note saying why, not raised."""
    try:
        seconds, _ = median_time(case.timer, action, case.repeats)
    except Exception as exc:
        return case.measurement(direction, method, None, note=f"failed: {_describe(exc)}")
    return case.measurement(direction, method, seconds)


def measure_ceiling(case: TransferCase, direction: Direction) -> Measurement:
    """One contiguous copy of the job's bytes between ``device_buffer`` and ``host``."""
    size = case.job_bytes
    device_side, host_side = case.device_buffer[:size], case.host[:size]

    def contiguous_copy() -> None:
        if direction is Direction.DEVICE_TO_HOST:
            host_side.copy_(device_side, non_blocking=True)
        else:
            device_side.copy_(host_side, non_blocking=True)

    return measure_method(case, direction, "ceiling", contiguous_copy)


def measure_backend(case: TransferCase, direction: Direction, backend: str) -> Measurement:
    """kvsnap's handler with ``backend`` (``auto`` or a name) on ``case``, as ``kvsnap-NAME``.

    Timed from ``submit`` to the completed ``wait``; ``host_us_per_block`` is the host time of
    ``submit`` (planning included) per block and ``backend_used`` the backend that ran the job.
    """
    method = f"kvsnap-{backend}"
    try:
        seconds, submit_seconds, used = _time_handler(case, direction, backend)
    except Exception as exc:
        return case.measurement(direction, method, None, note=f"failed: {_describe(exc)}")
    return case.measurement(
        direction,
        method,
        seconds,
        host_us_per_block=submit_seconds / case.num_blocks * 1e6,
        backend_used=used,
    )


def _time_handler(
    case: TransferCase, direction: Direction, backend: str
) -> tuple[float, float, str]:
    """``(median seconds, median host seconds of submit, backend used)`` through a handler."""
    layout = case.cache.layout
    handler = TransferHandler(
        layout, direction, backend=backend, backend_options=case.backend_options
    )
    copies = case.copies()
    repeats = case.repeats
    seconds: list[float] = []
    submit_seconds: list[float] = []
    used = ""
    try:
        for attempt in range(repeats + 1):
            if layout.device.type == "cuda":
                torch.cuda.synchronize(layout.device)
            start = time.perf_counter()
            if not handler.submit(attempt, copies):
                raise RuntimeError(f"job rejected: {handler.last_rejection}")
            submitted = time.perf_counter()
            (result,) = handler.wait([attempt])
            done = time.perf_counter()
            if not result.success:
                raise _JobFailed(str(result.error))
            used = result.backend or backend
            if attempt == 0:  # the warm-up: checked, not timed
                if direction is Direction.DEVICE_TO_HOST:
                    check_capture(case)
                if done - start > SLOW_RUN_SECONDS:
                    repeats = 1
                continue
            seconds.append(done - start)
            submit_seconds.append(submitted - start)
            if len(seconds) >= repeats:
                break
    finally:
        handler.shutdown()
    return statistics.median(seconds), statistics.median(submit_seconds), used


def check_capture(case: TransferCase) -> None:
    """Raise ``AssertionError`` unless the first and last captured page of the first and last
    tensor equal the cache's bytes."""
    names = case.tensor_names
    page, count = case.page_size_bytes, case.num_blocks
    for index in (0, len(names) - 1):
        for k in (0, count - 1):
            block = int(case.block_ids[k])
            expected = (
                case.cache.logical(names[index])[block].contiguous().view(torch.uint8).flatten()
            )
            start = (index * count + k) * page
            if not torch.equal(case.host[start : start + page], expected.cpu()):
                raise AssertionError(f"capture mismatch: {case.cache.kind} {names[index]} {block}")


def set_ratios(results: Sequence[Measurement]) -> None:
    """Fill ``ratio_to_ceiling`` of every measurement from the ceiling of its job and direction."""
    ceilings = {
        _job_key(m): m.gbps for m in results if m.method == "ceiling" and m.gbps is not None
    }
    for m in results:
        ceiling = ceilings.get(_job_key(m))
        if m.gbps is not None and ceiling:
            m.ratio_to_ceiling = m.gbps / ceiling


def _job_key(m: Measurement) -> tuple[str, int, int, str]:
    return (m.layout, m.page_bytes, m.blocks, m.direction)


def measure_case(
    case: TransferCase, direction: Direction, backends: Sequence[str]
) -> list[Measurement]:
    """The ceiling and kvsnap with each of ``backends`` on ``case``, ratios filled in."""
    results = [measure_ceiling(case, direction)]
    results += [measure_backend(case, direction, backend) for backend in backends]
    set_ratios(results)
    return results


class _JobFailed(RuntimeError):
    """A measured job reported failure; its message is already the handler's description."""


def _describe(exc: BaseException) -> str:
    # A failed job's error already names its exception type ("RuntimeError: ...").
    return str(exc) if isinstance(exc, _JobFailed) else f"{type(exc).__name__}: {exc}"
