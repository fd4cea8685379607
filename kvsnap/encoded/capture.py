"""An encoded capture (``kvsnap.capture(..., compression=)``, ``kvsnap capture --compress``,
the vLLM connector's ``compression``): the encoded file written straight from the caches, the
ordinary file it stands for never written.

Per layer tensor, the sequences' blocks are gathered out of the caches where they lie
(:class:`~kvsnap.encoded.cache_pages.CachePages`: on a CUDA device into a device buffer, in
host memory by the host) and hashed there as the ordinary file would hold them (the xxh3-64 of
every page: :mod:`kvsnap.encoded.page_digests`). Then the tensor is encoded where
:func:`~kvsnap.encoded.stored.encoding_device` says, as ``recode_file`` encodes it: fp8 is
quantized with the blocks' token counts (a layer's key and value as one), its stored pages
hashed on the device (xxh3-64, and BLAKE3-256 when the file is signed), and each layer's error
measured there once its key and value are done (read once, at the end); only the e4m3 values
and scales (or, for ``lossless`` and raw tensors, the pages) come to the host. The ordinary
file's header, metadata tensors, block checksums and trailer are computed from the metadata
and those digests by the writer's own
:class:`~kvsnap.store.write.snapshot_files.SnapshotFiles`, so the encoded file is byte for byte
what ``recode_file`` writes from an ordinary (unsigned) capture of the same KV. An fp8 file is
written while it is encoded (:mod:`kvsnap.encoded.streamed`: its layout known before a page is
quantized, each layer's values written at their place while the device encodes the next), a
lossless one once every chunk is coded; either through a temporary file and a rename.

Where the fused page copy cannot gather the caches (a named transfer backend, layouts on
several devices, TP ranks whose heads do not tile the page), the capture writes the ordinary
file to a temporary file and encodes that (:func:`~kvsnap.encoded.write.capture_encoded`).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import xxhash

from kvsnap import format as fmt
from kvsnap.encoded.cache_pages import CachePages
from kvsnap.encoded.original import tokens_per_block
from kvsnap.encoded.page_digests import to_host, xxh3_pages
from kvsnap.encoded.stored import (
    FP8_SOURCES,
    Item,
    StoredTensors,
    add_fp8_together,
    add_lossless,
    add_raw,
    encoding_device,
    host_items,
)
from kvsnap.encoded.streamed import StreamedFile, planned_fp8_layout
from kvsnap.encoded.write import (
    capture_encoded,
    check_compression,
    container_pieces,
    publish,
    stored_file,
    stored_pieces,
)
from kvsnap.encoding import fp8, measure
from kvsnap.encoding.report import AttentionError, ErrorReport
from kvsnap.format import encoded as enc
from kvsnap.format.container import TensorEntry, is_layer_tensor
from kvsnap.format.signing import KeyRing
from kvsnap.layout import CacheLayout
from kvsnap.pipeline import CaptureResult, Pipeline, ProgressCallback, SequenceBlocks
from kvsnap.pipeline.capture import capture_metadata
from kvsnap.pipeline.jobs import validate_sequences
from kvsnap.pipeline.options import ProgressCounter, StagingOptions, TransferOptions
from kvsnap.pipeline.shared_tables import shared_page_table
from kvsnap.store import TraceHook, traced
from kvsnap.store.files.location import locate
from kvsnap.store.write.snapshot_files import SnapshotFiles
from kvsnap.transfer.page_table import PageTable
from kvsnap.transfer.plan import Direction

#: What an encoded capture's result says of O_DIRECT and of placing pages in the file.
THROUGH_PAGE_CACHE = "an encoded snapshot is written through the page cache"
ENCODED_FIRST = "an encoded snapshot's pages are encoded before they are written"


def capture_compressed(
    caches: Pipeline | CacheLayout | Sequence[CacheLayout],
    sequences: Sequence[SequenceBlocks],
    path: str | os.PathLike[str],
    compression: str,
    *,
    transfer: TransferOptions | None = None,
    source: fmt.SourceInfo | None = None,
    reproducible: bool = False,
    keys: KeyRing | None = None,
    staging: StagingOptions | None = None,
    direct_io: bool | None = None,
    progress: ProgressCallback | None = None,
    trace: TraceHook | None = None,
    after: torch.cuda.Event | None = None,
    refused: bool = False,
) -> CaptureResult:
    """Capture ``sequences`` from ``caches`` (a warm :class:`~kvsnap.pipeline.Pipeline`, or
    the layouts to make one of, with ``transfer``) into the encoded snapshot ``path``
    (``compression``: ``"lossless"`` or ``"fp8"``), signed with ``keys``' first key when
    given (the ordinary file it stands for is not: the encoded file's signature covers that
    file's header and metadata tensors, and binds each fp8 page by its digest). ``staging``
    and ``direct_io`` apply only where the ordinary file is written first. ``refused``:
    shards or parts were asked for. The arguments and errors are otherwise
    ``kvsnap.capture``'s (and ``after`` :meth:`Pipeline.capture`'s); progress counts the
    ordinary file's pages as they are encoded."""
    started = time.perf_counter()
    check_compression(compression, path, refused)
    pipeline = caches if isinstance(caches, Pipeline) else Pipeline(caches, transfer=transfer)
    table = _gather_table(pipeline)
    if table is None:
        return capture_encoded(
            lambda written: pipeline.capture(
                sequences,
                written,
                source=source,
                staging=staging,
                reproducible=reproducible,
                direct_io=direct_io,
                progress=progress,
                trace=trace,
                after=after,
                keys=None,
            ),
            path,
            compression,
            keys=keys,
            refused=refused,
        )
    metadata, device_blocks = _checked_metadata(pipeline.layouts, sequences, source, reproducible)
    files = decoded_files(path, metadata)
    job = _Job(compression, files, keys, progress, trace)
    write = _write_fp8 if compression == "fp8" else _write_lossless
    written = write(job, Path(path), table, device_blocks, pipeline, after)
    return CaptureResult(
        path=os.fspath(path),
        num_sequences=len(sequences),
        num_tokens=sum(len(sequence.token_ids) for sequence in sequences),
        num_blocks=len(device_blocks),
        num_bytes=written,
        seconds=time.perf_counter() - started,
        backend="fused",
        direct_io_fallback=THROUGH_PAGE_CACHE,
        trailer_digest=xxhash.xxh3_128_hexdigest(files.trailer(0)),
        data_path="write",
        dma_refused=ENCODED_FIRST,
    )


