"""The ``cuda-batch`` backend: the driver's ``cuMemcpyBatchAsync``, one call per job.

The whole descriptor table goes to the copy engines in one driver call, which reaches 48-54
GB/s for descriptors of 64 KiB and more (H200 prototype) without using any SM. The entry point is
resolved once, lazily, through ``cuGetProcAddress`` at ABI version 12080 (CUDA 12.8, whose
signature has the ``failIdx`` out-parameter; CUDA 13 headers name a newer signature without
it), from ``cuda.bindings`` or, when that package is missing, from ``libcuda`` through ctypes.
The call passes numpy's pointers to the descriptor arrays directly, so there is no
per-descriptor Python work. When the batch entry point does not exist (a driver older than
12.8), each descriptor becomes one ``cuMemcpyAsync``. Without a driver (no GPU, cuda-bindings'
``DynamicLibNotFoundError``) the backend reports itself unavailable; it never crashes.

Host-to-device copies read page-locked host memory that no stream writes, so they use source
access order ANY and the driver may pipeline reads. Device-to-host copies read KV the compute
stream may still be writing, so they keep stream order: the job stream's wait on the compute
stream then gates every source read. The legacy default stream is rejected by the driver, so
jobs always run on a created stream.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvsnap.layout import CacheLayout
from kvsnap.transfer.base import CopyBackend, CopyJob
from kvsnap.transfer.plan import Direction

#: ABI version requested for ``cuMemcpyBatchAsync`` (the 12.8 signature, with ``failIdx``).
BATCH_ABI_VERSION = 12080
CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 1
CU_MEMCPY_SRC_ACCESS_ORDER_ANY = 3
CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE = 1
#: Most descriptors handed to one ``cuMemcpyBatchAsync`` call. On the H200 test machine
#: (driver 580.159) a call with tens of thousands of descriptors of mixed sizes crashed the
#: process inside the driver twice, while calls of up to ~8000 never failed; chunks of this
#: size cost one extra call per 4096 descriptors (~2 ms of host time at 0.5 us each anyway).
MAX_DESCRIPTORS_PER_CALL = 4096
#: Most descriptors a job may hand to the batch copy at once (the handler passes a job in pieces
#: of about ``flush_descriptors``). Full benchmark runs on the H200 machine
#: (driver 580.159) crashed the process inside ``cuMemcpyBatchAsync`` four times, always on
#: jobs of ~130k merged 2-8 KiB descriptors (in calls of 4096) after earlier cases had run, and
#: never on jobs of up to 32768; the cause is not known (docs/benchmarks.md). Such a job is
#: refused with an error, which fails it alone, rather than risking the process. ``auto`` never
#: sends fragments under 2 MiB here, so it never meets this bound.
MAX_DESCRIPTORS_PER_JOB = 1 << 15


class CUmemLocation(ctypes.Structure):
    """``CUmemLocation``: a location type and an id (device ordinal or NUMA node)."""

    _fields_ = (("type", ctypes.c_int), ("id", ctypes.c_int))


class CUmemcpyAttributes(ctypes.Structure):
    """``CUmemcpyAttributes`` (CUDA 12.8): access order, location hints and flags."""

    _fields_ = (
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", CUmemLocation),
        ("dstLocHint", CUmemLocation),
        ("flags", ctypes.c_uint),
    )


_BATCH_SIGNATURE = ctypes.CFUNCTYPE(
    ctypes.c_int,  # CUresult
    ctypes.c_void_p,  # CUdeviceptr *dsts
    ctypes.c_void_p,  # CUdeviceptr *srcs
    ctypes.c_void_p,  # size_t *sizes
    ctypes.c_size_t,  # count
    ctypes.POINTER(CUmemcpyAttributes),  # attrs
    ctypes.POINTER(ctypes.c_size_t),  # attrsIdxs
    ctypes.c_size_t,  # numAttrs
    ctypes.POINTER(ctypes.c_size_t),  # failIdx
    ctypes.c_void_p,  # CUstream
)
_MEMCPY_SIGNATURE = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p
)
_ERROR_NAME_SIGNATURE = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)
)


@dataclass(frozen=True)
class DriverCopy:
    """The resolved driver entry points (``batch`` is ``None`` before CUDA 12.8)."""

    batch: Any
    memcpy_async: Any
    error_name: Any
    source: str

    def describe_error(self, code: int) -> str:
        name = ctypes.c_char_p()
        if (
            self.error_name is not None
            and self.error_name(code, ctypes.byref(name)) == 0
            and name.value
        ):
            return f"{name.value.decode()} ({code})"
        return f"CUresult {code}"


def _proc_address_from_bindings(symbol: bytes, version: int) -> int:
    from cuda.bindings import driver

    flags = driver.CUdriverProcAddress_flags.CU_GET_PROC_ADDRESS_DEFAULT
    error, pointer, status = driver.cuGetProcAddress(symbol, version, flags)
    found = driver.CUdriverProcAddressQueryResult.CU_GET_PROC_ADDRESS_SUCCESS
    if error != driver.CUresult.CUDA_SUCCESS or status != found:
        return 0
    return int(pointer)


def _proc_address_from_libcuda(symbol: bytes, version: int) -> int:
    libcuda = ctypes.CDLL("libcuda.so.1")
    get_proc = libcuda.cuGetProcAddress_v2
    get_proc.restype = ctypes.c_int
    get_proc.argtypes = (
        ctypes.c_char_p,
        ctypes.POINTER(ctypes.c_void_p),
        ctypes.c_int,
        ctypes.c_uint64,
        ctypes.POINTER(ctypes.c_int),
    )
    pointer, status = ctypes.c_void_p(), ctypes.c_int()
    if (
        get_proc(symbol, ctypes.byref(pointer), version, 0, ctypes.byref(status)) != 0
        or status.value != 0
    ):
        return 0
    return int(pointer.value or 0)


_lock = threading.Lock()
_resolved: DriverCopy | None = None
_resolve_error: str | None = None


def resolve_driver() -> tuple[DriverCopy | None, str | None]:
    """The driver entry points, resolved once per process, or ``(None, why not)``."""
    global _resolved, _resolve_error
    with _lock:
        if _resolved is None and _resolve_error is None:
            try:
                _resolved = _resolve()
            except Exception as exc:  # DynamicLibNotFoundError, OSError, a broken install...
                _resolve_error = f"the CUDA driver cannot be reached ({type(exc).__name__}: {exc})"
        return _resolved, _resolve_error


def _resolve() -> DriverCopy:
    try:
        import cuda.bindings.driver  # noqa: F401

        lookup, source = _proc_address_from_bindings, "cuda.bindings"
    except ImportError:
        lookup, source = _proc_address_from_libcuda, "libcuda (ctypes)"
    batch = lookup(b"cuMemcpyBatchAsync", BATCH_ABI_VERSION)
    memcpy = lookup(b"cuMemcpyAsync", 12000)
    error_name = lookup(b"cuGetErrorName", 6000)
    if not memcpy:
        raise RuntimeError("cuGetProcAddress found no cuMemcpyAsync")
    return DriverCopy(
        batch=_BATCH_SIGNATURE(batch) if batch else None,
        memcpy_async=_MEMCPY_SIGNATURE(memcpy),
        error_name=_ERROR_NAME_SIGNATURE(error_name) if error_name else None,
        source=source,
    )


class CudaBatchBackend(CopyBackend):
    """``cuMemcpyBatchAsync`` over the job's descriptors (one ``cuMemcpyAsync`` each as fallback).

    Options: ``prefer_overlap`` sets ``CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE``;
    ``use_batch=False`` forces the per-descriptor fallback (for benchmarks and tests).
    """

    name = "cuda-batch"

    def __init__(
        self,
        layout: CacheLayout,
        direction: Direction,
        *,
        prefer_overlap: bool = False,
        use_batch: bool = True,
        **options: Any,
    ) -> None:
        super().__init__(layout, direction, **options)
        driver, _ = resolve_driver()
        assert driver is not None  # probe() returned None
        self.driver = driver
        self.use_batch = use_batch and driver.batch is not None
        order = (
            CU_MEMCPY_SRC_ACCESS_ORDER_ANY
            if direction is Direction.HOST_TO_DEVICE
            else CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
        )
        self._attributes = CUmemcpyAttributes(
            srcAccessOrder=order,
            flags=CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE if prefer_overlap else 0,
        )
        self._attribute_index = ctypes.c_size_t(0)

    @classmethod
    def probe(cls, device: torch.device) -> str | None:
        if device.type != "cuda":
            return f"it copies to and from CUDA memory, the cache is on {device}"
        if not torch.cuda.is_available():
            return "CUDA is not available"
        _, error = resolve_driver()
        return error

    def execute(self, job: CopyJob) -> None:
        count = len(job.descriptors)
        if count == 0:
            return
        if count > MAX_DESCRIPTORS_PER_JOB:
            raise RuntimeError(
                f"cuda-batch refuses {count} descriptors in one job (at most "
                f"{MAX_DESCRIPTORS_PER_JOB}: larger jobs of small fragments crashed the driver on "
                "the H200 test machine); use backend 'auto' or 'torch' for small pages"
            )
        stream = job.stream if job.stream is not None else torch.cuda.current_stream(self.device)
        handle = stream.cuda_stream
        if handle == 0:
            raise ValueError(
                "cuMemcpyBatchAsync rejects the legacy default stream; use a created stream"
            )
        src, dst, sizes = (
            np.ascontiguousarray(array, dtype=np.int64)
            for array in (job.descriptors.src, job.descriptors.dst, job.descriptors.sizes)
        )
        if self.use_batch:
            failed_at = ctypes.c_size_t(0)
            item = src.itemsize
            for first in range(0, count, MAX_DESCRIPTORS_PER_CALL):
                chunk = min(MAX_DESCRIPTORS_PER_CALL, count - first)
                code = self.driver.batch(
                    dst.ctypes.data + first * item,
                    src.ctypes.data + first * item,
                    sizes.ctypes.data + first * item,
                    chunk,
                    ctypes.byref(self._attributes),
                    ctypes.byref(self._attribute_index),
                    1,
                    ctypes.byref(failed_at),
                    handle,
                )
                if code != 0:
                    raise RuntimeError(
                        f"cuMemcpyBatchAsync failed with {self.driver.describe_error(code)} "
                        f"at descriptor {first + failed_at.value} of {count}"
                    )
            return
        memcpy = self.driver.memcpy_async
        for index, (s, d, n) in enumerate(
            zip(src.tolist(), dst.tolist(), sizes.tolist(), strict=True)
        ):
            code = memcpy(d, s, n, handle)
            if code != 0:
                raise RuntimeError(
                    f"cuMemcpyAsync failed with {self.driver.describe_error(code)} "
                    f"at descriptor {index} of {count}"
                )
