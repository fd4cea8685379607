"""``kvsnap store list|verify|prune URL``: the same commands on a remote tier (the connector's
``remote_url``: ``s3://bucket/prefix``, any fsspec URL).

Credentials and the endpoint come the library's standard way (for S3: the environment,
``~/.aws``, an instance role; ``AWS_ENDPOINT_URL_S3`` for MinIO). ``list`` shows every chunk
with its size and last use (the later of its upload and its last fetch any node recorded),
``verify`` reads every chunk and checks it as an engine does (structure and checksums, that it
is the chunk its name says, and with ``--key-file`` its signature), ``prune`` deletes chunks
least recently used first until the tier fits a size. A thin client of
:mod:`kvsnap.engines.vllm.remote_entries`.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .output import emit_json

if TYPE_CHECKING:
    from kvsnap.engines.vllm.remote_entries import RemoteEntry
    from kvsnap.format.signing import KeyRing


def _row(entry: RemoteEntry, now: float) -> dict[str, Any]:
    return {
        "path": entry.path,
        "namespace": entry.namespace,
        "kind": entry.kind,
        "bytes": entry.size,
        "age_s": round(entry.age(now), 3),
        "written_s_ago": round(now - entry.written, 3),
        "fetched_s_ago": None if entry.used is None else round(now - entry.used, 3),
    }


def _print_rows(rows: list[dict[str, Any]], title: str) -> None:
    from .store_common import print_entry_table

    shown = [
        {
            **row,
            "parts": 0,
            "state": "ok" if row["kind"] == "chunk" else row["kind"],
        }
        for row in rows
    ]
    print_entry_table(shown, title)


def list_remote(url: str, as_json: bool) -> None:
    """``kvsnap store list URL``."""
    from kvsnap.engines.vllm.remote_entries import remote_entries

    now = time.time()
    rows = [_row(entry, now) for entry in remote_entries(url)]
    total = sum(row["bytes"] for row in rows)
    if as_json:
        emit_json({"store": url, "entries": rows, "count": len(rows), "bytes": total})
        return
    from .output import format_bytes

    _print_rows(rows, f"{url}: {len(rows)} entries, {format_bytes(total)}")


def _verify_object(fs: Any, path: str, keys: KeyRing | None) -> tuple[str, list[str]]:
    """The state of the chunk object at ``path`` (in ``fs``) and its problems, as ``kvsnap
    store verify`` names them for a local chunk: the object is read in one request into a
    scratch file of its own name, then checked there."""
    from .store_common import verify_chunk

    try:
        data = fs.cat_file(path)
    except OSError as error:
        return "unreadable", [f"{type(error).__name__}: {error}"]
    with tempfile.TemporaryDirectory(prefix="kvsnap-verify-") as scratch:
        local = Path(scratch) / path.rsplit("/", 1)[-1]
        local.write_bytes(data)
        return verify_chunk(local, keys, named=True)


def verify_remote(url: str, keys: KeyRing | None, as_json: bool) -> None:
    """``kvsnap store verify URL``: every chunk object read and checked; exit 1 if one is
    bad. Objects that are not chunks are listed, not checked."""
    from kvsnap.engines.vllm.remote_entries import remote_entries
    from kvsnap.engines.vllm.remote_store import remote_filesystem

    from .store_common import report_verify

    fs, root = remote_filesystem(url)
    results = []
    for entry in remote_entries(url):
        checked = entry.kind == "chunk"
        state, problems = (
            _verify_object(fs, f"{root}/{entry.path}", keys) if checked else ("not checked", [])
        )
        results.append(
            {
                "path": entry.path,
                "kind": entry.kind,
                "checked": checked,
                "ok": not problems,
                "state": state,
                "problems": problems,
            }
        )
    report_verify(results, "other objects", as_json)


def prune_remote_store(url: str, max_bytes: int, min_idle_s: float, as_json: bool) -> None:
    """``kvsnap store prune URL --max-bytes N``."""
    from kvsnap.engines.vllm.remote_entries import prune_remote

    now = time.time()
    removed, remaining = prune_remote(url, max_bytes, min_idle_s=min_idle_s, now=now)
    rows = [_row(entry, now) for entry in removed]
    from .store_common import report_prune

    report_prune(rows, url, remaining, max_bytes, as_json, print_rows=_print_rows)
