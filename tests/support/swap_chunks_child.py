"""A co-writer of a prefix store without its key: renames chunks over each other's names.

Usage: ``python swap_chunks_child.py JOB.json`` where ``JOB.json`` holds ``{"pairs": [[NAME,
OWN, FOREIGN], ...], "pause_s": 0.0005, "stop": PATH}``. ``OWN`` and ``FOREIGN`` are copies of
the chunk that belongs under ``NAME`` and of another tenant's chunk of the same shape (signed
and valid, both). Until the file ``stop`` exists, it puts a hard link of one or the other under
each ``NAME`` by ``rename`` (atomic: a reader finds one whole file or the other), alternating,
``pause_s`` apart; then prints how many renames it made. With ``"progress": PATH`` it also
keeps the count so far in that file (every :data:`PROGRESS_EVERY` renames), for a reader that
must know the race has run long enough. A name another process moved away (quarantined) is
simply put back by the next rename.
"""

from __future__ import annotations

import json
import os
import sys
import time

PROGRESS_EVERY = 25


def _progress(path: str, renames: int) -> None:
    temporary = f"{path}.{os.getpid()}"
    with open(temporary, "w") as handle:
        handle.write(str(renames))
    os.replace(temporary, path)


def main() -> None:
    with open(sys.argv[1]) as handle:
        job = json.load(handle)
    pairs, pause, stop = job["pairs"], float(job["pause_s"]), job["stop"]
    progress = job.get("progress")
    renames = rounds = reported = 0
    while not os.path.exists(stop):
        rounds += 1
        for name, own, foreign in pairs:
            source = foreign if rounds % 2 else own
            temporary = f"{name}.swap-{os.getpid()}"
            try:
                os.link(source, temporary)
                os.replace(temporary, name)
                renames += 1
            except FileNotFoundError:
                pass  # the directory's chunk moved meanwhile: the next round puts it back
            time.sleep(pause)
        if progress and renames - reported >= PROGRESS_EVERY:
            _progress(progress, renames)
            reported = renames
    print(json.dumps({"renames": renames}))


if __name__ == "__main__":
    main()
