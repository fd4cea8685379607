"""Reading snapshots: :class:`~.reader.SnapshotReader` and its parts, which receive the open
files, checksums and page geometry (:class:`~.opened.OpenedFiles`) instead of the reader
(:mod:`.checksums`, :mod:`.page_reads`, :mod:`.slot_reads`, :mod:`.verify`,
:mod:`.held_verify`), the byte sources (:mod:`.source`, :mod:`.kvikio_reads`), the checks
on open (:mod:`.opening`, :mod:`.members`, :mod:`.signatures`) and the opening of sharded
and parted snapshots (:mod:`.head_parts`, :mod:`.parts`). It never writes, publishes or
deletes a file."""
