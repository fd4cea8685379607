"""``kvsnap store``: look after a vLLM prefix store (the ``KVSnapConnector``'s ``path``).

``list`` shows every chunk (and quarantined chunk) with its size and age, ``verify`` checks
every chunk's structure and checksums (exit 1 if any is bad), ``prune`` deletes orphan parts
and quarantined chunks, then the least recently used chunks, until the store fits a size. A
parted chunk (TP > 1: an index and one part per head range) is one entry everywhere: listed
with its parts count, verified over every part, pruned whole. A thin client of
:mod:`kvsnap.engines.vllm.eviction` and :class:`kvsnap.snapshot.Snapshot`.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich import box
from rich.table import Table
from rich.text import Text

from kvsnap.errors import KVSnapError

from .common import JsonOption, KeyFileOption, format_bytes, key_ring
from .output import EXIT_VERIFY_FAILED, UsageError, emit_json, handle_errors, stdout, text

app = typer.Typer(
    name="store",
    help="Inspect, verify and prune a vLLM prefix store (KVSnapConnector's path).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

if TYPE_CHECKING:
    from kvsnap.engines.vllm.eviction import StoreEntry
    from kvsnap.format.signing import KeyRing

StoreArgument = Annotated[Path, typer.Argument(help="The store directory (the connector's path).")]


def _require_store(directory: Path) -> Path:
    if not directory.is_dir():
        raise UsageError(f"no store directory at {directory}")
    return directory


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


def _state(row: dict[str, Any]) -> str:
    if row["temp"]:
        return "leftover temp file"
    if row["orphan"]:
        return "orphan part"
    if row["legacy"]:
        return "old key scheme"
    return "quarantined" if row["quarantined"] else "ok"


def _encoding_cell(row: dict[str, Any]) -> str:
    if row["encoding"] == "none":
        return "-"
    return f"{row['encoding']} {row['ratio']:.2f}x"


def _age(seconds: float) -> str:
    for unit, length in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= length:
            return f"{seconds / length:.1f} {unit}"
    return f"{seconds:.0f} s"


def _print_entries(rows: list[dict[str, Any]], title: str) -> None:
    """``title``, then one table per namespace (named once, above it) whose rows name each
    entry by its file name without ``.safetensors`` (a chunk: its hash): a namespace is a long
    model fingerprint, and with it in every row nothing else fitted at 80-100 columns."""
    stdout.print(text(title))
    namespaces: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        namespaces.setdefault(row["namespace"], []).append(row)
    for namespace, members in namespaces.items():
        table = Table(
            title=Text(f"namespace {namespace}"),
            caption="entry: NAMESPACE/chunks/HH/ENTRY….safetensors (--json: whole paths)",
            title_justify="left",
            caption_justify="left",
            box=box.SIMPLE_HEAD,
        )
        for column in ("entry", "parts", "size", "encoding", "last used", "state"):
            table.add_column(column, overflow="fold")
        for row in members:
            table.add_row(
                Text(_entry_name(row["path"])),
                str(row["parts"]) if row["parts"] else "-",
                format_bytes(row["bytes"]),
                _encoding_cell(row),
                f"{_age(row['age_s'])} ago",
                _state(row),
            )
        stdout.print(table)


#: A chunk's store key (``kvsnap.engines.vllm.identity.KEY_PATTERN``; not imported from there:
#: the vLLM package loads torch, and the CLI starts without it).
_STORE_KEY = re.compile(r"[0-9a-f]{64}")
#: Hex digits of a chunk's 64-digit store key shown by ``list``: unique in practice (like a git
#: short hash), and the row then fits 80 columns; ``--json`` gives whole paths.
_SHOWN_KEY_DIGITS = 16


def _entry_name(path: str) -> str:
    """An entry's file name without the suffix every chunk file shares, a store key shortened
    to its first :data:`_SHOWN_KEY_DIGITS` digits."""
    from kvsnap.store.resolve import snapshot_stem

    name = snapshot_stem(Path(path).name)
    if _STORE_KEY.fullmatch(name):
        return name[:_SHOWN_KEY_DIGITS] + "…"
    return name


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
    """List every chunk, quarantined chunk and orphan part, least recently used first, with
    size and age; a parted chunk is one entry (its index) with its parts count."""
    root = _require_store(directory)
    now = time.time()
    from kvsnap.engines.vllm.eviction import store_entries

    rows = [_entry_json(entry, root, now) for entry in store_entries(root)]
    total = sum(row["bytes"] for row in rows)
    if as_json:
        emit_json({"store": str(root), "entries": rows, "count": len(rows), "bytes": total})
        return
    _print_entries(rows, f"{root}: {len(rows)} entries, {format_bytes(total)}")
    hint = None if rows else _no_entries_hint(root)
    if hint is not None:
        stdout.print(f"[yellow]note:[/] {text(hint)}")


@contextlib.contextmanager
def _last_use_kept(path: Path) -> Iterator[None]:
    """Put back the access time of ``path`` (a chunk's last use for LRU eviction) after the
    block reads it, unless the file was rewritten meanwhile: a check is no use."""
    try:
        before = os.stat(path)
    except OSError:
        before = None
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            after = os.stat(path)
            if before is not None and after.st_mtime_ns == before.st_mtime_ns:
                os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))


def _verify_one(path: Path, keys: KeyRing | None, *, named: bool) -> tuple[str, list[str]]:
    """The state of the chunk at ``path``, a single file or a parted chunk's index (every part
    checked), and its problems: ``ok``; ``corrupt`` (structure, checksums or, with ``keys``,
    a page that does not match its signed BLAKE3 digest); with ``keys``, ``unsigned``, ``bad
    signature`` or ``weak signature`` (signed before pages were bound by BLAKE3): intact,
    but never served by an engine holding the keys; with ``named``, ``misnamed`` (its one
    sequence's id names another chunk: a chunk copied under another's name, never served under
    it). Its last use (access time) is left as it was."""
    from kvsnap.engines.vllm.prefix_store import name_problem
    from kvsnap.errors import SignatureError, UnsignedSnapshotError
    from kvsnap.snapshot import Snapshot

    refused: list[SignatureError] = []
    try:
        with _last_use_kept(path):
            try:
                # With the keys every page is checked against its signed BLAKE3 digest.
                snap = Snapshot.open(path, keys=keys)
            except SignatureError:
                assert keys is not None
                snap = Snapshot.open(path)
                refused = snap.signature_problems(keys)
            with snap:
                problems = [
                    f"{problem.tensor} block {problem.block}: {problem.message}"
                    if problem.tensor
                    else problem.message
                    for problem in snap.verify()
                ]
                binding = snap.page_binding
                misnamed = name_problem(path, snap.metadata.sequences) if named else None
    except (KVSnapError, OSError) as error:
        return "corrupt", [str(error)]
    if problems:
        return "corrupt", problems
    if refused:
        unsigned = isinstance(refused[0], UnsignedSnapshotError)
        return ("unsigned" if unsigned else "bad signature"), [str(error) for error in refused]
    if keys is not None and binding != "blake3":
        return "weak signature", [_WEAK_SIGNATURE]
    if misnamed is not None:
        return "misnamed", [misnamed]
    return "ok", []


_WEAK_SIGNATURE = (
    "signed before pages were bound by BLAKE3 (hmac-sha256: pages bound by xxh3-64 only, not "
    "collision-resistant): an engine holding the key recomputes it and saves it anew"
)


@app.command("verify")
@handle_errors
def verify_entries(
    directory: StoreArgument, key_file: KeyFileOption = None, as_json: JsonOption = False
) -> None:
    """Check every chunk's structure and checksums (a parted chunk's over every part), that it
    is the chunk its name says (its sequence id names that key) and, with --key-file, its
    signature; exit 1 if any chunk is bad.

    Quarantined chunks and orphan parts are listed but not checked: they are known bad or
    unused, and never served.
    """
    root = _require_store(directory)
    keys = key_ring(key_file)
    from kvsnap.engines.vllm.eviction import store_entries

    entries = store_entries(root)
    results = []
    for entry in entries:
        checked = not (entry.quarantined or entry.orphan)
        state, problems = (
            _verify_one(entry.path, keys, named=not entry.legacy)
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
    bad = [result for result in results if not result["ok"]]
    checked = sum(result["checked"] for result in results)
    if as_json:
        emit_json({"ok": not bad, "checked": checked, "bad": len(bad), "entries": results})
    else:
        for result in bad:
            stdout.print(f"[red]{result['state']}:[/] {result['path']}: {result['problems'][0]}")
        skipped = len(results) - checked
        summary = f"{checked} chunks checked, {len(bad)} bad, {skipped} quarantined or orphan"
        stdout.print(
            f"[bold green]OK[/] {summary}" if not bad else f"[bold red]FAILED[/] {summary}"
        )
    if bad:
        raise typer.Exit(EXIT_VERIFY_FAILED)


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


@app.command("prune")
@handle_errors
def prune(
    directory: StoreArgument,
    max_bytes: Annotated[
        int,
        typer.Option(
            "--max-bytes",
            parser=parse_size,
            metavar="SIZE",
            help="Bytes the store may hold afterwards: 5000000000, 5GB, 4.5GiB, 800M.",
        ),
    ],
    min_idle_s: Annotated[
        float,
        typer.Option(
            "--min-idle-s",
            min=0.0,
            help="Keep chunks used this recently (an engine may be about to load them).",
        ),
    ] = 0.0,
    orphan_grace_s: Annotated[
        float | None,
        typer.Option(
            "--orphan-grace-s",
            min=0.0,
            show_default="600",
            help="Keep parts named by no index that were written this recently (a parted "
            "write may still be publishing its index).",
        ),
    ] = None,
    as_json: JsonOption = False,
) -> None:
    """Delete leftover temporary files and chunks of the old key scheme (whatever the bound),
    orphan parts and quarantined chunks, then the least recently used chunks, until the store
    fits; a parted chunk goes whole (its index first, then its parts)."""
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
    freed = sum(row["bytes"] for row in rows)
    if as_json:
        emit_json(
            {
                "removed": rows,
                "freed_bytes": freed,
                "bytes": remaining,
                "fits": remaining <= max_bytes,
            }
        )
        return
    if rows:
        _print_entries(rows, f"removed {len(rows)} entries, {format_bytes(freed)}")
    stdout.print(f"{root} holds {format_bytes(remaining)} (bound {format_bytes(max_bytes)})")
