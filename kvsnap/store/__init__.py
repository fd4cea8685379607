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

The package is five rooms, each a sub-package whose name says what changes there
(docs/architecture.md draws them; tests/project/test_import_layers.py holds the order):

- :mod:`~kvsnap.store.base`: thread pools, pipeline sizes, the trace hook, split futures, a
  wait Ctrl-C does not cut short;
- :mod:`~kvsnap.store.files`: locations, which form a path holds, temporary names and the
  atomic publish, what a replacement deletes, part file names, signing-key files;
- :mod:`~kvsnap.store.hot`: the page cache as a tier (mapped, registered, resident files, the
  capture's memory-backed file and the next one's spare);
- :mod:`~kvsnap.store.read`: :class:`SnapshotReader` and its parts, the opening of sharded and
  parted snapshots;
- :mod:`~kvsnap.store.write`: :class:`SnapshotWriter`, its targets and files, the write order,
  a parted snapshot's index publish.

Each imports only the rooms listed before it. The modules that lived directly in
``kvsnap/store/`` before the split still import under their old names
(``kvsnap.store.reader``, ...), with a :class:`DeprecationWarning` (but ``kvsnap.store.hot``,
now the package that re-exports its old names): :data:`MOVED` maps each old
name to its new module(s), and one import hook (:class:`_MovedModules`) serves them.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import os
import sys
import types
import warnings
from collections.abc import Sequence

from kvsnap.store.base.tracing import TraceHook, traced
from kvsnap.store.base.tuning import DEFAULT_MAX_INFLIGHT_BYTES
from kvsnap.store.files.publish import publish_bytes
from kvsnap.store.hot.tier import HotStats, configure_hot_tier, hot_tier
from kvsnap.store.read.head_parts import HeadPart, OpenedSnapshot, open_snapshot
from kvsnap.store.read.reader import SnapshotReader
from kvsnap.store.write.writer import SnapshotInfo, SnapshotWriter

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

#: Each module that lived directly in ``kvsnap/store/`` before the split, and the modules (under
#: ``kvsnap.store``) its names live in now; ``parts`` was split three ways.
MOVED: dict[str, tuple[str, ...]] = {
    "tracing": ("base.tracing",),
    "completion": ("base.completion",),
    "tuning": ("base.tuning",),
    "pools": ("base.pools",),
    "location": ("files.location",),
    "resolve": ("files.resolve",),
    "publish": ("files.publish",),
    "overwrite": ("files.overwrite",),
    "keys": ("files.keys",),
    "residency": ("hot.residency",),
    "spare_files": ("hot.spare_files",),
    "mapped_file": ("hot.mapped_file",),
    "mapping_release": ("hot.mapping_release",),
    "reader": ("read.reader", "read.opened"),
    "checksums": ("read.checksums",),
    "page_reads": ("read.page_reads",),
    "slot_reads": ("read.slot_reads",),
    "verify": ("read.verify",),
    "held_verify": ("read.held_verify",),
    "opening": ("read.opening",),
    "source": ("read.source",),
    "kvikio_reads": ("read.kvikio_reads",),
    "signatures": ("read.signatures",),
    "head_parts": ("read.head_parts",),
    "parts": ("read.parts", "files.part_files", "write.parts_index"),
    "writer": ("write.writer",),
    "write_local": ("write.local_target",),
    "write_stream": ("write.stream_target",),
    "snapshot_files": ("write.snapshot_files",),
    "slot_writes": ("write.slot_writes",),
    "write_order": ("write.order",),
    "local_file": ("write.local_file",),
    "stream_file": ("write.stream_file",),
    "lanes": ("write.lanes",),
}


class _MovedModule(types.ModuleType):
    """An old module name: every attribute is read from the new modules, first hit wins."""

    def __init__(self, name: str, targets: Sequence[str]) -> None:
        super().__init__(name)
        self.__targets = tuple(targets)

    def __getattr__(self, name: str) -> object:
        for target in self.__targets:
            module = importlib.import_module(target)
            if hasattr(module, name):
                return getattr(module, name)
        raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")

    def __dir__(self) -> list[str]:
        names: set[str] = set()
        for target in self.__targets:
            names.update(dir(importlib.import_module(target)))
        return sorted(names)


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """The import hook behind :data:`MOVED`: ``kvsnap.store.OLD`` imports as a
    :class:`_MovedModule` of its new modules and warns once, where it is imported."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        package, _, old = fullname.rpartition(".")
        if package != __name__ or old not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        old = spec.name.rpartition(".")[2]
        targets = [f"{__name__}.{target}" for target in MOVED[old]]
        _warn_importer(f"{spec.name} moved to {' and '.join(targets)}; import it from there")
        return _MovedModule(spec.name, targets)

    def exec_module(self, module: types.ModuleType) -> None:
        """Nothing to run: the module's names are read from its new modules."""


#: Where the frames of an import that are not the importer's own come from: importlib's frozen
#: bootstrap, its package (``importlib.import_module``) and this module (``__getattr__``).
_IMPORT_MACHINERY = ("<frozen importlib.", os.path.dirname(importlib.__file__) + os.sep, __file__)


def _warn_importer(message: str) -> None:
    """A :class:`DeprecationWarning` at the line that imported an old name.

    No ``stacklevel`` names that line: ``warnings`` skips only the frozen bootstrap's frames, and
    ``from kvsnap.store import OLD`` or ``kvsnap.store.OLD`` come through ``__getattr__`` and
    ``importlib.import_module`` (Python 3.12's ``skip_file_prefixes`` is not in 3.10-3.11).
    """
    frame = sys._getframe(1)
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_IMPORT_MACHINERY):
        frame = frame.f_back
    importer = frame.f_globals
    warnings.warn_explicit(
        message,
        DeprecationWarning,
        frame.f_code.co_filename,
        frame.f_lineno,
        module=importer.get("__name__", "<string>"),
        registry=importer.setdefault("__warningregistry__", {}),
        module_globals=importer,
    )


def __getattr__(name: str) -> types.ModuleType:
    # ``kvsnap.store.reader`` as an attribute (``import kvsnap.store`` then the dotted name)
    if name in MOVED:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
    sys.meta_path.append(_MovedModules())
