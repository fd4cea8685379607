"""KVSnapConnector with a co-writer of its store inside the engine: the timing a test needs.

A second process tampering with the store cannot aim at the instant between the scheduler's
check of a chunk and the worker's load of it; this connector does it from the scheduler's side
of a real vLLM engine, with the environment variable ``KVSNAP_TEST_TAMPER`` (JSON) saying what:

* ``{"swap": {"victim": PATH, "with": PATH}}``: once a step's plan loads the chunk ``victim``
  (after the scheduler checked it, before any worker loads it), a hard link of the chunk
  ``with`` (another prompt's, valid and signed as any) is renamed over it;
* ``{"rot": {"path": PATH, "after": REQUEST_ID}}``: once the request ``after`` (the id given
  to vLLM) has finished, one byte of a page of the chunk ``path`` is flipped in place and its
  modification time put back: bit rot after the chunk's first check.

Used by ``vllm_run_engine.py`` when a job names ``"connector_class": "tampering"``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from kvsnap.engines.vllm import KVSnapConnector, external_request_id

TAMPER_ENV = "KVSNAP_TEST_TAMPER"


class TamperingConnector(KVSnapConnector):
    """:class:`KVSnapConnector` whose scheduler side tampers with the store on cue."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._tamper = json.loads(os.environ.get(TAMPER_ENV, "{}"))
        self._done: set[str] = set()

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        meta = super().build_connector_meta(scheduler_output)
        swap = self._tamper.get("swap")
        if swap and "swap" not in self._done:
            planned = {chunk.path for spec in meta.loads for chunk in spec.chunks}
            if swap["victim"] in planned:
                temporary = f"{swap['victim']}.tamper"
                os.link(swap["with"], temporary)
                os.replace(temporary, swap["victim"])
                self._done.add("swap")
        return meta

    def request_finished(self, request: Any, block_ids: list[int]) -> Any:
        rot = self._tamper.get("rot")
        finished = external_request_id(request.request_id)
        if rot and "rot" not in self._done and finished == rot["after"]:
            _rot(Path(rot["path"]))
            self._done.add("rot")
        return super().request_finished(request, block_ids)


def _rot(path: Path) -> None:
    """Flip a byte in the middle of the first layer's keys of the chunk at ``path`` in place,
    and put its access and modification times back (as ``tests/support/file_versions.py``,
    which needs pytest: the engine's environment has none)."""
    status = path.stat()
    with open(path, "r+b") as file:
        header_size = int.from_bytes(file.read(8), "little")
        begin, end = json.loads(file.read(header_size))["layers.0.key"]["data_offsets"]
        file.seek(8 + header_size + (begin + end) // 2)
        byte = file.read(1)[0]
        file.seek(-1, os.SEEK_CUR)
        file.write(bytes([byte ^ 0x5A]))
    os.utime(path, ns=(status.st_atime_ns, status.st_mtime_ns))