def _write_fp8(
    job: _Job,
    path: Path,
    table: PageTable,
    device_blocks: np.ndarray,
    pipeline: Pipeline,
    after: torch.cuda.Event | None,
) -> int:
    """Encode every layer tensor as fp8 into ``path``, each value tensor written at its place
    as it is made (:class:`~kvsnap.encoded.streamed.StreamedFile`), the rest once the error
    is measured; the file's size."""
    _, planned = planned_fp8_layout(job.files.layouts[0], job.keys)
    decoded_bytes = job.files.layouts[0].file_size
    with StreamedFile(path, planned.file_size) as streamed:
        job.streamed, job.planned = streamed, planned
        stored, report = _encoded_layers(job, table, device_blocks, pipeline, after)
        with traced(job.trace, "encoded.write", planned.file_size):
            stored.items = host_items(stored.items)
            header, layout, data = stored_file(stored, "fp8", decoded_bytes, job.keys, report)
            if layout.tensors != planned.tensors:
                raise RuntimeError(f"{path}: the fp8 file's layout changed while it was written")
            known = {**stored.digests, **streamed.digests}
            pieces = container_pieces(header, layout, data, job.keys, known)
            return streamed.finish(
                [(0, header)]
                + [
                    (tensor.begin, piece)
                    for tensor, piece in pieces
                    if piece is not None and tensor.name not in streamed.digests
                ]
            )


