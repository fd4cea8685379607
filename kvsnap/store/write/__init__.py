"""Writing snapshots: :class:`~.writer.SnapshotWriter` (hashing beside writing), its two
targets (:mod:`.local_target`, :mod:`.stream_target`) and output files (:mod:`.local_file`,
:mod:`.stream_file`), the files' layouts (:mod:`.snapshot_files`), many tensors' pages per call
(:mod:`.slot_writes`), the page digests (:mod:`.page_hashing`), the order pages must come in
(:mod:`.order`), the serial lanes (:mod:`.lanes`), what a commit published (:mod:`.info`) and
a parted snapshot's index publish (:mod:`.parts_index`). It opens a reader
only through :func:`kvsnap.store.read.parts.parts_index_bytes`, to compare an index with the
parts already on disk."""
