"""The connector's event log: one JSON object per line, shared by the scheduler and the workers.

:class:`EventLog` writes; :func:`read_events` and :func:`count_events` read back. Nothing here
needs vLLM.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

# The package's name, not this submodule's: the events have always gone to this logger.
logger = logging.getLogger("kvsnap.engines.vllm")


class EventLog:
    """Appends one JSON object per line to a file shared by the scheduler and every worker.

    Each event is one ``write`` on a file opened with ``O_APPEND``, so lines from several
    processes never interleave. Events also go to the ``kvsnap.engines.vllm`` logger.
    """

    def __init__(self, path: str | None, role: str, rank: int) -> None:
        self.path = path
        self.role = role
        self.rank = rank
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)

    def emit(self, event: str, level: int = logging.INFO, **fields: Any) -> None:
        """Record ``event`` with ``fields`` (JSON-serializable values)."""
        if logger.isEnabledFor(level):  # else the JSON of every load and match, for nobody
            logger.log(level, "kvsnap %s %s", event, json.dumps(fields, default=str))
        if not self.path:
            return
        record = {
            "time": time.time(),
            "event": event,
            "role": self.role,
            "rank": self.rank,
            **fields,
        }
        line = (json.dumps(record, default=str) + "\n").encode()
        descriptor = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(descriptor, line)
        finally:
            os.close(descriptor)


def read_events(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The events an :class:`EventLog` wrote to ``path``, in order (none if it does not exist)."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def count_events(events: Iterable[Mapping[str, Any]], name: str, **fields: Any) -> int:
    """How many ``events`` are called ``name`` and carry every ``fields`` value."""
    return sum(
        1
        for event in events
        if event.get("event") == name and all(event.get(k) == v for k, v in fields.items())
    )
