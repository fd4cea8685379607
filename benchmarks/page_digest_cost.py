"""What checking pages on the device costs: xxh3-64 against BLAKE3-256, beside the copy up.

A signed restore checks every page's BLAKE3 where it lands (issue 37); an unsigned one its
xxh3-64. On pages already in device memory this times, for each page count:

* ``xxh3_check``: ``page_hash.launch_page_checks_at_words`` (digest and compare, one launch);
* ``blake3_check_<shape>``: ``page_blake3.launch_page_blake3_checks_at_words`` in each kernel
  shape (:data:`SHAPES`, or ``--shapes``; ``default`` is ``page_blake3.default_shape``);
* ``h2d``: one host-to-device copy of the same bytes from pinned memory, the restore's floor;

and per shape ``blake3_check_<shape>_piece<pages>`` (one launch over ``--piece-bytes``, 32 MiB
by default: a restore checks each piece of a slot, half of a 64 MiB slot, as it arrives, so
the last piece's check is what a restore waits for). Before any timing, every shape's check
runs over all the pages against the ``blake3`` package's digests, with the stored digests of
a few pages altered, and must flag exactly those; the digest launch of the default shape must
give the package's digests too.

Usage::

    python -m benchmarks.page_digest_cost [--page-bytes 32768] [--counts 8192,32768]
        [--shapes default,p8w4words,...] [--piece-bytes N] [--repeat 10] [--json-out FILE]

Prints one line per figure (median of ``--repeat`` runs, CUDA events, milliseconds, and the
rate in GB/s); ``--json-out`` writes them, with the device and the shapes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from kvsnap.transfer import page_blake3, page_hash
from kvsnap.transfer.page_blake3 import KernelShape

#: Shapes timed by default, by name: ``p<pages per program>w<warps>`` with row or word loads
#: (lanes: one per chunk, up to 32); ``l16...``: tiles of 16 chunks. ``default`` is p8w4rows:
#: 2 lanes a thread; p1w1, p4w4: 1; p2w1, p4w2: 2; p4w1, p8w2, p16w4: 4. Each shape is a
#: compile of a few seconds.
SHAPES = [
    "default",
    "p8w4words",
    "p1w1rows",
    "p2w1rows",
    "p4w1rows",
    "p4w2rows",
    "p4w4rows",
    "p8w2rows",
    "p16w4rows",
    "l16p16w4rows",
]


def parse_shape(name: str, page_bytes: int) -> KernelShape:
    """A shape from its name (``[l<lanes>]p<pages>w<warps>rows|words``, or ``default``)."""
    default = page_blake3.default_shape(page_bytes)
    if name == "default":
        return default
    lanes = default.chunk_lanes
    rest = name
    if rest.startswith("l"):
        lanes_text, rest = rest[1:].split("p", 1)
        lanes, rest = int(lanes_text), "p" + rest
    pages_text, rest = rest[1:].split("w", 1)
    loads = "rows" if rest.endswith("rows") else "words"
    warps = int(rest[: -len(loads)])
    return KernelShape(lanes, int(pages_text), warps, loads == "rows")


def cuda_ms(call: Callable[[], object], repeat: int) -> float:
    """Median milliseconds of ``call`` on the current stream, by CUDA events (one warm-up)."""
    call()
    times = []
    for _ in range(repeat):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def host_digests(pinned: torch.Tensor, page_bytes: int, count: int) -> torch.Tensor:
    """The ``blake3`` package's digests of the first ``count`` pages (int32, ``(count, 8)``)."""
    import blake3

    data = pinned.numpy()
    digests = np.empty((count, 8), dtype=np.int32)
    view = digests.view(np.uint8).reshape(count, 32)
    for page in range(count):
        chunk = data[page * page_bytes : (page + 1) * page_bytes]
        view[page] = np.frombuffer(blake3.blake3(chunk.data).digest(), dtype=np.uint8)
    return torch.from_numpy(digests)


def validate(
    shape: KernelShape,
    buffer: torch.Tensor,
    words: torch.Tensor,
    page_bytes: int,
    stored: torch.Tensor,
) -> str | None:
    """Why ``shape``'s check is wrong on these pages, or ``None``: every page against the
    package's digest, with a few stored digests altered (those, and only those, refused)."""
    altered = stored.clone()
    refused = torch.randperm(len(words), generator=torch.Generator().manual_seed(1))[:16]
    altered[refused, torch.arange(16) % 8] ^= 1
    page_ok = torch.full((len(words),), 7, dtype=torch.int64, device=buffer.device)
    page_blake3.launch_page_blake3_checks_at_words(
        buffer, words, page_bytes, altered.to(buffer.device), page_ok, shape
    )
    want = torch.ones(len(words), dtype=torch.int64)
    want[refused] = 0
    flags = page_ok.cpu()
    if not torch.equal(flags, want):
        wrong = (flags != want).nonzero().flatten()[:5].tolist()
        return f"{int((flags != want).sum())} pages flagged wrongly (first: {wrong})"
    return None


