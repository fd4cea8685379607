"""``kvsnap inspect``: a snapshot's metadata and sequences, optionally statistics (streamed, with
a progress bar), a plot and the sequences as text; several snapshots; a directory's listing."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table
from rich.text import Text

from kvsnap.encoded.summary import encoding_summary, error_line
from kvsnap.format.constants import SIGNATURE_ALGORITHM, SIGNATURE_ALGORITHM_V1
from kvsnap.format.encoded import PAGES_SIGNATURE_ALGORITHM
from kvsnap.format.encoded import SIGNATURE_ALGORITHM as ENCODED_SIGNATURE_ALGORITHM

from .common import JsonOption, format_bytes, is_url, snapshot_location
from .foreign_paths import inspect_foreign, is_foreign
from .listing import list_directory, tokenizer_for
from .output import UsageError, emit_json, progress_bar, stdout, text
from .plot import check_plot_path, plot_norms

if TYPE_CHECKING:
    from kvsnap.snapshot import Snapshot


SnapshotsArgument = Annotated[
    list[str],
    typer.Argument(
        metavar="SNAPSHOT...",
        help="Snapshot files or URLs (one or more), or a directory of snapshots to list.",
    ),
]


def inspect(
    snapshot: SnapshotsArgument,
    stats: Annotated[
        bool, typer.Option("--stats", help="Per layer absmax, mean, std, NaN and Inf counts.")
    ] = False,
    plot: Annotated[
        str | None,
        typer.Option(
            "--plot",
            metavar="FILE",
            help="Write a heatmap of per-layer, per-token K/V norms (.png, .svg, .pdf).",
        ),
    ] = None,
    sequence: Annotated[
        str | None,
        typer.Option(
            "--sequence", metavar="ID", help="The sequence --plot shows (default: the first)."
        ),
    ] = None,
    show_text: Annotated[
        bool,
        typer.Option("--text", help="Show each sequence's tokens as text (needs a tokenizer)."),
    ] = False,
    model: Annotated[
        str | None,
        typer.Option(
            "--model",
            "-m",
            metavar="M",
            help="The model whose tokenizer --text uses (default: the one the snapshot names).",
        ),
    ] = None,
    as_json: JsonOption = False,
) -> None:
    """Show a snapshot's metadata and sequences, or list a directory of snapshots.

    Optionally per-tensor statistics (--stats), a heatmap of token norms (--plot) and each
    sequence as text (--text)."""
    if len(snapshot) == 1 and is_foreign(snapshot[0]):
        unsupported = {
            "--stats": stats,
            "--plot": plot is not None,
            "--sequence": bool(sequence),
            "--text": show_text,
        }
        return inspect_foreign(snapshot[0], as_json=as_json, unsupported=unsupported)
    if len(snapshot) == 1 and Path(snapshot[0]).is_dir():
        return list_directory(Path(snapshot[0]), as_json=as_json)
    if model is not None and not show_text:
        raise UsageError("--model names the tokenizer of --text: add --text")
    if sequence is not None and plot is None:
        raise UsageError("--sequence chooses the sequence of --plot: add --plot FILE")
    if plot is not None:
        check_plot_path(plot)
        if len(snapshot) > 1:
            raise UsageError("--plot draws one snapshot: give one SNAPSHOT")
    locations = [_location(location) for location in snapshot]
    options = _Options(stats, plot, sequence, show_text, model, as_json)
    payloads = [_inspect_one(location, options) for location in locations]
    if as_json:
        emit_json(payloads[0] if len(payloads) == 1 else {"snapshots": payloads})


@dataclass(frozen=True)
class _Options:
    stats: bool
    plot: str | None
    sequence: str | None
    show_text: bool
    model: str | None
    as_json: bool


def _location(location: str) -> str:
    if is_foreign(location):
        raise UsageError(
            f"{location}: another engine's files are inspected one at a time: "
            f"kvsnap inspect {location}"
        )
    if not is_url(location) and Path(location).is_dir():
        raise UsageError(f"{location}: a directory is listed on its own: kvsnap inspect {location}")
    return snapshot_location(location)


def _inspect_one(location: str, options: _Options) -> dict[str, Any]:
    """Describe (and with the options analyse) the snapshot at ``location``; print it unless
    ``--json``; return its JSON object."""
    from kvsnap.snapshot import Snapshot

    with Snapshot.open(location) as snap:
        payload = describe(snap)
        if options.show_text:
            _add_text(payload, snap, options.model)
        if options.stats:
            with progress_bar("statistics", enabled=not options.as_json) as progress:
                payload["stats"] = snap.stats(progress=progress)
        if options.plot is not None:
            payload["plot"] = plot_norms(snap, options.plot, sequence_id=options.sequence)
    if not options.as_json:
        _print_inspect(payload)
    return payload


def _add_text(payload: dict[str, Any], snap: Snapshot, model: str | None) -> None:
    """Each sequence's tokens decoded (``text``), by the tokenizer of ``model`` or of the
    model the snapshot names."""
    from kvsnap.engines.default_model import decode_with

    tokenizer = tokenizer_for(snap, model)
    for entry, record in zip(payload["sequences"], snap.sequences, strict=True):
        entry["text"] = decode_with(tokenizer, record.token_ids.tolist())


def describe(snap: Snapshot) -> dict[str, Any]:
    """The JSON description of ``snap`` that ``kvsnap inspect --json`` prints (no stats)."""
    meta = snap.metadata
    geometry = snap.geometry
    shared = snap.shared_blocks()
    return {
        "path": snap.path,
        "format_version": snap.format_version,
        "kvsnap_version": meta.kvsnap_version,
        "created": meta.created,
        "model": {
            "id": meta.source.model_id,
            "revision": meta.source.model_revision,
            "fingerprint": meta.source.model_fingerprint,
            "engine": meta.source.engine,
            "engine_version": meta.source.engine_version,
        },
        "layout": {
            "num_layers": geometry.num_layers,
            "num_kv_heads": geometry.num_kv_heads,
            "head_dim": geometry.head_dim,
            "latent_dim": geometry.latent_dim,
            "block_size": geometry.block_size,
            "dtype": geometry.dtype,
            "attention_types": list(geometry.attention_types),
            "capture_encoding": meta.capture_encoding,
            "tp_size": meta.tp_size,
        },
        "sequences": [
            {
                "id": record.id,
                "num_tokens": len(record.token_ids),
                "num_blocks": len(record.block_ids),
                "shared_blocks": shared[record.id],
            }
            for record in snap.sequences
        ],
        "num_blocks": snap.num_blocks,
        "total_bytes": snap.kv_bytes,
        # Who signed it, as written (checking needs the key: kvsnap verify --key-file), and
        # what the signature binds: an encoded snapshot's is its encoded file's own.
        "signature": {
            "algorithm": snap.signature_algorithm,
            "key_ids": snap.signing_key_ids(),
            "page_binding": snap.page_binding,
            "binding": _BINDINGS.get(snap.signature_algorithm),
        },
        "encoding": encoding_summary(snap.encoded),
        **_parts_json(snap),
    }


def _parts_json(snap: Snapshot) -> dict[str, Any]:
    """``parts`` (a parted snapshot: its part files in head order) or ``part`` (one part file
    opened directly: which heads of the whole model it holds); nothing for other snapshots."""
    if snap.index is not None:
        return {
            "parts": [
                {"file": part.path, "first_head": part.first_head, "num_heads": part.num_heads}
                for part in snap.parts
            ]
        }
    part = snap.metadata.part
    if part is None:
        return {}
    return {
        "part": {
            "index": part.index,
            "count": part.count,
            "first_head": part.first_head,
            "num_heads": snap.geometry.num_kv_heads,
            "num_kv_heads": part.num_kv_heads,
        }
    }


def _format_row(payload: dict[str, Any]) -> str:
    """The snapshot's format version, and an encoded file's own with the version it decodes
    to (the JSON keeps both: ``format_version`` and ``encoding.format_version``)."""
    made_by = f"kvsnap {payload['kvsnap_version']}"
    encoding = payload["encoding"]
    if encoding["name"] == "none":
        return f"v{payload['format_version']} ({made_by})"
    return (
        f"v{encoding['format_version']}: a v{payload['format_version']} snapshot stored "
        f"{encoding['name']} ({made_by})"
    )


def _encoding_rows(encoding: dict[str, Any]) -> list[tuple[str, str]]:
    """The rows saying how the snapshot is stored: encoding, ratio, recorded error."""
    if encoding["name"] == "none":
        return [("encoding", "none (as captured)")]
    rows = [
        (
            "encoding",
            f"{encoding['name']} ({encoding['codec']}): "
            f"{encoding['ratio']:.2f}x smaller, {format_bytes(encoding['stored_bytes'])} for "
            f"{format_bytes(encoding['decoded_bytes'])}",
        )
    ]
    if encoding["error"] is not None:
        rows.append(("error", error_line(encoding["error"]["worst"])))
    elif encoding["name"] == "lossless":
        rows.append(("error", "none: decodes bit for bit (checked by the original's checksums)"))
    return rows


def _part_rows(payload: dict[str, Any]) -> list[tuple[str, str]]:
    """The rows of the metadata table saying how the snapshot is parted, if it is."""
    if "part" in payload:
        part = payload["part"]
        end = part["first_head"] + part["num_heads"]
        return [
            (
                "part",
                f"part {part['index']} of {part['count']} (heads {part['first_head']}..{end} "
                f"of {part['num_kv_heads']})",
            )
        ]
    rows = []
    for number, part in enumerate(payload.get("parts", ()), start=1):
        end = part["first_head"] + part["num_heads"]
        name = os.path.basename(part["file"])
        rows.append((f"part {number}", f"heads {part['first_head']}..{end}: {name}"))
    return rows


def _metadata_table(payload: dict[str, Any]) -> Table:
    layout = payload["layout"]
    model = payload["model"]
    table = Table(title=Text(payload["path"]), show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    heads = (
        f"latent {layout['latent_dim']}"
        if layout["latent_dim"]
        else f"{layout['num_kv_heads']} KV heads x {layout['head_dim']}"
    )
    rows = [
        ("format", _format_row(payload)),
        ("created", payload["created"] or "(reproducible)"),
        ("model", f"{model['id']} ({model['engine']} {model['engine_version']})"),
        ("fingerprint", str(model["fingerprint"])[:16]),
        ("layout", f"{layout['num_layers']} layers, {heads}, {layout['block_size']} tokens/block"),
        ("dtype", layout["dtype"]),
        ("captured from", f"{layout['capture_encoding']}, TP {layout['tp_size']}"),
        ("blocks", f"{payload['num_blocks']} ({format_bytes(payload['total_bytes'])})"),
        ("signature", _signature_row(payload["signature"])),
        *_part_rows(payload),
        *_encoding_rows(payload["encoding"]),
    ]
    for key, value in rows:
        table.add_row(key, Text(str(value)))
    return table


#: What each signature algorithm binds, as inspect says it.
_BINDINGS = {
    SIGNATURE_ALGORITHM: "pages bound by BLAKE3",
    SIGNATURE_ALGORITHM_V1: "pages bound by xxh3-64 only: not collision-resistant",
    ENCODED_SIGNATURE_ALGORITHM: "the encoded file's every stored tensor bound by BLAKE3",
    PAGES_SIGNATURE_ALGORITHM: (
        "the encoded file's fp8 pages bound by signed BLAKE3 digests, its other tensors by BLAKE3"
    ),
}


def _signature_row(signature: dict[str, Any]) -> str:
    if signature["algorithm"] is None:
        return "unsigned"
    keys = ", ".join(sorted({key_id[:16] for key_id in signature["key_ids"] if key_id}))
    binding = signature["binding"]
    return f"{signature['algorithm']} by key {keys}, {binding} (check it: verify --key-file)"


def _print_inspect(payload: dict[str, Any]) -> None:
    stdout.print(_metadata_table(payload))
    sequences = Table(title="sequences", title_justify="left")
    for column in ("id", "tokens", "blocks", "shared blocks"):
        sequences.add_column(column, justify="right" if column != "id" else "left")
    for record in payload["sequences"]:
        sequences.add_row(
            Text(record["id"]),
            str(record["num_tokens"]),
            str(record["num_blocks"]),
            str(record["shared_blocks"]),
        )
    stdout.print(sequences)
    for record in payload["sequences"]:
        if "text" in record:
            stdout.print(f"[bold]{text(record['id'])}[/]: {text(repr(record['text']))}")
    if "stats" in payload:
        stats = Table(title="statistics (real tokens only)", title_justify="left")
        for column in ("tensor", "absmax", "mean", "std", "NaN", "Inf"):
            stats.add_column(column, justify="right" if column != "tensor" else "left")
        for name, values in payload["stats"].items():
            stats.add_row(
                Text(name),
                f"{values['absmax']:.4g}",
                f"{values['mean']:.4g}",
                f"{values['std']:.4g}",
                str(values["nan"]),
                str(values["inf"]),
            )
        stdout.print(stats)
    if "plot" in payload:
        stdout.print(f"plot written to {text(payload['plot'])}")