def _write_lossless(
    job: _Job,
    path: Path,
    table: PageTable,
    device_blocks: np.ndarray,
    pipeline: Pipeline,
    after: torch.cuda.Event | None,
) -> int:
    """Encode every layer tensor as lossless chunks (or raw) and write the file once they
    all are (their sizes are known only then); the file's size."""
    stored, report = _encoded_layers(job, table, device_blocks, pipeline, after)
    decoded_bytes = job.files.layouts[0].file_size
    pieces = stored_pieces(stored, job.compression, decoded_bytes, job.keys, report)
    with traced(job.trace, "encoded.write", sum(_nbytes(piece) for piece in pieces)):
        return publish(pieces, path)


def _gather_table(pipeline: Pipeline) -> PageTable | None:
    """The page table the fused page copy gathers ``pipeline``'s caches with, or ``None``
    where it does not (a named backend, or caches it cannot serve)."""
    if pipeline.transfer.backend != "auto":
        return None
    return shared_page_table(pipeline.layouts, Direction.DEVICE_TO_HOST)


def _checked_metadata(
    layouts: Sequence[CacheLayout],
    sequences: Sequence[SequenceBlocks],
    source: fmt.SourceInfo | None,
    reproducible: bool,
) -> tuple[fmt.SnapshotMetadata, np.ndarray]:
    """The ordinary file's metadata and the device block of each snapshot block, as a plain
    capture makes them; ``ValueError`` for sequences that break the rules (a block id
    outside the caches among them: the gather reads where it points)."""
    capacity = min(layout.num_blocks for layout in layouts)
    validate_sequences(layouts[0].geometry.block_size, sequences, capacity)
    return capture_metadata(layouts, sequences, source or fmt.SourceInfo(), reproducible)


def decoded_files(path: str | os.PathLike[str], metadata: fmt.SnapshotMetadata) -> SnapshotFiles:
    """The ordinary (unsigned) file of ``metadata`` a plain capture to ``path`` would write,
    as its writer plans it: its layout, and once its pages' xxh3-64 are in, its block
    checksums and trailer."""
    problems = metadata.problems()
    if problems:
        raise ValueError("cannot write this snapshot metadata: " + "; ".join(problems[:5]))
    return SnapshotFiles(locate(os.fspath(path), None), metadata, None, None)


@dataclass
class _Job:
    """What every tensor of one direct capture shares: the encoding, the ordinary file, the
    keys the encoded one is signed with, the caller's hooks; then, once on the device, the
    blocks' token counts there, the pool lossless chunks are coded on and the progress
    counter; for fp8, the file the values are written to as they are made, its layout, and
    the fp8 tensors of the layer being gathered."""

    compression: str
    files: SnapshotFiles
    keys: KeyRing | None
    progress: ProgressCallback | None
    trace: TraceHook | None
    counts: torch.Tensor | None = None
    executor: Executor | None = None
    done: ProgressCounter | None = None
    streamed: StreamedFile | None = None
    planned: enc.EncodedLayout | None = None
    layer: list[tuple[TensorEntry, torch.Tensor]] = field(default_factory=list)


_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


@contextlib.contextmanager
def _device_work(device: torch.device, after: torch.cuda.Event | None) -> Iterator[None]:
    """Run the body's device work on a stream of this module's on ``device`` (CUDA), after
    ``after`` when given (KV computed on another thread's stream), else after what the
    caller's stream holds; everything it queued is complete when the body is left."""
    if device.type != "cuda":
        yield
        return
    stream = _STREAMS.get(device)
    if stream is None:
        stream = _STREAMS[device] = torch.cuda.Stream(device)
    if after is not None:
        stream.wait_event(after)
    else:
        stream.wait_stream(torch.cuda.current_stream(device))
    try:
        with torch.cuda.device(device), torch.cuda.stream(stream):
            yield
    finally:
        stream.synchronize()


