"""Where a snapshot's files live and how they change hands: local paths and fsspec URLs
(:mod:`.location`), which form a path holds (:mod:`.resolve`), temporary names and the atomic
publish (:mod:`.publish`), what a replacement may delete (:mod:`.overwrite`), part file names
and a failed parted write's cleanup (:mod:`.part_files`) and signing-key files
(:mod:`.keys`). It never reads a snapshot's tensors, maps memory or writes pages."""
