"""The chunks vLLM's connector keeps open between one load and the next.

Two kinds of :class:`~kvsnap.engines.open_snapshots.OpenSnapshots` keep chunks open (the rules
for when a kept chunk is served are that class's):

- :data:`CHECKED_CHUNKS`: where the worker runs in the scheduler's process (vLLM's ``uni``
  executor, a TP size of 1), a single-file chunk the scheduler just opened and checked, handed
  to the worker's next load and taken once, as it was checked (``follow_name=False``: a file
  renamed over the chunk's name since is not what the worker loads; a chunk read whole is
  loaded from the bytes the check read, any other through the descriptor it checked while
  that file's device, inode, size and modification time are the ones checked: its change time
  moves when another file is renamed over its name, which does not change its bytes);
- each worker's own (:attr:`KVSnapWorker._kept <kvsnap.engines.vllm.worker.KVSnapWorker>`):
  the chunks it loaded, for the next load of the same chunk.
"""

from __future__ import annotations

from kvsnap.caches import register_cache_clear
from kvsnap.engines.open_snapshots import OpenSnapshots

__all__ = ["CHECKED_CHUNKS"]

#: The process's chunks checked by its scheduler and not yet taken by its worker.
CHECKED_CHUNKS = OpenSnapshots(change_time=False, follow_name=False)
register_cache_clear(CHECKED_CHUNKS.clear)
