"""What several commands share: option types, snapshot and output locations, number formats.

A location is a local path or an fsspec URL (``file:///abs/path``, ``memory://name``,
``s3://bucket/key``). URLs go to the library as the string the user typed; only local paths are
checked here, before any work is done, so that a mistake costs nothing.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from .output import UsageError

if TYPE_CHECKING:
    from kvsnap.format.signing import KeyRing
from .output import format_bytes as format_bytes  # the commands' size format, beside the bars

JsonOption = Annotated[
    bool, typer.Option("--json", help="Print one JSON object on stdout, nothing else.")
]
ModelOption = Annotated[
    str | None,
    typer.Option(
        "--model",
        "-m",
        metavar="M",
        help=(
            "A local transformers model directory or a cached hub id "
            "(default: the built-in tiny model)."
        ),
    ),
]
DeviceOption = Annotated[
    str,
    typer.Option(
        "--device", metavar="D", help="torch device to run the model on: cpu, cuda, cuda:N."
    ),
]
DtypeOption = Annotated[
    str,
    typer.Option("--dtype", metavar="T", help="Model and KV dtype: float32, bfloat16, float16."),
]
BackendOption = Annotated[
    str,
    typer.Option(
        "--backend", metavar="B", help="Copy backend: auto, cuda-batch, triton, torch, cpu."
    ),
]
KeyFileOption = Annotated[
    list[Path] | None,
    typer.Option(
        "--key-file",
        metavar="F",
        help=(
            "A signing key file (one hex key per line, mode 600); repeatable. The first key "
            "signs, every key is accepted."
        ),
    ),
]
CompressOption = Annotated[
    str,
    typer.Option(
        "--compress",
        metavar="C",
        help="none (as captured), lossless (bit-exact, smaller), or fp8 (e4m3 with per block "
        "and head scales, about half the size; its error measured and written in the file).",
    ),
]
SnapshotArgument = Annotated[str, typer.Argument(metavar="SNAPSHOT", help="Snapshot file or URL.")]


def key_ring(key_files: list[Path] | None) -> KeyRing | None:
    """The keys of ``--key-file`` (``None`` when none was given); a missing or unreadable file,
    one other users can read, or a line that is not a key is refused (exit 2)."""
    if not key_files:
        return None
    from kvsnap.store.files.keys import load_key_ring

    return load_key_ring(key_files)


def is_url(location: str) -> bool:
    """Whether ``location`` is an fsspec URL (``scheme://...``) rather than a local path."""
    scheme, separator, _ = location.partition("://")
    return bool(separator) and scheme.replace("+", "").replace("-", "").isalnum()


def snapshot_location(location: str) -> str:
    """``location`` checked as a snapshot to read: a local path must be an existing file.

    URLs are returned unchanged (the library opens them); a local path is returned as given.
    A sharded snapshot is read through its ``NAME.safetensors.index.json``, so a missing
    ``NAME.safetensors`` with that index next to it counts as present.
    """
    if is_url(location):
        return location
    from kvsnap.store.files.location import locate
    from kvsnap.store.files.resolve import committed_file

    found = committed_file(locate(location, None))
    if found is None:
        raise UsageError(f"{location}: no such file")
    _refuse_temporary(location)
    if found.status is not None and stat.S_ISDIR(found.status.st_mode):
        raise UsageError(f"{location}: is a directory, not a snapshot file")
    return location


def _refuse_temporary(location: str) -> None:
    """A writer's temporary file is named as what it is (a write in progress, or one that did
    not finish), not read as a snapshot whose trailer does not match."""
    from kvsnap.store.files.publish import leftover_status, temp_final_name

    final = temp_final_name(Path(location).name)
    if final is None:
        return
    if leftover_status(location) is None:
        raise UsageError(
            f"{location}: a write in progress (kvsnap's temporary file for {final}, which its "
            f"writer renames into place once complete): read {final} once it is published"
        )
    raise UsageError(
        f"{location}: the temporary file of a write of {final} that did not finish (its writer "
        "is gone): no snapshot; the next write of that snapshot removes it"
    )


def output_location(location: str, *, option: str) -> str:
    """``location`` checked as a snapshot to write: refuse a directory or a missing parent.

    URLs are returned unchanged; the check runs before any model is loaded or KV computed.
    """
    if is_url(location):
        return location
    path = Path(location)
    if location.endswith(os.sep) or path.is_dir():
        raise UsageError(f"{option} {location}: is a directory; name the snapshot file to write")
    parent = path.parent
    if not parent.is_dir():
        raise UsageError(f"{option} {location}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise UsageError(f"{option} {location}: directory {parent} is not writable")
    return location


#: The values of ``--compress``.
COMPRESSIONS = ("none", "lossless", "fp8")


def compression_for(value: str, target: str) -> str:
    """``--compress``'s value checked: one of :data:`COMPRESSIONS`, and a local target for an
    encoded snapshot (written with a rename beside it)."""
    if value not in COMPRESSIONS:
        raise UsageError(f"--compress {value}: one of {', '.join(COMPRESSIONS)}")
    if value != "none" and is_url(target) and not target.startswith("file://"):
        raise UsageError(f"--compress {value}: encoded snapshots are written to local files")
    return value
