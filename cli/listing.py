"""What ``kvsnap inspect`` needs beyond one snapshot's description: a directory's listing
(every snapshot in it, one row each) and the tokenizer that ``--text`` decodes with."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.table import Table
from rich.text import Text

from .common import format_bytes
from .output import UsageError, emit_json, stdout, text

if TYPE_CHECKING:
    from kvsnap.snapshot import Snapshot


def snapshot_files(directory: Path) -> list[Path]:
    """The snapshots directly in ``directory``, by name: single files and the indexes of
    sharded or parted ones (not their members), without temporary files of writes."""
    from kvsnap.store.location import locate
    from kvsnap.store.publish import TEMP_MARKER
    from kvsnap.store.resolve import index_members, is_index_name

    names = sorted(path.name for path in directory.iterdir() if path.is_file())
    members: set[str] = set()
    for name in names:
        if is_index_name(name):
            members.update(index_members(locate(str(directory / name), None)) or ())
    return [
        directory / name
        for name in names
        if (is_index_name(name) or name.endswith(".safetensors"))
        and name not in members
        and TEMP_MARKER not in name
    ]


def list_directory(directory: Path, *, as_json: bool) -> None:
    """``kvsnap inspect DIR``: one row per snapshot in ``directory`` (a file that does not open
    as one is listed with the reason)."""
    from kvsnap.errors import KVSnapError
    from kvsnap.snapshot import Snapshot

    rows = []
    for path in snapshot_files(directory):
        try:
            with Snapshot.open(path) as snap:
                rows.append(_row(path, snap))
        except KVSnapError as error:
            rows.append({"path": str(path), "error": str(error)})
    if as_json:
        emit_json({"directory": str(directory), "snapshots": rows, "count": len(rows)})
        return
    if not rows:
        stdout.print(f"{text(directory)}: no snapshot files (*.safetensors) in it")
        return
    table = Table(title=Text(f"{directory}: {len(rows)} snapshot(s)"), title_justify="left")
    for column in ("file", "model", "sequences", "tokens", "dtype", "size"):
        table.add_column(column, justify="right" if column in ("sequences", "tokens") else "left")
    for row in rows:
        name = Path(row["path"]).name
        if "error" in row:
            table.add_row(Text(name), Text(f"not a snapshot: {row['error']}"), "", "", "", "")
            continue
        table.add_row(
            Text(name),
            Text(row["model"]),
            str(row["sequences"]),
            str(row["tokens"]),
            row["dtype"],
            format_bytes(row["bytes"]),
        )
    stdout.print(table)


def _row(path: Path, snap: Snapshot) -> dict[str, Any]:
    return {
        "path": str(path),
        "model": snap.metadata.source.model_id,
        "engine": snap.metadata.source.engine,
        "sequences": len(snap.sequences),
        "tokens": sum(len(record.token_ids) for record in snap.sequences),
        "dtype": snap.geometry.dtype,
        "layout": snap.geometry.describe(),
        "bytes": snap.kv_bytes,
    }


def tokenizer_for(snap: Snapshot, model: str | None) -> Any:
    """The tokenizer ``--text`` decodes ``snap``'s tokens with: ``model``'s, else that of the
    model the snapshot names (the built-in one's byte ids, or a local model's). A usage error
    when none works here, saying what to pass."""
    from kvsnap.engines.default_model import DEFAULT_MODEL_ID, ByteTokenizer
    from kvsnap.errors import KVSnapError

    name = model if model is not None else snap.metadata.source.model_id
    if name == DEFAULT_MODEL_ID or (model is None and name == "built-in"):
        return ByteTokenizer()
    try:
        from transformers import AutoConfig

        from kvsnap.engines.default_model import load_tokenizer

        config = AutoConfig.from_pretrained(name, local_files_only=True)
        text_config = getattr(config, "get_text_config", lambda: config)()
        tokenizer, _ = load_tokenizer(name, vocab_size=int(text_config.vocab_size))
        return tokenizer
    except ImportError:
        raise UsageError(
            "--text decodes with a transformers tokenizer, and transformers is not installed: "
            "pip install 'kvsnap[transformers]'"
        ) from None
    except (OSError, ValueError, KeyError, KVSnapError) as error:
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        where = "the --model given" if model is not None else "the model the snapshot names"
        raise UsageError(
            f"--text: no tokenizer for {where}, {name!r}, here ({first}); pass --model with a "
            "local model directory or cached hub id holding its tokenizer"
        ) from None