def check_digest_launch(
    buffer: torch.Tensor, words: torch.Tensor, page_bytes: int, stored: torch.Tensor
) -> None:
    digests = torch.empty((len(words), 8), dtype=torch.int32, device=buffer.device)
    page_blake3.launch_page_blake3_at_words(buffer, words, page_bytes, digests)
    if not torch.equal(digests.cpu(), stored):
        raise SystemExit("the default shape's digests differ from the blake3 package's")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--page-bytes", type=int, default=32 << 10)
    parser.add_argument("--counts", default="8192,32768", help="page counts, comma-separated")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="kernel shapes to time")
    parser.add_argument(
        "--piece-bytes", type=int, default=32 << 20, help="bytes of a restore's piece"
    )
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("page_digest_cost needs CUDA")
    page_bytes = args.page_bytes
    if not page_blake3.supports(page_bytes) or not page_hash.supports(page_bytes):
        raise SystemExit(f"pages of {page_bytes} bytes are not hashed on the device")
    counts = [int(count) for count in args.counts.split(",")]
    shapes = {name: parse_shape(name, page_bytes) for name in args.shapes.split(",")}
    total = max(counts)
    started = time.perf_counter()
    buffer = torch.randint(0, 256, (total * page_bytes,), dtype=torch.uint8, device="cuda")
    pinned = torch.empty(total * page_bytes, dtype=torch.uint8, pin_memory=True)
    pinned.copy_(buffer)
    stored = host_digests(pinned, page_bytes, total)
    words = torch.arange(total, dtype=torch.int64, device="cuda") * (page_bytes // 8)
    elapsed = time.perf_counter() - started
    print(f"{total} pages of {page_bytes} bytes made and hashed on the host: {elapsed:.1f} s")
    check_digest_launch(buffer, words, page_bytes, stored)
    failures = {}
    for name, shape in shapes.items():
        started = time.perf_counter()
        failure = validate(shape, buffer, words, page_bytes, stored)
        verdict = f"MISMATCH: {failure}" if failure else "exact"
        elapsed = time.perf_counter() - started
        print(f"{name} {shape}: {verdict} (compiled and checked: {elapsed:.1f} s)", flush=True)
        if failure:
            failures[name] = failure
    timed_shapes = {name: shape for name, shape in shapes.items() if name not in failures}
    figures = time_checks(args, buffer, pinned, words, stored.cuda(), counts, timed_shapes)
    if args.json_out:
        out = {
            "device": torch.cuda.get_device_name(),
            "page_bytes": page_bytes,
            "shapes": {name: str(shape) for name, shape in shapes.items()},
            "mismatches": failures,
            "figures": figures,
        }
        with open(args.json_out, "w") as file:
            json.dump(out, file, indent=2)
    if failures:
        raise SystemExit(f"shapes with wrong digests: {sorted(failures)}")


def time_checks(
    args: argparse.Namespace,
    buffer: torch.Tensor,
    pinned: torch.Tensor,
    words: torch.Tensor,
    stored: torch.Tensor,
    counts: list[int],
    shapes: dict[str, KernelShape],
) -> dict[str, float]:
    """The timings, per page count: the copy up, xxh3's check, BLAKE3's check per shape; then
    one piece's BLAKE3 check per shape."""
    page_bytes, repeat = args.page_bytes, args.repeat
    constants = torch.from_numpy(page_hash.constant_table(page_bytes)).cuda()
    xxh3 = torch.empty(len(words), dtype=torch.int64, device="cuda")
    page_hash.launch_page_digests_at_words(buffer, words, page_bytes, constants, xxh3)
    page_ok = torch.empty(len(words), dtype=torch.int64, device="cuda")
    figures: dict[str, float] = {}

    def timed(name: str, call: Callable[[], object], count: int) -> None:
        ms = cuda_ms(call, repeat)
        figures[f"{name}_ms"] = ms
        print(f"{name}: {ms:.3f} ms ({count * page_bytes / ms / 1e6:.0f} GB/s)", flush=True)

    def upload(count: int) -> Callable[[], object]:
        size = count * page_bytes
        return lambda: buffer[:size].copy_(pinned[:size], non_blocking=True)

    def xxh3_check(count: int) -> Callable[[], object]:
        return lambda: page_hash.launch_page_checks_at_words(
            buffer, words[:count], page_bytes, constants, xxh3[:count], page_ok[:count]
        )

    def blake3_check(shape: KernelShape, count: int) -> Callable[[], object]:
        return lambda: page_blake3.launch_page_blake3_checks_at_words(
            buffer, words[:count], page_bytes, stored[:count], page_ok[:count], shape
        )

    for count in counts:
        timed(f"h2d_{count}", upload(count), count)
        timed(f"xxh3_check_{count}", xxh3_check(count), count)
        for name, shape in shapes.items():
            timed(f"blake3_check_{name}_{count}", blake3_check(shape, count), count)
    piece = max(1, min(args.piece_bytes // page_bytes, len(words)))
    for name, shape in shapes.items():
        timed(f"blake3_check_{name}_piece{piece}", blake3_check(shape, piece), piece)
    if not bool((page_ok == 1).all()):
        raise SystemExit("a timed check refused a page")
    return figures


if __name__ == "__main__":
    main()
