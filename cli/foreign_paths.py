"""``inspect`` and ``verify`` of another engine's persisted KV (``kvsnap.foreign``).

The two commands hand a local path that a foreign reader recognises to this module before
anything else, so kvsnap's own snapshots keep their path unchanged.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from .common import format_bytes, is_url
from .output import EXIT_VERIFY_FAILED, UsageError, emit_json, stdout, text

if TYPE_CHECKING:
    from kvsnap.foreign import ForeignSource

#: What every safetensors file starts with after its 8-byte length: kvsnap's own snapshots.
_SAFETENSORS_JSON = b"{"


def is_foreign(location: str) -> bool:
    """Whether ``location`` is a local path that one of kvsnap's foreign readers reads.

    kvsnap's own files (a safetensors file, a sharded or parted index) are told apart first,
    without loading the readers (which import no torch either: ``inspect`` and ``verify`` of
    a foreign path start without it too)."""
    path = Path(location)
    if is_url(location) or not path.exists() or _looks_like_kvsnap(path):
        return False
    from kvsnap.foreign import recognise

    return recognise(location) is not None or _holds_no_snapshot(path)


def _holds_no_snapshot(path: Path) -> bool:
    """A directory with no kvsnap snapshot in it: the foreign readers' refusal, which names
    what each found there, says more than "is a directory" (an empty directory, a vLLM
    namespace without its config.json, a root holding two namespaces)."""
    if not path.is_dir():
        return False
    from kvsnap.store.files.resolve import is_index_name

    try:
        names = [child.name for child in path.iterdir()]
    except OSError:
        return False
    return not any(name.endswith(".safetensors") or is_index_name(name) for name in names)


def _looks_like_kvsnap(path: Path) -> bool:
    """A kvsnap index by name, or a file laid out as safetensors (a length that fits the
    file, then JSON)."""
    from kvsnap.store.files.resolve import is_index_name

    if is_index_name(path.name):
        return True
    if not path.is_file():
        return False
    with path.open("rb") as file:
        start = file.read(9)
    if len(start) != 9 or start[8:9] != _SAFETENSORS_JSON:
        return False
    # The length must fit the file: a foreign file's first bytes rarely make one that does.
    return 2 <= int.from_bytes(start[:8], "little") <= path.stat().st_size - 8


def inspect_foreign(location: str, *, as_json: bool, unsupported: dict[str, bool]) -> None:
    """``kvsnap inspect`` of a foreign path: what the format records and what it cannot tell."""
    _refuse_options("inspect", unsupported)
    from kvsnap.foreign import open_foreign

    with open_foreign(location) as source:
        payload = source.describe()
    if as_json:
        emit_json(payload)
        return
    stdout.print(f"[bold]{text(payload['version'])}[/]  {text(payload['path'])}")
    for key, value in _summary_rows(payload):
        stdout.print(f"  {key:<18} {text(value)}")
    stdout.print("[yellow]this format cannot tell:[/]")
    for sentence in payload["cannot_tell"]:
        stdout.print(f"  - {text(sentence)}")


def _summary_rows(payload: dict[str, Any]) -> list[tuple[str, str]]:
    """The rows people see: the format's own config fields, then what was found (long lists,
    the per-block listing and the sentences printed below are left to ``--json``)."""
    rows = [(str(key), str(value)) for key, value in payload.get("config", {}).items()]
    skipped = {"format", "version", "path", "config", "blocks", "cannot_tell", "token_ids"}
    for key, value in payload.items():
        if key in skipped:
            continue
        if key.endswith("bytes") and isinstance(value, int):
            value = format_bytes(value)
        rows.append((key, "unknown" if value is None else str(value)))
    return rows


def verify_foreign(location: str, *, as_json: bool, unsupported: dict[str, bool]) -> None:
    """``kvsnap verify`` of a foreign path: structure, sizes and names; contents cannot be
    checked where the format has no checksums (said in the output, every time)."""
    _refuse_options("verify", unsupported)
    from kvsnap.foreign import open_foreign

    with open_foreign(location) as source:
        problems = [problem.as_dict() for problem in source.verify()]
        notes = _notes(source)
    if as_json:
        emit_json({"ok": not problems, "problems": problems, "notes": notes})
    else:
        for note in notes:
            stdout.print(f"[yellow]note:[/] {text(note)}")
        for problem in problems:
            stdout.print(f"[red]problem:[/] {text(problem['file'])}: {text(problem['message'])}")
        failed = f"[bold red]FAILED[/] ({len(problems)} problem(s))"
        stdout.print(failed if problems else "[bold green]OK[/] (structure only)")
    if problems:
        raise typer.Exit(EXIT_VERIFY_FAILED)


def _notes(source: ForeignSource) -> list[str]:
    return [
        f"{source.version}: structure, sizes and names checked; the KV contents cannot be "
        "checked: the format has no checksums",
        *(f"cannot tell: {sentence}" for sentence in source.cannot_tell[1:]),
        *source.notes(),
    ]


def _refuse_options(command: str, unsupported: dict[str, bool]) -> None:
    """Options that read kvsnap snapshots only are refused for a foreign path, by name."""
    given = [name for name, used in unsupported.items() if used]
    if given:
        raise UsageError(
            f"{command} {', '.join(given)} reads kvsnap snapshots: convert the foreign path "
            "first (kvsnap convert PATH -o OUT.safetensors)"
        )
