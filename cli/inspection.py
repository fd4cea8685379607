"""``kvsnap inspect``: a snapshot's metadata and sequences, optionally statistics and a plot."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table
from rich.text import Text

from kvsnap.encoded.summary import encoding_summary, error_line

from .common import JsonOption, SnapshotArgument, format_bytes, snapshot_location
from .foreign_paths import inspect_foreign, is_foreign
from .output import UsageError, emit_json, stdout, text
from .plot import check_plot_path, plot_norms

if TYPE_CHECKING:
    from kvsnap.snapshot import Snapshot


def inspect(
    snapshot: SnapshotArgument,
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
    as_json: JsonOption = False,
) -> None:
    """Show a snapshot's metadata and sequences (and optionally statistics and a plot)."""
    if is_foreign(snapshot):
        unsupported = {"--stats": stats, "--plot": plot is not None, "--sequence": bool(sequence)}
        return inspect_foreign(snapshot, as_json=as_json, unsupported=unsupported)
    from kvsnap.snapshot import Snapshot

    location = snapshot_location(snapshot)
    if sequence is not None and plot is None:
        raise UsageError("--sequence chooses the sequence of --plot: add --plot FILE")
    if plot is not None:
        check_plot_path(plot)
    with Snapshot.open(location) as snap:
        payload = describe(snap)
        if stats:
            names = snap.geometry.tensor_names()
            payload["stats"] = {name: snap.tensor_stats(name) for name in names}
        if plot is not None:
            payload["plot"] = plot_norms(snap, plot, sequence_id=sequence)
    if as_json:
        emit_json(payload)
        return
    _print_inspect(payload)


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
        # how the signature binds the pages.
        "signature": {
            "algorithm": meta.signature,
            "key_ids": snap.signing_key_ids(),
            "page_binding": snap.page_binding,
            "binding": _BINDINGS.get(snap.page_binding),
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


def _encoding_rows(encoding: dict[str, Any]) -> list[tuple[str, str]]:
    """The rows saying how the snapshot is stored: encoding, ratio, recorded error."""
    if encoding["name"] == "none":
        return [("encoding", "none (as captured)")]
    rows = [
        (
            "encoding",
            f"{encoding['name']} ({encoding['codec']}, format v{encoding['format_version']}): "
            f"{encoding['ratio']:.2f}x smaller, {format_bytes(encoding['stored_bytes'])} for "
            f"{format_bytes(encoding['decoded_bytes'])}",
        )
    ]
    if encoding["error"] is not None:
        rows.append(("error", error_line(encoding["error"]["worst"])))
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
        ("format", f"v{payload['format_version']} (kvsnap {payload['kvsnap_version']})"),
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


#: What each page binding means, as inspect says it.
_BINDINGS = {
    "blake3": "pages bound by BLAKE3",
    "xxh3-64": "pages bound by xxh3-64 only: not collision-resistant",
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
