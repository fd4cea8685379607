"""The writer's fsspec target: one ordered lane writing every file front to back."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable

import numpy as np

from kvsnap import format as fmt
from kvsnap.errors import SnapshotIOError
from kvsnap.format import TensorEntry
from kvsnap.store import overwrite, publish, tuning
from kvsnap.store.lanes import SerialLane
from kvsnap.store.pools import shared_executor
from kvsnap.store.snapshot_files import SnapshotFiles, WriteGate, WriteTarget
from kvsnap.store.stream_file import StreamFile
from kvsnap.store.tracing import TraceHook, traced

#: One thing to write, in file order: (kind, file, entry); kind is one of header, static,
#: layer, blocksums (the block checksums or page digests), trailer.
_Item = tuple[str, int, TensorEntry | None]


class StreamTarget(WriteTarget):
    """fsspec files (``memory://``, ``s3://``, ...), written front to back: everything goes
    through one ordered lane on the process-wide write pool, header and metadata tensors as
    the data reaches them, checksums and trailer once the data before them is hashed. Object
    stores publish each file when its upload completes; other filesystems get a temporary
    name and a move."""

    merges_tensors = False

    def __init__(
        self, snapshot_files: SnapshotFiles, gate: WriteGate, trace: TraceHook | None
    ) -> None:
        self._snapshot_files = snapshot_files
        self._gate = gate
        self._trace = trace
        self._streams: list[StreamFile | None] = [None] * len(snapshot_files.layouts)
        # Its own lane on the shared write pool: ordered, one item at a time, no new thread.
        self._lane = SerialLane(shared_executor("write", tuning.WRITE_POOL_THREADS))
        self._hash_futures: list[list[concurrent.futures.Future[None]]] = [
            [] for _ in snapshot_files.layouts
        ]
        self._items = self._stream_items()
        self._cursor = 0

    def start(self, direct_io: bool | None) -> None:
        """Queue everything up to the first layer tensor."""
        if direct_io:
            raise SnapshotIOError(
                "O_DIRECT needs a local file", file=self._snapshot_files.location.url
            )
        self.fallback_reason = f"not a local file ({self._snapshot_files.location.url})"
        snapshot_files = self._snapshot_files
        self._advance(snapshot_files.names[0] if snapshot_files.num_blocks else None)

    def _stream_items(self) -> list[_Item]:
        """Everything to write, in file order."""
        items: list[_Item] = []
        for shard, layout in enumerate(self._snapshot_files.layouts):
            items.append(("header", shard, None))
            for entry in layout.entries:
                if fmt.is_layer_tensor(entry.name):
                    kind = "layer"
                elif entry.name in (fmt.BLOCK_CHECKSUMS_TENSOR, fmt.PAGE_DIGESTS_TENSOR):
                    kind = "blocksums"
                elif entry.name == fmt.CHECKSUMS_TENSOR:
                    kind = "trailer"
                elif entry.name == fmt.SIGNATURE_TENSOR:
                    continue  # written right after the trailer, which it signs
                else:
                    kind = "static"
                items.append((kind, shard, entry))
        return items

    def _advance(self, stop_at: str | None) -> None:
        """Queue, in order, everything before layer tensor ``stop_at`` (``None``: to the end)."""
        while self._cursor < len(self._items):
            kind, shard, entry = self._items[self._cursor]
            if kind == "layer":
                assert entry is not None
                if entry.name == stop_at:
                    return
                if entry.nbytes:
                    raise RuntimeError(f"internal error: {entry.name} was never written")
                self._cursor += 1  # an empty tensor (no blocks) has nothing to write
                continue
            self._lane.submit(self._lane_item(kind, shard, entry))
            self._cursor += 1

    def _lane_item(self, kind: str, shard: int, entry: TensorEntry | None) -> Callable[[], None]:
        def run() -> None:
            if self._gate.error is not None:
                return
            try:
                self._write_item(kind, shard, entry)
            except BaseException as error:
                self._gate.fail(error)

        return run

    def _write_item(self, kind: str, shard: int, entry: TensorEntry | None) -> None:
        snapshot_files = self._snapshot_files
        layout = snapshot_files.layouts[shard]
        if kind == "header":
            self._streams[shard] = StreamFile(snapshot_files.finals[shard])
            self._stream_write(shard, 0, memoryview(layout.header))
            return
        assert entry is not None
        if kind == "static":
            static = snapshot_files.static_bytes(entry)
            assert static is not None
            self._stream_write(shard, entry.begin, memoryview(static))
        elif kind == "blocksums":
            concurrent.futures.wait([f for futures in self._hash_futures for f in futures])
            self._gate.raise_error()
            data = snapshot_files.tensor_bytes(shard, entry)
            self._stream_write(shard, entry.begin, memoryview(data))
        elif kind == "trailer":
            concurrent.futures.wait(self._hash_futures[shard])
            self._gate.raise_error()
            self._stream_write(shard, entry.begin, memoryview(snapshot_files.trailer(shard)))
            signature = layout.by_name.get(fmt.SIGNATURE_TENSOR)
            if signature is not None:
                self._stream_write(
                    shard, signature.begin, memoryview(snapshot_files.signature(shard))
                )
            stream = self._streams[shard]
            assert stream is not None
            stream.close()

    def _stream_write(self, shard: int, offset: int, view: memoryview | np.ndarray) -> None:
        stream = self._streams[shard]
        assert stream is not None
        with traced(self._trace, "write", len(memoryview(view))):
            stream.write(offset, memoryview(view))

    def write(self, shard: int, offset: int, view: np.ndarray) -> concurrent.futures.Future[None]:
        return self._lane.submit(self._gate.guarded(self._stream_write, shard, offset, view))

    def hashed(self, shard: int, future: concurrent.futures.Future[None]) -> None:
        # The checksums and the trailer wait for the hashing of what precedes them.
        self._hash_futures[shard].append(future)

    def tensor_done(self, next_name: str | None) -> None:
        self._cursor += 1  # past this tensor's item
        if next_name is not None:
            self._advance(next_name)

    def finish(self, drain: Callable[[], None]) -> None:
        # Every data write is on the lane already: queue the rest behind it and wait.
        self._advance(None)
        self._lane.submit(lambda: None).result()
        self._gate.raise_error()

    def publish(self) -> None:
        snapshot_files = self._snapshot_files
        stale = overwrite.stale_files(
            snapshot_files.location, snapshot_files.finals, snapshot_files.sharded
        )
        for stream in self._streams:
            assert stream is not None
            stream.publish()
        if snapshot_files.sharded:
            publish.publish_to(snapshot_files.index_location, snapshot_files.index_bytes())
        self._streams = [None] * len(snapshot_files.layouts)
        overwrite.remove_quietly(stale)

    def shutdown(self, cancel: bool) -> None:
        self._lane.shutdown(wait=True, cancel_futures=cancel)

    def discard(self) -> None:
        for stream in self._streams:
            if stream is not None:
                stream.discard()