def _encoded_layers(
    job: _Job,
    table: PageTable,
    device_blocks: np.ndarray,
    pipeline: Pipeline,
    after: torch.cuda.Event | None,
) -> tuple[StoredTensors, ErrorReport | None]:
    """Gather, hash and encode every layer tensor; the encoded file's tensors in file order
    (the ordinary file's completed from the digests) and the fp8 error report."""
    metadata = job.files.metadata
    held = [(record.num_tokens, record.block_ids) for record in metadata.sequences]
    counts = tokens_per_block(metadata.geometry.block_size, metadata.num_blocks, held)
    work = table.device if table.device.type == "cuda" else encoding_device()
    with _device_work(work, after), ThreadPoolExecutor(2) as executor:
        with traced(job.trace, "encoded.setup"):
            pages = CachePages(table, device_blocks, pipeline.transfer.sm_budget)
        job.counts, job.executor = torch.from_numpy(counts).to(work), executor
        total = pages.page_bytes * pages.num_blocks * len(job.files.names)
        job.done = ProgressCounter(job.progress, total)
        layers, pending = _encode_tensors(job, pages, work)
    return _in_file_order(job.files, layers), _merged([report.result() for report in pending])


def _encode_tensors(
    job: _Job, pages: CachePages, work: torch.device
) -> tuple[StoredTensors, list[measure.PendingReport]]:
    """Each layer tensor gathered, its pages hashed (into ``job.files``) and encoded; an fp8
    layer's error measured once all its parts are, its pages then let go. Progress counts a
    tensor once its pages are out of the cache (a caller may then reuse its blocks): as soon
    as the host copied them, or on CUDA once the device has gathered them (looked at between
    tensors, never waited for until the last)."""
    files = job.files
    parts = len(files.metadata.geometry.parts)
    by_name = files.layouts[0].by_name
    out, reports, digests = StoredTensors(), [], []
    nbytes = pages.page_bytes * pages.num_blocks
    gathering: deque[torch.cuda.Event] = deque()
    assert job.done is not None
    for index, name in enumerate(files.names):
        with traced(job.trace, "encoded.tensor", nbytes):
            buffer = pages.gather(index)
            if pages.device.type == "cuda":
                gathering.append(torch.cuda.Event())
                gathering[-1].record()
            else:
                job.done.add(nbytes)
            digests.append(xxh3_pages(buffer, pages.page_bytes))
            _encode_tensor(job, by_name[name], buffer, work, out)
            if (index + 1) % parts == 0:
                _encode_layer(job, out)
                if out.originals:
                    reports.append(_measured(out, job.counts))
            while gathering and gathering[0].query():
                gathering.popleft()
                job.done.add(nbytes)
    for gathered in gathering:
        gathered.synchronize()
        job.done.add(nbytes)
    with traced(job.trace, "encoded.digests"):
        files.digests[:] = to_host(digests, "xxh3").reshape(files.digests.shape)
    return out, reports


def _encode_tensor(
    job: _Job, entry: TensorEntry, buffer: torch.Tensor, work: torch.device, out: StoredTensors
) -> None:
    """Encode the layer tensor ``entry`` whose pages are ``buffer`` (bytes, on the caches'
    device) into ``out``, as ``recode_file`` encodes it: fp8 once its layer is complete
    (:func:`_encode_layer`), anything else now."""
    if job.compression == "fp8" and entry.dtype in FP8_SOURCES:
        job.layer.append((entry, buffer.view(FP8_SOURCES[entry.dtype]).view(entry.shape).to(work)))
        return
    # The buffer is the next layer's: the host keeps a copy of its own.
    host = buffer.cpu().numpy() if buffer.device.type == "cuda" else buffer.numpy().copy()
    if job.compression == "lossless":
        add_lossless(out, entry, host.reshape(entry.shape[0], -1), job.executor)
    else:
        add_raw(out, entry, host)


