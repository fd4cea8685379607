"""``kvsnap bench``'s matrix: :func:`run_bench` measures it and returns a :class:`BenchReport`."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvsnap.bench.calibration import derive_calibration
from kvsnap.bench.cases import (
    CALIBRATION_LAYOUT,
    JOB_BYTES_LIMIT,
    LARGE_JOB_BLOCKS,
    PAGE_SIZES,
    QUICK_JOB_BYTES_LIMIT,
    SMALL_JOB_BLOCKS,
    KiB,
    Measurement,
    MiB,
    TransferCase,
    device_name,
    job_block_counts,
    measured_backends,
    resolve_device,
    transfer_cases,
)
from kvsnap.bench.measure import measure_case
from kvsnap.transfer import current_policy
from kvsnap.transfer.plan import Direction


@dataclass
class BenchReport:
    """What :func:`run_bench` measured, and the calibration derived from it."""

    device: str
    device_name: str
    quick: bool
    backends: list[str]
    #: Where the ``auto`` policy in force during the run came from (a calibration file or the
    #: built-in defaults); the ``kvsnap-auto`` rows ran under it.
    auto_policy: str
    results: list[Measurement]
    calibration: dict[str, Any]
    seconds: float

    @property
    def smoke_test(self) -> bool:
        """True for host memory: the figures then say nothing about GPU transfers."""
        return not self.device.startswith("cuda")

    def to_json(self) -> dict[str, Any]:
        """The report as a JSON-ready mapping (``smoke_test`` included)."""
        payload = dataclasses.asdict(self)
        payload["smoke_test"] = self.smoke_test
        payload["torch"] = torch.__version__
        return payload


#: ``on_progress(steps done, total steps, what runs next)``; a step is one case and direction.
BenchProgressCallback = Callable[[int, int, str], None]


def run_bench(
    device: str | torch.device = "cuda",
    *,
    quick: bool = False,
    on_progress: BenchProgressCallback | None = None,
) -> BenchReport:
    """Measure ``kvsnap bench``'s matrix on ``device`` and derive the ``auto`` calibration.

    The matrix: the vLLM split NHD layout (two bfloat16 layers) at canonical pages of 2 KiB,
    16 KiB, 128 KiB and 2 MiB; per page size a large job (up to :data:`LARGE_JOB_BLOCKS` blocks,
    cut to :data:`JOB_BYTES_LIMIT`) and a small one of :data:`SMALL_JOB_BLOCKS` blocks; both
    directions; the ceiling and kvsnap with ``auto`` and every available backend. ``quick`` cuts
    jobs to :data:`QUICK_JOB_BYTES_LIMIT` and times each method once after its warm-up.

    Raises ``ValueError`` when ``device`` is not usable (see :func:`resolve_device`).
    """
    target = resolve_device(device)
    job_bytes_limit = QUICK_JOB_BYTES_LIMIT if quick else JOB_BYTES_LIMIT
    block_counts = (SMALL_JOB_BLOCKS, LARGE_JOB_BLOCKS)
    backends = measured_backends(target)
    total_steps = len(Direction) * sum(
        len(job_block_counts(CALIBRATION_LAYOUT, page, block_counts, job_bytes_limit))
        for page in PAGE_SIZES
    )
    report = on_progress or (lambda done, total, label: None)
    started = time.perf_counter()
    results: list[Measurement] = []
    cases = transfer_cases(
        target,
        [CALIBRATION_LAYOUT],
        PAGE_SIZES,
        block_counts,
        job_bytes_limit=job_bytes_limit,
        repeats=1 if quick else 3,
    )
    steps_done = 0
    for case in cases:
        for direction in Direction:
            report(steps_done, total_steps, _case_label(case, direction))
            results += measure_case(case, direction, backends)
            steps_done += 1
    report(total_steps, total_steps, "done")
    name = device_name(target)
    return BenchReport(
        device=str(target),
        device_name=name,
        quick=quick,
        backends=backends,
        auto_policy=_policy_source(),
        results=results,
        calibration=derive_calibration(results, name),
        seconds=time.perf_counter() - started,
    )


def _case_label(case: TransferCase, direction: Direction) -> str:
    arrow = "device→host" if direction is Direction.DEVICE_TO_HOST else "host→device"
    return f"{format_bytes(case.page_size_bytes)} pages x {case.num_blocks} blocks, {arrow}"


def _policy_source() -> str:
    try:
        return current_policy().source
    except ValueError as exc:  # an unreadable calibration: the auto rows then failed with it
        return f"unreadable calibration ({exc})"


def format_bytes(size: int) -> str:
    """``2048`` -> ``"2 KiB"``: whole binary units, as page sizes are written in the docs."""
    for unit, scale in (("MiB", MiB), ("KiB", KiB)):
        if size >= scale and size % scale == 0:
            return f"{size // scale} {unit}"
    return f"{size} B"
