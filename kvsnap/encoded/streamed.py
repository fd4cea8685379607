"""An encoded file written while it is being encoded: each fp8 value tensor written at its place
as soon as it is quantized, the header and the small tensors once the error is measured.

A capture straight from the caches (:mod:`kvsnap.encoded.capture`) knows where every tensor of
its fp8 file goes before it has quantized a page: the tensors' sizes follow from the decoded
file's, and the header keeps room for the error report at its widest
(:func:`kvsnap.format.encoded.build_layout`). So the values need not wait for the report: a
:class:`StreamedFile` writes them from a thread beside the device's work. On CUDA they come
through a few pinned host slots (:data:`SLOTS` of :data:`SLOT_BYTES`), each copied on the
capture's stream and written and hashed (xxh3-128, the trailer's row) by the writer thread once
its copy is done; a slot is taken again when the writer has let it go, so the device runs at
most that many slots ahead of the disk. Values in host memory are written from where they lie.

Everything goes to a temporary file beside the target, published by :meth:`StreamedFile.finish`
with an fsync and a rename; the previous file at the target is untouched on any error.
"""

from __future__ import annotations

import os
import queue
import tempfile
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import TracebackType

import numpy as np
import torch
import xxhash

from kvsnap.encoded.stored import FP8_SOURCES
from kvsnap.encoded.write import container_specs, encoded_document
from kvsnap.encoding import fp8
from kvsnap.encoding.report import AttentionError, ErrorReport, TensorError
from kvsnap.errors import SnapshotIOError
from kvsnap.format import encoded as enc
from kvsnap.format.constants import PAGE_DIGEST_BYTES
from kvsnap.format.container import FileLayout, is_layer_tensor
from kvsnap.format.signing import KeyRing

#: Pinned host slots a CUDA tensor is written through, and their size.
SLOTS = 4
SLOT_BYTES = 8 << 20


class _Slots:
    """Pinned host buffers, each with the event its last copy recorded, and the free ones."""

    def __init__(self) -> None:
        self.buffers = [
            torch.empty(SLOT_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(SLOTS)
        ]
        self.events = [torch.cuda.Event() for _ in range(SLOTS)]
        self.free: queue.SimpleQueue[int] = queue.SimpleQueue()
        for index in range(SLOTS):
            self.free.put(index)


class StreamedFile:
    """A temporary file of ``file_size`` bytes beside ``target``, written at offsets:
    :meth:`stream` for tensors while they are made, :meth:`finish` for the rest and the
    rename. Used as a context manager, a file not finished is removed on leaving."""

    def __init__(self, target: str | os.PathLike[str], file_size: int) -> None:
        self.target = Path(target)
        self.target.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(
            prefix=f".{self.target.name}.", suffix=".tmp", dir=self.target.parent
        )
        self._fd, self._temporary = fd, Path(name)
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="kvsnap-streamed")
        self._writes: list[Future[None]] = []
        self._slots: _Slots | None = None
        self._finished = False
        #: The xxh3-128 of each streamed tensor, by name, ready once it is written.
        self.digests: dict[str, Future[bytes]] = {}
        try:
            os.ftruncate(fd, file_size)
        except OSError as exc:
            self.discard()
            raise SnapshotIOError(
                f"{self.target}: cannot write the encoded snapshot ({exc})"
            ) from exc

    def __enter__(self) -> StreamedFile:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        if not self._finished:
            self.discard()

    def stream(self, name: str, data: torch.Tensor, offset: int) -> None:
        """Write ``data`` (``uint8``, contiguous, on a CUDA device or in host memory) at
        ``offset``, its xxh3-128 then in :attr:`digests` under ``name``. A CUDA tensor is
        copied out on the current stream (after what it queued: ``data`` may be reused once
        the stream moves on); a host tensor must stay as it is until :meth:`finish`."""
        hasher = xxhash.xxh3_128()
        flat = data.reshape(-1)
        if flat.device.type != "cuda":
            host = flat.numpy()
            self._writes.append(self._writer.submit(self._write, host, offset, hasher))
        else:
            slots = self._slots = self._slots or _Slots()
            for start in range(0, flat.numel(), SLOT_BYTES):
                chunk = flat[start : start + SLOT_BYTES]
                index = slots.free.get()
                slots.buffers[index][: chunk.numel()].copy_(chunk, non_blocking=True)
                slots.events[index].record()
                write = self._writer.submit(
                    self._write_slot, slots, index, chunk.numel(), offset + start, hasher
                )
                self._writes.append(write)
        self.digests[name] = self._writer.submit(hasher.digest)

    def _write_slot(
        self, slots: _Slots, index: int, nbytes: int, offset: int, hasher: xxhash.xxh3_128
    ) -> None:
        try:
            slots.events[index].synchronize()
            self._write(slots.buffers[index][:nbytes].numpy(), offset, hasher)
        finally:
            slots.free.put(index)

    def _write(self, data: np.ndarray, offset: int, hasher: xxhash.xxh3_128) -> None:
        view = memoryview(data).cast("B")
        hasher.update(view)
        _write_at(self._fd, view, offset, self.target)

    def finish(self, pieces: Sequence[tuple[int, bytes | np.ndarray]]) -> int:
        """Wait for every streamed tensor, write ``pieces`` (offset, bytes) too, fsync and
        rename the file to the target; the file's size."""
        for write in self._writes:
            write.result()
        for offset, piece in pieces:
            data = piece if isinstance(piece, bytes) else np.ascontiguousarray(piece)
            _write_at(self._fd, memoryview(data).cast("B"), offset, self.target)
        try:
            os.fsync(self._fd)
            size = os.fstat(self._fd).st_size
            os.close(self._fd)
            self._fd = -1
            os.replace(self._temporary, self.target)
        except OSError as exc:
            raise SnapshotIOError(
                f"{self.target}: cannot write the encoded snapshot ({exc})"
            ) from exc
        finally:
            self._writer.shutdown()
        self._finished = True
        return size

    def discard(self) -> None:
        """Stop: cancel the writes not begun, wait for those under way, remove the file."""
        self._writer.shutdown(wait=True, cancel_futures=True)
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self._temporary.unlink(missing_ok=True)


