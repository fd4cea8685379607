"""Streaming snapshot writer and reader over local files and fsspec URLs, with atomic publish.

:class:`SnapshotWriter` takes KV pages in caller-owned buffers (a pinned staging slot, usually)
and moves them to the file while the caller fills the next buffer: every
:meth:`~SnapshotWriter.write_pages` call is hashed (xxh3-64 per page, in sub-chunks on the hash
threads; xxhash releases the GIL) and, at the same time, written at its final offset: ``pwrite``
of pieces up to 64 MiB, front to back from one write thread (on the measured disk one
sequential stream beat parallel writers), into blocks reserved when the file was created. The
returned future completes when the buffer may be reused. The bytes in flight are bounded
(``max_inflight_bytes``), so host memory stays flat whatever the snapshot size.

The file layout is fixed before the first byte (:func:`kvsnap.format.file_layouts`), so the
header is written first and never rewritten: the data-dependent checksums live in the last two
tensors. That makes a snapshot a pure front-to-back stream, which is what object stores need.

Local files are written to a temporary name in the target directory, fsynced, renamed over the
target and the directory fsynced: a crash leaves the old file or the new complete one. Layer
data goes through ``O_DIRECT`` where the filesystem accepts it and buffers and offsets are
4096-aligned (``fallback_reason`` says why not, otherwise). fsspec URLs (``memory://``,
``s3://``, ...) are written front to back through one ordered lane; object stores publish
atomically on their own (S3's multipart upload appears only when completed), other
filesystems get a temporary name and a move.

:class:`SnapshotReader` validates the whole header before allocating anything, reads only the
byte ranges of the blocks asked for (coalescing consecutive blocks), and checks every block
against its checksum as it reads; :meth:`SnapshotReader.read_pages_async` queues a read on the
reader's threads, so a caller keeps the disk busy while it consumes the previous buffer.

An optional :data:`TraceHook` receives a span for every hash, write, read and verification and
for the commit's phases; without one the pipeline only pays a ``None`` check per piece.

The package, one module per job:

- :mod:`~kvsnap.store.resolve`: which of the three forms (single file, sharded, parted) a path
  holds, with at most two stats and one read of the index, and the one retry when a
  replacement removed a file; :mod:`~kvsnap.store.head_parts`: :func:`open_snapshot`, any
  form opened in one step as its head-range parts (`HeadPart`, `OpenedSnapshot`);
- :mod:`~kvsnap.store.writer`: :class:`SnapshotWriter` (public API, hashing beside writing),
  holding one target chosen once, :mod:`~kvsnap.store.write_local` or
  :mod:`~kvsnap.store.write_stream`; :mod:`~kvsnap.store.snapshot_files` the files' layouts, the
  digests that complete them and the target interface; :mod:`~kvsnap.store.slot_writes` many
  tensors' pages per call; :mod:`~kvsnap.store.write_order` the order the pages must come in,
  and how far they got;
- :mod:`~kvsnap.store.reader`: :class:`SnapshotReader`, composed of
  :mod:`~kvsnap.store.checksums` (trailers and block-checksum rows),
  :mod:`~kvsnap.store.page_reads` (one tensor's pages), :mod:`~kvsnap.store.slot_reads` (many
  tensors' pages into one staging slot) and :mod:`~kvsnap.store.verify` (the full check);
  :mod:`~kvsnap.store.opening` what it checks as it opens a file;
  :mod:`~kvsnap.store.source` random-access reads of one file;
- :mod:`~kvsnap.store.pools`: the process-wide thread pools;
- :mod:`~kvsnap.store.local_file`, :mod:`~kvsnap.store.stream_file`: one output file, local or
  through fsspec;
- :mod:`~kvsnap.store.publish`: temporary names, atomic publish (:func:`publish_bytes`) and
  the cleanup of dead writers' temporary files;
- :mod:`~kvsnap.store.overwrite`: what a writer may delete when it replaces a snapshot;
- :mod:`~kvsnap.store.location`: local paths and fsspec URLs;
- :mod:`~kvsnap.store.tracing`, :mod:`~kvsnap.store.completion`, :mod:`~kvsnap.store.tuning`:
  the trace hook, split futures, pipeline sizes;
- :mod:`~kvsnap.store.hot`: the hot tier (snapshot files mapped from the page cache and
  registered with CUDA, so that restores copy straight out of it; :func:`configure_hot_tier`,
  :func:`hot_tier`), and :mod:`~kvsnap.store.residency` (whether a range is page-cached);
- :mod:`~kvsnap.store.mapped_file`: a capture's new memory-backed file mapped, populated and
  registered for the device's copies; :mod:`~kvsnap.store.mapping_release` its release after
  the publish, in the background; :mod:`~kvsnap.store.spare_files` the next capture's file per
  directory, made in the background; :mod:`~kvsnap.host_registration` the one
  ``cudaHostRegister``.
"""

from __future__ import annotations

from kvsnap.store.head_parts import HeadPart, OpenedSnapshot, open_snapshot
from kvsnap.store.hot import HotStats, configure_hot_tier, hot_tier
from kvsnap.store.publish import publish_bytes
from kvsnap.store.reader import SnapshotReader
from kvsnap.store.tracing import TraceHook, traced
from kvsnap.store.tuning import DEFAULT_MAX_INFLIGHT_BYTES
from kvsnap.store.writer import SnapshotInfo, SnapshotWriter

__all__ = [
    "DEFAULT_MAX_INFLIGHT_BYTES",
    "HeadPart",
    "HotStats",
    "OpenedSnapshot",
    "SnapshotInfo",
    "SnapshotReader",
    "SnapshotWriter",
    "TraceHook",
    "configure_hot_tier",
    "hot_tier",
    "open_snapshot",
    "publish_bytes",
    "traced",
]
