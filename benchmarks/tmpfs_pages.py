"""What bringing a new memory-backed file's pages into being costs, way by way (any machine).

A capture by DMA into a tmpfs file (docs/architecture.md, "Captures into memory-backed files by
DMA") spends most of its time on the file's pages, not on the data: each page allocated,
zeroed, mapped, pinned, and at the end unpinned and unmapped. ``python -m
benchmarks.tmpfs_pages --dir /dev/shm --sizes 64,256,1024`` times, per file size in MiB, each
on a new file, medians of ``--repeat`` rounds in ms:

* ``populate_1`` / ``populate_N``: ``MADV_POPULATE_WRITE`` over a fresh mapping (what
  :meth:`kvsnap.store.hot.mapped_file.MappedFile.populate` does) on one thread and on
  ``tuning.POPULATE_THREADS``;
* ``fallocate``: ``fallocate(fd, 0, 0, size)`` (tmpfs allocates and zeroes the pages without
  mapping them), and ``populate_after_fallocate``: the populate that follows on the same file
  (what is left: mapping the pages);
* ``pin_*``: pinning the mapping after each of those (``cudaHostRegister`` where CUDA is, and
  ``mlock`` everywhere, which faults and locks pages the same page-by-page way
  ``pin_user_pages`` does): ``pin_after_nothing`` shows a registration that faults each page in
  itself, ``pin_after_fallocate`` whether fallocate alone spares it that;
* ``truncate_half``: ``ftruncate`` of a populated, mapped file to half its size (what taking a
  spare file larger than the capture costs), and ``teardown``: unpin, unmap, unlink.

Prints one JSON line per size; ``--json-out`` writes them all.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from kvsnap.host_registration import (
    MAPPED,
    PORTABLE,
    cuda_unavailable_reason,
    register_host_range,
    unregister_host_range,
)
from kvsnap.store.base import tuning
from kvsnap.store.base.pools import cpu_count, shared_executor
from kvsnap.store.hot.mapped_file import MappedFile
from kvsnap.store.write.local_file import preallocate

_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_LIBC.munlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


class _Pin:
    """Pin and unpin a mapping: ``cudaHostRegister`` with CUDA, else ``mlock``."""

    def __init__(self, cuda: bool) -> None:
        self.kind = "cudaHostRegister" if cuda else "mlock"

    def pin(self, mapped: MappedFile) -> None:
        if self.kind == "mlock":
            if _LIBC.mlock(mapped.address, mapped.size) != 0:
                raise OSError(ctypes.get_errno(), "mlock failed")
        elif register_host_range(mapped.address, mapped.size, PORTABLE | MAPPED) != 0:
            raise OSError("cudaHostRegister failed")

    def unpin(self, mapped: MappedFile) -> None:
        if self.kind == "mlock":
            _LIBC.munlock(mapped.address, mapped.size)
        else:
            unregister_host_range(mapped.address)


def _ms(run: Callable[[], object]) -> float:
    started = time.perf_counter()
    run()
    return (time.perf_counter() - started) * 1e3


def one_round(path: Path, size: int, pin: _Pin, threads: int) -> dict[str, float]:
    """Every way once, each on a new file at ``path``; ms per step."""
    executor = shared_executor("populate", threads) if threads > 1 else None
    times: dict[str, float] = {}

    def fresh(prepare: Callable[[int], None] | None = None) -> tuple[int, MappedFile]:
        path.unlink(missing_ok=True)
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
        if prepare is not None:
            prepare(fd)
        return fd, MappedFile(fd, size)

    def finish(fd: int, mapped: MappedFile, pinned: bool, name: str | None = None) -> None:
        def teardown() -> None:
            if pinned:
                pin.unpin(mapped)
            mapped.close()
            os.close(fd)
            path.unlink()

        elapsed = _ms(teardown)
        if name is not None:
            times[name] = elapsed

    fd, mapped = fresh()
    times["populate_1"] = _ms(lambda: mapped.populate(None, 1))
    finish(fd, mapped, False)
    fd, mapped = fresh()
    times[f"populate_{threads}"] = _ms(lambda: mapped.populate(executor, threads))
    times["pin_after_populate"] = _ms(lambda: pin.pin(mapped))
    finish(fd, mapped, True, "teardown")
    fd, mapped = fresh(
        lambda fd: times.__setitem__("fallocate", _ms(lambda: preallocate(fd, size)))
    )
    times["populate_after_fallocate"] = _ms(lambda: mapped.populate(executor, threads))
    finish(fd, mapped, False)
    fd, mapped = fresh(lambda fd: preallocate(fd, size))
    times["pin_after_fallocate"] = _ms(lambda: pin.pin(mapped))
    finish(fd, mapped, True)
    fd, mapped = fresh()
    times["pin_after_nothing"] = _ms(lambda: pin.pin(mapped))
    finish(fd, mapped, True)
    fd, mapped = fresh()
    mapped.populate(executor, threads)
    times["truncate_half"] = _ms(lambda: os.ftruncate(fd, size // 2))
    finish(fd, mapped, False)
    return times


def measure(directory: Path, size_mib: int, repeat: int, pin: _Pin, threads: int) -> dict:
    """Medians of ``repeat`` rounds (after one warm-up) for files of ``size_mib`` MiB."""
    size = size_mib << 20
    path = directory / f"kvsnap-tmpfs-pages-{os.getpid()}"
    rounds = [one_round(path, size, pin, threads) for _ in range(repeat + 1)][1:]
    row: dict[str, object] = {"mib": size_mib, "pin": pin.kind, "threads": threads}
    for name in rounds[0]:
        row[f"{name}_ms"] = round(statistics.median(r[name] for r in rounds), 2)
    populate = float(row[f"populate_{threads}_ms"])  # type: ignore[arg-type]
    row["populate_gb_per_s"] = round(size / populate / 1e6, 2)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=Path("/dev/shm"))
    parser.add_argument("--sizes", default="64,256,1024", help="file sizes in MiB")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--json-out", type=Path, default=None)
    args = parser.parse_args()
    pin = _Pin(cuda=cuda_unavailable_reason() is None)
    threads = min(tuning.POPULATE_THREADS, cpu_count())
    rows = []
    for size in [int(size) for size in args.sizes.split(",") if size]:
        rows.append(measure(args.dir, size, args.repeat, pin, threads))
        print(json.dumps(rows[-1]), flush=True)
    if args.json_out is not None:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