def _write_at(fd: int, data: memoryview, offset: int, target: Path) -> None:
    """All of ``data`` at ``offset`` (``os.pwrite`` may write less than it is given)."""
    written = 0
    try:
        while written < len(data):
            written += os.pwrite(fd, data[written:], offset + written)
    except OSError as exc:
        raise SnapshotIOError(f"{target}: cannot write the encoded snapshot ({exc})") from exc


def planned_fp8_layout(layout: FileLayout, keys: KeyRing | None) -> tuple[bytes, enc.EncodedLayout]:
    """The header and layout of the fp8 file (signed with ``keys``) of the ordinary file
    ``layout``, before anything is encoded: its tensors' sizes follow from the ordinary
    file's, and the header keeps room for the error report at its widest, so a placeholder
    report of the same tensors and layers places every tensor where the measured one will."""
    specs: list[tuple[str, str, tuple[int, ...]]] = [
        (enc.ORIGINAL_HEADER_TENSOR, "U8", (len(layout.header),))
    ]
    kinds, measured = {}, []
    for entry in layout.entries:
        if enc.is_padding(entry.name):
            continue
        if not is_layer_tensor(entry.name) or entry.dtype not in FP8_SOURCES:
            specs.append((entry.name, entry.dtype, tuple(entry.shape)))
            if is_layer_tensor(entry.name):
                kinds[entry.name] = "raw"
            continue
        blocks, heads = entry.shape[0], entry.shape[2] if len(entry.shape) == 4 else 1
        specs += [
            (entry.name, "F8_E4M3", tuple(entry.shape)),
            (entry.name + enc.SCALES_SUFFIX, "F32", (blocks, heads)),
            (entry.name + enc.PAGES_SUFFIX, "U64", (blocks,)),
        ]
        if keys is not None:
            specs.append((entry.name + enc.DIGESTS_SUFFIX, "U8", (blocks, PAGE_DIGEST_BYTES)))
        kinds[entry.name] = "fp8"
        measured.append(entry.name)
    report = _placeholder_report(measured)
    document = encoded_document("fp8", kinds, layout.file_size, keys, report)
    return enc.build_layout(document, container_specs(specs, keys))


def _placeholder_report(names: Sequence[str]) -> ErrorReport | None:
    """An error report of the fp8 tensors ``names``, every number zero: what the measured one
    will be but for its numbers."""
    if not names:
        return None
    layers = sorted({int(name.split(".")[1]) for name in names})
    return ErrorReport(
        fp8.NAME,
        "block-head",
        "keys",
        tuple(TensorError(name, 0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0) for name in names),
        tuple(AttentionError(layer, 0, 0.0, 1.0, 1.0) for layer in layers),
    )
