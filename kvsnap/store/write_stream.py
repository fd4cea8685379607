"""The writer's fsspec target: one ordered lane writing every file front to back."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable

import numpy as np

from kvsnap import format as fmt
from kvsnap.errors import SnapshotIOError
from kvsnap.format import TensorEntry
from kvsnap.store import overwrite, tuning
from kvsnap.store.lanes import SerialLane
from kvsnap.store.location import (
    INDEX_SUFFIX,
)
from kvsnap.store.pools import shared_executor
from kvsnap.store.publish import temp_name
from kvsnap.store.stream_file import StreamFile
from kvsnap.store.tracing import traced


class StreamTarget:
    """The fsspec half of :class:`~kvsnap.store.writer.SnapshotWriter` (a mixin)."""

    def _start_stream(self, direct_io: bool | None) -> None:
        """Start the ordered lane and queue everything up to the first layer tensor."""
        if direct_io:
            raise SnapshotIOError("O_DIRECT needs a local file", file=self._location.url)
        self.fallback_reason = f"not a local file ({self._location.url})"
        # Its own lane on the shared write pool: ordered, one item at a time, no new thread.
        self._lane = SerialLane(shared_executor("write", tuning.WRITE_POOL_THREADS))
        self._items = self._stream_items()
        self._cursor = 0
        self._advance(self._names[0] if self._current == 0 else None)

    def _stream_items(self) -> list[tuple[str, int, TensorEntry | None]]:
        """Everything to write, in file order: (kind, shard, entry); kind is one of header,
        static, layer, blocksums, trailer."""
        items: list[tuple[str, int, TensorEntry | None]] = []
        for shard, layout in enumerate(self._layouts):
            items.append(("header", shard, None))
            for entry in layout.entries:
                if fmt.is_layer_tensor(entry.name):
                    kind = "layer"
                elif entry.name == fmt.BLOCK_CHECKSUMS_TENSOR:
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
        assert self._lane is not None
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
            self._lane.submit(self._guarded_lane(kind, shard, entry))
            self._cursor += 1

    def _guarded_lane(self, kind: str, shard: int, entry: TensorEntry | None) -> Callable[[], None]:
        def run() -> None:
            if self._error is not None:
                return
            try:
                self._lane_item(kind, shard, entry)
            except BaseException as error:
                self._fail(error)

        return run

    def _lane_item(self, kind: str, shard: int, entry: TensorEntry | None) -> None:
        layout = self._layouts[shard]
        if kind == "header":
            self._stream_files[shard] = StreamFile(self._finals[shard])
            self._stream_write(shard, 0, memoryview(layout.header))
            return
        assert entry is not None
        if kind == "static":
            static = self._static_bytes(entry)
            assert static is not None
            self._stream_write(shard, entry.begin, memoryview(static))
        elif kind == "blocksums":
            concurrent.futures.wait([f for futures in self._hash_futures for f in futures])
            self._raise_error()
            self._stream_write(
                shard, entry.begin, memoryview(self._digests.astype("<u8").tobytes())
            )
        elif kind == "trailer":
            concurrent.futures.wait(self._hash_futures[shard])
            self._raise_error()
            self._stream_write(shard, entry.begin, memoryview(self._trailer(shard)))
            signature = layout.by_name.get(fmt.SIGNATURE_TENSOR)
            if signature is not None:
                self._stream_write(shard, signature.begin, memoryview(self._signature(shard)))
            stream = self._stream_files[shard]
            assert stream is not None
            stream.close()

    def _stream_write(self, shard: int, offset: int, view: memoryview | np.ndarray) -> None:
        stream = self._stream_files[shard]
        assert stream is not None
        with traced(self._trace, "write", len(memoryview(view))):
            stream.write(offset, memoryview(view))

    def _publish_stream(self) -> None:
        stale = overwrite.stale_files(self._location, self._finals, self._sharded)
        for stream in self._stream_files:
            assert stream is not None
            stream.publish()
        if self._sharded:
            index = self._location.with_suffix(INDEX_SUFFIX)
            data = self._index_bytes()
            if index.object_store:
                index.fs.pipe_file(index.path, data)
            else:
                temp = index.sibling(temp_name(index.name))
                temp.fs.pipe_file(temp.path, data)
                temp.fs.mv(temp.path, index.path)
        self._stream_files = [None] * len(self._layouts)
        overwrite.remove_quietly(stale)
