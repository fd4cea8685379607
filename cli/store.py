"""``kvsnap store``: look after a vLLM prefix store (the ``KVSnapConnector``'s ``path``).

``list`` shows every chunk (and quarantined chunk) with its size and age, ``verify`` checks
every chunk's structure and checksums (exit 1 if any is bad), ``prune`` deletes orphan parts
and quarantined chunks, then the least recently used chunks, until the store fits a size. A
parted chunk (TP > 1: an index and one part per head range) is one entry everywhere: listed
with its parts count, verified over every part, pruned whole. A thin client of
:mod:`kvsnap.engines.vllm.eviction` and :class:`kvsnap.snapshot.Snapshot`. Given a URL (the
connector's ``remote_url``), each command works on that remote tier instead
(``store_remote.py``).
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from .common import JsonOption, KeyFileOption, format_bytes, is_url, key_ring
from .output import UsageError, emit_json, handle_errors, stdout, text
from .store_common import print_entry_table, report_prune, report_verify, verify_chunk

app = typer.Typer(
    name="store",
    help="Inspect, verify and prune a vLLM prefix store (KVSnapConnector's path).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

if TYPE_CHECKING:
    from kvsnap.engines.vllm.eviction import StoreEntry

StoreArgument = Annotated[
    str,
    typer.Argument(
        metavar="STORE",
        help="The store directory (the connector's path), or its remote tier's URL "
        "(remote_url: s3://bucket/prefix).",
    ),
]


def _require_store(directory: str) -> Path:
    path = Path(directory)
    if not path.is_dir():
        raise UsageError(f"no store directory at {directory}")
    return path


def _entry_json(entry: StoreEntry, root: Path, now: float) -> dict[str, Any]:
    from kvsnap.encoded.summary import file_encoding

    encoding, ratio = file_encoding(str(entry.path))
    return {
        "path": str(entry.path.relative_to(root)),
        "namespace": entry.namespace,
        "bytes": entry.size,
        "age_s": round(entry.age(now), 3),
        "written_s_ago": round(now - entry.modified, 3),
        "quarantined": entry.quarantined,
        "parts": len(entry.parts),
        "orphan": entry.orphan,
        "temp": entry.temp,
        "legacy": entry.legacy,
        "encoding": encoding,
        "ratio": round(ratio, 4),
    }


def _no_entries_hint(root: Path) -> str | None:
    """Why a directory with no store entry may still hold snapshots: plain snapshot files
    (``kvsnap fixture``, ``capture``) directly in it, not a store's ``NAMESPACE/chunks/``."""
    plain = sorted(path.name for path in root.glob("*.safetensors*") if path.is_file())
    if not plain:
        return None
    shown = ", ".join(plain[:3]) + (f" and {len(plain) - 3} more" if len(plain) > 3 else "")
    return (
        f"{root} holds {len(plain)} plain snapshot file(s) ({shown}), not a prefix store "
        "(NAMESPACE/chunks/...): read them with kvsnap inspect FILE or kvsnap verify FILE"
    )


@app.command("list")
@handle_errors
def list_entries(directory: StoreArgument, as_json: JsonOption = False) -> None:
    """List every chunk, quarantined chunk and orphan part, least recently used first.

    Each with its size and age; a parted chunk is one entry (its index) with its parts
    count. On a remote tier (a URL): every chunk, with the later of its upload and its last
    recorded fetch."""
    if is_url(directory):
        from .store_remote import list_remote

        list_remote(directory, as_json)
        return
    root = _require_store(directory)
    now = time.time()
    from kvsnap.engines.vllm.eviction import store_entries

    rows = [_entry_json(entry, root, now) for entry in store_entries(root)]
    total = sum(row["bytes"] for row in rows)
    if as_json:
        emit_json({"store": str(root), "entries": rows, "count": len(rows), "bytes": total})
        return
    print_entry_table(rows, f"{root}: {len(rows)} entries, {format_bytes(total)}")
    hint = None if rows else _no_entries_hint(root)
    if hint is not None:
        stdout.print(f"[yellow]note:[/] {text(hint)}")


