"""Reading other engines' persisted KV: recognise, inspect, verify and convert.

One module per format registers a :class:`ForeignFormat` in :data:`FORMATS`;
:func:`open_foreign` asks each whether it reads a path and opens it with the first that does.
A path no reader takes is refused with one line naming what each found there. Adding a format
is one new module with a ``ForeignFormat`` and one line here
(docs/architecture.md, "Foreign formats").
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvsnap.errors import NotASnapshotError, SnapshotIOError

from .base import (
    ForeignBlock,
    ForeignFormat,
    ForeignProblem,
    ForeignSequence,
    ForeignSource,
    Recognition,
)
from .llama_state import LLAMA_STATE
from .lmcache_fs import LMCACHE_FS
from .pages import CELL_ORDERS, PageOrder, cell_order, load_page_order
from .sglang_hicache import SGLANG_HICACHE
from .thaw_kv import THAW_KV
from .vllm_fs import VLLM_FS

#: Every format kvsnap reads besides its own, in the order they are asked.
FORMATS: tuple[ForeignFormat, ...] = (
    VLLM_FS,
    LLAMA_STATE,
    SGLANG_HICACHE,
    LMCACHE_FS,
    THAW_KV,
)


def __getattr__(name: str) -> Any:
    # convert writes through the capture pipeline (torch); reading needs none of it, and the
    # CLI's inspect and verify of a foreign path start without torch.
    if name == "convert_to_snapshot":
        from .convert import convert_to_snapshot

        return convert_to_snapshot
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def recognise(path: str | Path) -> ForeignFormat | None:
    """The registered format that reads ``path``, or ``None``."""
    location = Path(path)
    for candidate in FORMATS:
        if candidate.recognise(location).matches:
            return candidate
    return None


def open_foreign(path: str | Path, **hints: Any) -> ForeignSource:
    """Open ``path`` with the first registered reader that recognises it.

    ``hints`` supply what a format does not record (see each reader: for ``vllm-fs``,
    ``model``, ``page_order``, ``tp_size``, ``tokens``, ...). Raises
    :class:`~kvsnap.errors.SnapshotIOError` for a missing path and
    :class:`~kvsnap.errors.NotASnapshotError` naming what each reader found otherwise.
    """
    location = Path(path)
    if not location.exists():
        raise SnapshotIOError("no such file or directory", file=str(location))
    found = []
    for candidate in FORMATS:
        verdict = candidate.recognise(location)
        if verdict.matches:
            return candidate.open(location, _known_hints(candidate, hints))
        found.append(f"{candidate.name}: {verdict.found}")
    raise NotASnapshotError(
        "not a format kvsnap reads (" + "; ".join(found) + ")", file=str(location)
    )


def _known_hints(candidate: ForeignFormat, hints: Mapping[str, Any]) -> dict[str, Any]:
    """The hints the reader takes; a hint it does not know is refused, not ignored."""
    given = {name: value for name, value in hints.items() if value is not None}
    unknown = sorted(set(given) - set(candidate.hints))
    if unknown:
        raise ValueError(f"{candidate.name} takes no hint {', '.join(unknown)}")
    return given


__all__ = [
    "CELL_ORDERS",
    "FORMATS",
    "ForeignBlock",
    "ForeignFormat",
    "ForeignProblem",
    "ForeignSequence",
    "ForeignSource",
    "PageOrder",
    "Recognition",
    "cell_order",
    "convert_to_snapshot",
    "load_page_order",
    "open_foreign",
    "recognise",
]
