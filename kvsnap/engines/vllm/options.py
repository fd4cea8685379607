"""The connector's options: ``kv_connector_extra_config``, parsed and checked.

Nothing here needs vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MODES = ("persist", "dump", "persist+dump")

#: Every key :meth:`ConnectorOptions.from_extra_config` accepts.
KNOWN_OPTIONS = frozenset(
    {
        "path",
        "mode",
        "dump_requests",
        "dump_decode_step",
        "dump_path",
        "min_blocks",
        "event_log",
        "max_pending_writes",
    }
)


@dataclass(frozen=True)
class ConnectorOptions:
    """``kv_connector_extra_config`` of :class:`~kvsnap.engines.vllm.KVSnapConnector`, checked.

    * ``path`` (required): the prefix store directory (``persist``) or dump directory (``dump``).
    * ``mode``: ``persist`` (default), ``dump`` or ``persist+dump``.
    * ``dump_requests``: ``"all"`` (default) or a list of request ids (the id given to vLLM;
      vLLM's internal id with its random suffix is accepted too). A request whose
      ``SamplingParams.extra_args`` holds ``{"kvsnap_dump": true}`` is dumped as well.
    * ``dump_decode_step``: 0 (default) dumps at the end of prefill; ``k`` once the cache holds
      the prompt and ``k`` generated tokens.
    * ``dump_path``: where dumps go (default: ``path``, or ``path/dumps`` in ``persist+dump``).
    * ``min_blocks``: prompts with fewer full blocks are not persisted (default 1). A request
      whose ``SamplingParams.extra_args`` holds ``{"kvsnap_persist": false}`` is not persisted.
    * ``event_log``: a JSON-lines file every process appends its hits, misses, loads, load
      failures, saves and dumps to (default: none; vLLM's log gets them either way).
    * ``max_pending_writes``: snapshot writes queued behind the engine before a save waits
      (default 4); bounds the host memory that saved blocks hold.
    """

    path: str
    mode: str = "persist"
    dump_requests: tuple[str, ...] | None = None  # None: all requests
    dump_decode_step: int = 0
    dump_path: str | None = None
    min_blocks: int = 1
    event_log: str | None = None
    max_pending_writes: int = 4

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any]) -> ConnectorOptions:
        """Parse and check ``kv_connector_extra_config``; raise ``ValueError`` naming the key."""
        unknown = set(extra) - KNOWN_OPTIONS
        if unknown:
            raise ValueError(
                f"KVSnapConnector: unknown option(s) {sorted(unknown)}; "
                f"known: {sorted(KNOWN_OPTIONS)}"
            )
        if not extra.get("path"):
            raise ValueError("KVSnapConnector needs kv_connector_extra_config['path']")
        mode = str(extra.get("mode", "persist"))
        if mode not in MODES:
            raise ValueError(f"KVSnapConnector: mode must be one of {MODES}, got {mode!r}")
        dump_path = extra.get("dump_path")
        if dump_path is None:
            dump_path = (
                str(Path(extra["path"]) / "dumps") if mode == "persist+dump" else extra["path"]
            )
        return cls(
            path=str(extra["path"]),
            mode=mode,
            dump_requests=_dump_requests(extra.get("dump_requests", "all")),
            dump_decode_step=_integer(extra, "dump_decode_step", 0, minimum=0),
            dump_path=str(dump_path),
            min_blocks=_integer(extra, "min_blocks", 1, minimum=1),
            event_log=extra.get("event_log"),
            max_pending_writes=_integer(extra, "max_pending_writes", 4, minimum=1),
        )

    @property
    def persist(self) -> bool:
        """Whether prompt prefixes are persisted to and loaded from the store."""
        return self.mode in ("persist", "persist+dump")

    @property
    def dump(self) -> bool:
        """Whether requests are dumped as ordinary snapshots."""
        return self.mode in ("dump", "persist+dump")


def _dump_requests(requests: Any) -> tuple[str, ...] | None:
    """``dump_requests`` as a tuple of ids, or ``None`` for ``"all"``."""
    if requests == "all":
        return None
    if isinstance(requests, list | tuple) and all(isinstance(r, str) for r in requests):
        return tuple(requests)
    raise ValueError(
        f"KVSnapConnector: dump_requests must be 'all' or a list of ids, got {requests!r}"
    )


def _integer(extra: Mapping[str, Any], key: str, default: int, *, minimum: int) -> int:
    """The integer option ``key`` (``default`` when absent), at least ``minimum``."""
    raw = extra.get(key, default)
    try:
        value = int(raw)
    except (TypeError, ValueError):
        raise ValueError(f"KVSnapConnector: {key} must be an integer, got {raw!r}") from None
    if value < minimum:
        raise ValueError(f"KVSnapConnector: {key} must be >= {minimum}, got {value}")
    return value