@app.command("verify")
@handle_errors
def verify_entries(
    directory: StoreArgument, key_file: KeyFileOption = None, as_json: JsonOption = False
) -> None:
    """Check every chunk's structure and checksums (a parted chunk's over every part), that it
    is the chunk its name says (its sequence id names that key) and, with --key-file, its
    signature; exit 1 if any chunk is bad. On a remote tier (a URL) every chunk object is read
    and checked the same way.

    Quarantined chunks and orphan parts are listed but not checked: they are known bad or
    unused, and never served.
    """
    keys = key_ring(key_file)
    if is_url(directory):
        from .store_remote import verify_remote

        verify_remote(directory, keys, as_json)
        return
    root = _require_store(directory)
    from kvsnap.engines.vllm.eviction import store_entries

    entries = store_entries(root)
    hint = None if entries else _no_entries_hint(root)
    if hint is not None:  # nothing of a store was checked: not "OK"
        raise UsageError(hint)
    results = []
    for entry in entries:
        checked = not (entry.quarantined or entry.orphan)
        state, problems = (
            verify_chunk(entry.path, keys, named=not entry.legacy)
            if checked
            else ("not checked", [])
        )
        results.append(
            {
                "path": str(entry.path.relative_to(root)),
                "quarantined": entry.quarantined,
                "orphan": entry.orphan,
                "parts": len(entry.parts),
                "checked": checked,
                "ok": not problems,
                "state": state,
                "problems": problems,
            }
        )
    report_verify(results, "quarantined or orphan", as_json)


#: Size suffixes ``--max-bytes`` takes (case-insensitive): SI powers of 1000 and binary ones.
_SIZE_UNITS = {
    "": 1,
    "b": 1,
    **{prefix: 1000**power for power, prefix in enumerate("kmgt", 1)},
    **{f"{prefix}b": 1000**power for power, prefix in enumerate("kmgt", 1)},
    **{f"{prefix}i": 1024**power for power, prefix in enumerate("kmgt", 1)},
    **{f"{prefix}ib": 1024**power for power, prefix in enumerate("kmgt", 1)},
}
_SIZE = re.compile(r"\s*(?P<number>\d+(?:\.\d+)?)\s*(?P<unit>[a-z]*)\s*", re.IGNORECASE)


def parse_size(value: str) -> int:
    """Bytes of a size such as ``5000000000``, ``5GB`` (10⁹), ``4.5GiB`` (2³⁰) or ``800M``
    (K, M, G, T: powers of 1000, with ``i``: of 1024); ``typer.BadParameter`` otherwise."""
    match = _SIZE.fullmatch(str(value))
    unit = match.group("unit").lower() if match else ""
    if match is None or unit not in _SIZE_UNITS:
        raise typer.BadParameter(
            f"{value!r} is not a size: a byte count, or a number with a unit such as 5GB, "
            "4.5GiB, 800M"
        )
    return int(float(match.group("number")) * _SIZE_UNITS[unit])


_MaxBytesOption = Annotated[
    int,
    typer.Option(
        "--max-bytes",
        parser=parse_size,
        metavar="SIZE",
        help="Bytes the store may hold afterwards: 5000000000, 5GB, 4.5GiB, 800M.",
    ),
]

_MinIdleOption = Annotated[
    float,
    typer.Option(
        "--min-idle-s",
        min=0.0,
        help="Keep chunks used this recently (an engine may be about to load them).",
    ),
]

_OrphanGraceOption = Annotated[
    float | None,
    typer.Option(
        "--orphan-grace-s",
        min=0.0,
        show_default=False,
        help="Keep parts named by no index that were written this recently (a parted "
        "write may still be publishing its index); default 600 s.",
    ),
]


@app.command("prune")
@handle_errors
def prune(
    directory: StoreArgument,
    max_bytes: _MaxBytesOption,
    min_idle_s: _MinIdleOption = 0.0,
    orphan_grace_s: _OrphanGraceOption = None,
    as_json: JsonOption = False,
) -> None:
    """Delete leftovers, then the least recently used chunks, until the store fits.

    First leftover temporary files and chunks of the old key scheme (whatever the bound),
    orphan parts and quarantined chunks; a parted chunk goes whole (its index first, then its
    parts). On a remote tier (a URL): chunks least recently fetched or written first, each
    with its record of use."""
    if is_url(directory):
        from .store_remote import prune_remote_store

        prune_remote_store(directory, max_bytes, min_idle_s, as_json)
        return
    from kvsnap.engines.vllm.eviction import ORPHAN_GRACE_S, prune_store, store_entries

    if orphan_grace_s is None:
        orphan_grace_s = ORPHAN_GRACE_S
    root = _require_store(directory)
    now = time.time()
    removed = prune_store(
        root, max_bytes, min_idle_s=min_idle_s, orphan_grace_s=orphan_grace_s, now=now
    )
    remaining = sum(entry.size for entry in store_entries(root))
    rows = [_entry_json(entry, root, now) for entry in removed]
    report_prune(rows, str(root), remaining, max_bytes, as_json)