def _encode_layer(job: _Job, out: StoredTensors) -> None:
    """Quantize the fp8 tensors of the layer just gathered, those of one shape and dtype as
    one (a layer's key and value: half the kernels), and write each one's values while the
    device encodes the next layer."""
    if not job.layer:
        return
    groups: dict[tuple[tuple[int, ...], torch.dtype], list[tuple[TensorEntry, torch.Tensor]]]
    groups = {}
    for entry, pages in job.layer:
        groups.setdefault((tuple(pages.shape), pages.dtype), []).append((entry, pages))
    job.layer.clear()
    assert job.counts is not None and job.streamed is not None and job.planned is not None
    for group in groups.values():
        entries = [entry for entry, _ in group]
        first = len(out.items)
        add_fp8_together(
            out,
            entries,
            [pages for _, pages in group],
            job.counts,
            checks_on_device=True,
            signed=job.keys is not None,
            to_host=False,
        )
        # add_fp8_together appended each tensor's values, then its scales.
        for position in range(first, len(out.items), 2):
            name, dtype, shape, values = out.items[position]
            job.streamed.stream(name, values, job.planned.by_name[name].begin)
            # On CUDA the page checks were made there and the host needs no values; in host
            # memory they are kept for the host's checks.
            held = values.numpy() if values.device.type == "cpu" else None
            out.items[position] = (name, dtype, shape, held)


def _measured(out: StoredTensors, counts: torch.Tensor | None) -> measure.PendingReport:
    """The error report of the fp8 tensors ``out`` holds the pages of (one layer's), its
    numbers left on the device; the pages are then let go: the next layer's pages are
    gathered into the same buffers (after this layer's measurement, on the same stream)."""
    report = measure.pending_report(
        out.originals,
        out.decoded,
        encoding=fp8.NAME,
        granularity="block-head",
        token_counts=counts,
    )
    out.originals.clear()
    out.decoded.clear()
    return report


def _merged(reports: list[ErrorReport]) -> ErrorReport | None:
    """One report of the layers' reports (in layer order): what one ``error_report`` of every
    layer at once gives (its tensors in name order, its attention checks by layer)."""
    if not reports:
        return None
    first = reports[0]
    tensors = tuple(item for report in reports for item in report.tensors)
    attention = sorted((item for report in reports for item in report.attention), key=_layer)
    return ErrorReport(
        first.encoding, first.granularity, first.query_source, tensors, tuple(attention)
    )


def _layer(item: AttentionError) -> int:
    return item.layer


def _in_file_order(files: SnapshotFiles, layers: StoredTensors) -> StoredTensors:
    """The encoded file's tensors: the ordinary file's header, then its tensors in its order,
    each layer tensor as ``layers`` stores it and every other as the ordinary file holds it
    (its block checksums and trailer made here, once every page's xxh3-64 is in)."""
    layout = files.layouts[0]
    of_layer: dict[str, list[Item]] = {}
    for item in layers.items:
        base = item[0].removesuffix(enc.SCALES_SUFFIX).removesuffix(enc.CHUNKS_SUFFIX)
        of_layer.setdefault(base, []).append(item)
    header = np.frombuffer(layout.header, dtype=np.uint8)
    items: list[Item] = [(enc.ORIGINAL_HEADER_TENSOR, "U8", (len(header),), header)]
    for entry in layout.entries:
        if enc.is_padding(entry.name):
            continue
        if is_layer_tensor(entry.name):
            items += of_layer[entry.name]
            continue
        data = files.tensor_bytes(0, entry)
        array = np.frombuffer(data, dtype=np.uint8) if isinstance(data, bytes) else data
        items.append((entry.name, entry.dtype, entry.shape, array))
    # The kinds in file order too (fp8 tensors are encoded a layer at a time): the metadata
    # is then recode_file's, byte for byte.
    kinds = {
        entry.name: layers.kinds[entry.name]
        for entry in layout.entries
        if entry.name in layers.kinds
    }
    return StoredTensors(items, kinds, page_checks=layers.page_checks, digests=layers.digests)


def _nbytes(piece: bytes | np.ndarray) -> int:
    return len(piece) if isinstance(piece, bytes) else piece.nbytes
