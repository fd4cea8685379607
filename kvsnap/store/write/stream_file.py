"""An fsspec output file written front to back (multipart upload on object stores)."""

from __future__ import annotations

import contextlib

from kvsnap.store.base import tuning
from kvsnap.store.files.location import (
    Location,
)
from kvsnap.store.files.publish import temp_name


class StreamFile:
    """One output file written front to back through fsspec (``wb``), from one thread."""

    def __init__(self, final: Location) -> None:
        self.final = final
        # Object stores make an upload visible only when it completes: write in place.
        # Elsewhere (memory://, sftp, ...) a file is visible while written: use a temporary name.
        if final.object_store:
            self.target = final
            self.handle = final.fs.open(final.path, "wb", block_size=tuning.STREAM_BLOCK_BYTES)
        else:
            self.target = final.sibling(temp_name(final.name))
            self.handle = final.fs.open(self.target.path, "wb")
        self.position = 0
        self.closed = False

    def write(self, offset: int, view: memoryview) -> None:
        if offset != self.position:
            raise RuntimeError(f"stream write at {offset}, the stream is at {self.position}")
        self.handle.write(view)
        self.position += len(view)

    def close(self) -> None:
        self.handle.close()
        self.closed = True

    def publish(self) -> None:
        if self.target is not self.final:
            self.final.fs.mv(self.target.path, self.final.path)

    def discard(self) -> None:
        if not self.closed:
            # discard() aborts a multipart upload; marking the file closed keeps its
            # finalizer from completing the upload anyway.
            with contextlib.suppress(Exception):
                discard = getattr(self.handle, "discard", None)
                if discard is not None:
                    discard()
            with contextlib.suppress(Exception):
                self.handle.closed = True
            self.closed = True
        if self.target is not self.final:
            with contextlib.suppress(Exception):
                self.target.remove()
