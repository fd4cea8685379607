"""The page cache as a tier: snapshot files mapped and registered with CUDA so restores copy
straight out of them (:mod:`.tier`, whose API this package re-exports: ``kvsnap.store.hot``
was that module before the store was split into rooms), whether a range is resident
(:mod:`.residency`), a capture's memory-backed file (:mod:`.mapped_file`), its release
(:mod:`.mapping_release`) and the next capture's spare file (:mod:`.spare_files`). It never
parses a snapshot's header or checks a checksum: readers and writers do."""

from __future__ import annotations

from kvsnap.store.hot.tier import (
    HOT_BYTES,
    MAX_COUNTED_FILES,
    REGISTER_AFTER,
    FileKey,
    HotFile,
    HotStats,
    HotTier,
    configure_hot_tier,
    file_key,
    hot_tier,
)

__all__ = [
    "HOT_BYTES",
    "MAX_COUNTED_FILES",
    "REGISTER_AFTER",
    "FileKey",
    "HotFile",
    "HotStats",
    "HotTier",
    "configure_hot_tier",
    "file_key",
    "hot_tier",
]
