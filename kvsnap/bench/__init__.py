"""Measure this machine's transfer paths and derive the ``auto`` calibration.

``kvsnap bench`` and ``python -m benchmarks.transfer`` both measure through this package:

* :mod:`~kvsnap.bench.cases`: a :class:`TransferCase` is one job, a random sorted set of
  ``block_ids`` of an engine cache copied to or from canonical pages at the start of a host
  buffer; the page and job sizes measured; :class:`Measurement` and :class:`Timer`.
* :mod:`~kvsnap.bench.measure`: :func:`measure_case` times, for one direction, the contiguous
  ceiling (one copy of the job's bytes between device memory and page-locked host memory) and a
  :class:`~kvsnap.transfer.TransferHandler` with each backend, from ``submit`` to the completed
  ``wait``, host planning included; the first and last pages of every capture are checked
  bit-exact on its warm-up run.
* :mod:`~kvsnap.bench.calibration`: :func:`derive_calibration` turns measurements of the vLLM
  split NHD layout into the calibration ``auto`` reads (:func:`kvsnap.transfer.policy.load_policy`).
* :mod:`~kvsnap.bench.run`: :func:`run_bench` measures the matrix ``kvsnap bench`` shows.

GB/s counts the job's canonical bytes; ratios divide by the ceiling of the same job and
direction, so they compare across machines and runs better than GB/s do.
"""

from kvsnap.bench.calibration import derive_calibration
from kvsnap.bench.cases import (
    BATCH_COPY_SHARE,
    CALIBRATION_LAYOUT,
    HEAD_PAGES,
    JOB_BYTES_LIMIT,
    KVSNAP_BACKENDS,
    LARGE_JOB_BLOCKS,
    MLA_LATENT,
    NUM_LAYERS,
    PAGE_SIZES,
    QUICK_JOB_BYTES_LIMIT,
    SLOW_RUN_SECONDS,
    SMALL_JOB_BLOCKS,
    KiB,
    Measurement,
    MiB,
    Timer,
    TransferCase,
    device_name,
    geometry_for,
    job_block_counts,
    measured_backends,
    random_cache,
    resolve_device,
    transfer_cases,
)
from kvsnap.bench.measure import (
    check_capture,
    measure_backend,
    measure_case,
    measure_ceiling,
    measure_method,
    median_time,
    set_ratios,
)
from kvsnap.bench.run import BenchProgressCallback, BenchReport, format_bytes, run_bench

__all__ = [
    "BATCH_COPY_SHARE",
    "CALIBRATION_LAYOUT",
    "HEAD_PAGES",
    "JOB_BYTES_LIMIT",
    "KVSNAP_BACKENDS",
    "LARGE_JOB_BLOCKS",
    "MLA_LATENT",
    "NUM_LAYERS",
    "PAGE_SIZES",
    "QUICK_JOB_BYTES_LIMIT",
    "SLOW_RUN_SECONDS",
    "SMALL_JOB_BLOCKS",
    "BenchProgressCallback",
    "BenchReport",
    "KiB",
    "Measurement",
    "MiB",
    "Timer",
    "TransferCase",
    "check_capture",
    "derive_calibration",
    "device_name",
    "format_bytes",
    "geometry_for",
    "job_block_counts",
    "measure_backend",
    "measure_case",
    "measure_ceiling",
    "measure_method",
    "measured_backends",
    "median_time",
    "random_cache",
    "resolve_device",
    "run_bench",
    "set_ratios",
    "transfer_cases",
]
