"""What the store commands share, on a local store and on a remote tier: the table of entries,
one chunk's check and the report of them all (``kvsnap store list`` and ``verify``)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich import box
from rich.table import Table
from rich.text import Text

from kvsnap.errors import KVSnapError

from .common import format_bytes
from .output import EXIT_VERIFY_FAILED, emit_json, stdout, text

if TYPE_CHECKING:
    from kvsnap.format.signing import KeyRing


def _state(row: dict[str, Any]) -> str:
    if row["temp"]:
        return "leftover temp file"
    if row["orphan"]:
        return "orphan part"
    if row["legacy"]:
        return "old key scheme"
    return "quarantined" if row["quarantined"] else "ok"


def _age(seconds: float) -> str:
    for unit, length in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= length:
            return f"{seconds / length:.1f} {unit}"
    return f"{seconds:.0f} s"


def print_entry_table(rows: list[dict[str, Any]], title: str) -> None:
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
        # A local listing reads each entry's header for its encoding; a remote one lists
        # objects without reading them (one request per thousand), so it has no such column.
        encoded = all("encoding" in row for row in members)
        columns = ("entry", "parts", "size", *(("encoding",) if encoded else ()), "last used")
        for column in (*columns, "state"):
            table.add_column(column, overflow="fold")
        for row in members:
            table.add_row(
                Text(_entry_name(row["path"])),
                str(row["parts"]) if row["parts"] else "-",
                format_bytes(row["bytes"]),
                *((_encoding_cell(row),) if encoded else ()),
                f"{_age(row['age_s'])} ago",
                row["state"] if "state" in row else _state(row),
            )
        stdout.print(table)


def report_prune(
    rows: list[dict[str, Any]],
    where: str,
    remaining: int,
    max_bytes: int,
    as_json: bool,
    print_rows: Callable[[list[dict[str, Any]], str], None] = print_entry_table,
) -> None:
    """What ``kvsnap store prune`` removed (``rows``, printed by ``print_rows``) and what the
    store at ``where`` holds now against its bound (``--json``: one object)."""
    freed = sum(row["bytes"] for row in rows)
    if as_json:
        fits = remaining <= max_bytes
        emit_json({"removed": rows, "freed_bytes": freed, "bytes": remaining, "fits": fits})
        return
    if rows:
        print_rows(rows, f"removed {len(rows)} entries, {format_bytes(freed)}")
    stdout.print(f"{text(where)} holds {format_bytes(remaining)} (bound {format_bytes(max_bytes)})")


def report_verify(results: list[dict[str, Any]], skipped: str, as_json: bool) -> None:
    """What ``kvsnap store verify`` found (``results``: one entry each, ``--json``: one object):
    each bad entry, then the counts (``skipped`` names the entries not checked); exit 1 if an
    entry is bad."""
    bad = [result for result in results if not result["ok"]]
    checked = sum(result["checked"] for result in results)
    if as_json:
        emit_json({"ok": not bad, "checked": checked, "bad": len(bad), "entries": results})
    else:
        for result in bad:
            stdout.print(
                f"[red]{result['state']}:[/] {text(result['path'])}: {text(result['problems'][0])}"
            )
        summary = f"{checked} chunks checked, {len(bad)} bad, {len(results) - checked} {skipped}"
        stdout.print(
            f"[bold green]OK[/] {summary}" if not bad else f"[bold red]FAILED[/] {summary}"
        )
    if bad:
        raise typer.Exit(EXIT_VERIFY_FAILED)


def _encoding_cell(row: dict[str, Any]) -> str:
    if row["encoding"] == "none":
        return "-"
    return f"{row['encoding']} {row['ratio']:.2f}x"


#: Hex digits of a chunk's 64-digit store key shown by ``list``: unique in practice (like a git
#: short hash), and the row then fits 80 columns; ``--json`` gives whole paths.
_SHOWN_KEY_DIGITS = 16


def _entry_name(path: str) -> str:
    """An entry's file name without the suffix every chunk file shares, a store key shortened
    to its first :data:`_SHOWN_KEY_DIGITS` digits."""
    from kvsnap.engines.vllm.identity import KEY_PATTERN
    from kvsnap.store.files.resolve import snapshot_stem

    name = snapshot_stem(Path(path).name)
    if KEY_PATTERN.fullmatch(name):
        return name[:_SHOWN_KEY_DIGITS] + "…"
    return name


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


def verify_chunk(path: Path, keys: KeyRing | None, *, named: bool) -> tuple[str, list[str]]:
    """The state of the chunk at ``path``, a single file or a parted chunk's index (every part
    checked), and its problems: ``ok``; ``corrupt`` (structure, checksums or, with ``keys``,
    a page that does not match its signed BLAKE3 digest); with ``keys``, ``unsigned``, ``bad
    signature`` or ``weak signature`` (signed before pages were bound by BLAKE3): intact,
    but never served by an engine holding the keys; with ``named``, ``misnamed`` (its one
    sequence's id names another chunk: a chunk copied under another's name, never served under
    it). Its last use (access time) is left as it was. A remote tier's object is checked here
    too, from a scratch copy of its bytes."""
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
