"""The ``auto`` calibration derived from measurements of vLLM's split NHD layout."""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvsnap.bench.cases import BATCH_COPY_SHARE, CALIBRATION_LAYOUT, Measurement, MiB
from kvsnap.store.files.publish import publish_bytes
from kvsnap.transfer.plan import Direction
from kvsnap.transfer.policy import (
    CALIBRATION_VERSION,
    SMALL_FRAGMENT_BACKEND,
    calibration_path,
    forget_policy,
    policy_from_calibration,
)


def derive_calibration(results: Sequence[Measurement], device_name: str) -> dict[str, Any]:
    """The ``auto`` calibration (see :func:`kvsnap.transfer.policy.load_policy`) from measurements.

    Only vLLM split NHD rows count, and per page size only its largest job. Per direction,
    ``cuda-batch`` is used from the smallest page size at which it was measured and reached
    :data:`BATCH_COPY_SHARE` of the best small-fragment backend (``triton`` or ``torch``); where
    it never did, from four times the largest page measured. ``small_backend`` is the one of
    ``triton`` and ``torch`` that was faster at more page sizes (``triton`` on a tie), or the
    built-in default when neither was measured.
    """
    thresholds: dict[str, int] = {}
    small_votes = {"triton": 0, "torch": 0}
    for direction in Direction:
        by_page = _largest_job_gbps(results, direction)
        threshold = None
        for page_size_bytes in sorted(by_page):
            gbps = by_page[page_size_bytes]
            triton, torch_gbps = gbps.get("kvsnap-triton", 0.0), gbps.get("kvsnap-torch", 0.0)
            if triton or torch_gbps:
                small_votes["triton" if triton >= torch_gbps else "torch"] += 1
            batch = gbps.get("kvsnap-cuda-batch")
            if threshold is None and batch and batch >= BATCH_COPY_SHARE * max(triton, torch_gbps):
                threshold = page_size_bytes
        thresholds[direction.value] = (
            threshold if threshold is not None else 4 * max(by_page, default=MiB)
        )
    small_backend = (
        max(small_votes, key=small_votes.__getitem__)
        if any(small_votes.values())
        else SMALL_FRAGMENT_BACKEND
    )
    return {
        "version": CALIBRATION_VERSION,
        "large_fragment_bytes": thresholds,
        "small_backend": small_backend,
        "measured_on": device_name,
        "date": datetime.date.today().isoformat(),
    }


def _largest_job_gbps(
    results: Sequence[Measurement], direction: Direction
) -> dict[int, dict[str, float]]:
    """Page size -> method -> GB/s of the largest calibration-layout job in ``direction``."""
    rows = [
        m
        for m in results
        if m.layout == CALIBRATION_LAYOUT and m.direction == direction.value and m.gbps is not None
    ]
    largest: dict[int, int] = {}
    for m in rows:
        largest[m.page_bytes] = max(largest.get(m.page_bytes, 0), m.blocks)
    by_page: dict[int, dict[str, float]] = {page: {} for page in largest}
    for m in rows:
        if m.blocks == largest[m.page_bytes]:
            by_page[m.page_bytes][m.method] = m.gbps
    return by_page


def write_calibration(calibration: Mapping[str, Any], path: Path | None = None) -> Path:
    """Write ``calibration`` where :func:`~kvsnap.transfer.policy.load_policy` reads it.

    Args:
        calibration: the mapping :func:`derive_calibration` returns (or one of the same shape).
        path: where to write; ``None`` (the default) is
            :func:`~kvsnap.transfer.base.calibration_path`.

    Returns:
        The path written.

    Raises:
        ValueError: ``calibration`` is not a valid calibration; nothing is written.
        OSError: the file could not be published.

    The mapping is validated first (a file this writes always loads), replaces any previous file
    atomically, and the policy :func:`~kvsnap.transfer.base.current_policy` cached is dropped, so
    ``auto`` uses the new one from its next job in this process as in any new one.
    """
    policy_from_calibration(calibration, source="calibration to write")
    path = calibration_path() if path is None else Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    publish_bytes(path, (json.dumps(dict(calibration), indent=2) + "\n").encode())
    forget_policy()
    return path
