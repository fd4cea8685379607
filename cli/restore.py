"""``kvsnap restore``: restore every sequence into a fresh cache of the model, then continue
greedy generation (``--check``: and compare with generation without the snapshot)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.text import Text

from . import models
from .common import (
    BackendOption,
    DeviceOption,
    JsonOption,
    KeyFileOption,
    ModelOption,
    SnapshotArgument,
    format_bytes,
    key_ring,
    snapshot_location,
)
from .output import EXIT_VERIFY_FAILED, emit_json, progress_bar, stdout

if TYPE_CHECKING:
    from kvsnap.snapshot import Snapshot


def restore(
    snapshot: SnapshotArgument,
    model: ModelOption = None,
    device: DeviceOption = "cpu",
    max_new_tokens: Annotated[
        int,
        typer.Option(
            "--max-new-tokens", min=0, help="Tokens to generate after the restored prefix."
        ),
    ] = 16,
    check: Annotated[
        bool,
        typer.Option(
            "--check", help="Also generate without the snapshot; exit 1 unless the tokens match."
        ),
    ] = False,
    force: Annotated[
        bool, typer.Option("--force", help="Restore even if the model fingerprint differs.")
    ] = False,
    backend: BackendOption = "auto",
    key_file: KeyFileOption = None,
    as_json: JsonOption = False,
) -> None:
    """Restore every sequence into a fresh cache of the model and continue generation (with
    --key-file, only a snapshot signed by one of the keys)."""
    from kvsnap.snapshot import Snapshot

    location = snapshot_location(snapshot)
    keys = key_ring(key_file)
    engine = models.transformers_engine("restore")
    models.check_device(device)
    models.check_backend(backend, device)
    with Snapshot.open(location, keys=keys) as snap:
        loaded = models.load(model, dtype=_model_dtype(snap), device=device, quiet=as_json)
        # Refuse before anything is allocated or written, naming both sides.
        models.check_fits(engine, snap, loaded, force=force, command="restore")
        started = time.perf_counter()
        restored = []
        with progress_bar("restore", enabled=not as_json) as progress:
            for record in snap.sequences:
                cache, token_ids = engine.restore_dynamic_cache(
                    snap, sequence_id=record.id, device=device, backend=backend, progress=progress
                )
                restored.append((record.id, cache, token_ids))
        seconds = time.perf_counter() - started
        blocks = sum(len(record.block_ids) for record in snap.sequences)
        total_bytes = blocks * snap.geometry.bytes_per_block
    continuations, check_result = _continue(engine, loaded, restored, max_new_tokens, check)
    payload = {
        "sequences": len(restored),
        "bytes": total_bytes,
        "seconds": round(seconds, 6),
        "continuations": continuations,
        "check": check_result,
    }
    if as_json:
        emit_json(payload)
    else:
        _print_restore(payload)
    if check_result == "mismatch":
        raise typer.Exit(EXIT_VERIFY_FAILED)


def _model_dtype(snap: Snapshot) -> Any:
    """The model dtype that matches the snapshot's KV (float32 for a KV dtype no model runs in:
    the fit check then names the difference)."""
    name = snap.geometry.dtype
    return models.torch_dtype(name if name in models.MODEL_DTYPES else "float32")


def _continue(
    engine: Any, loaded: Any, restored: list[tuple[str, Any, Any]], max_new_tokens: int, check: bool
) -> tuple[dict[str, str], str | None]:
    """Greedy continuation of each restored sequence; with ``check``, ``"match"`` when each
    equals generation from scratch, else ``"mismatch"`` (``None`` without ``check``)."""
    continuations: dict[str, str] = {}
    matched = True
    for sequence_id, cache, token_ids in restored:
        continued = engine.continue_generation(loaded, cache, token_ids, max_new_tokens)
        continuations[sequence_id] = loaded.decode(continued)
        if check:
            matched &= engine.generate_greedy(loaded, token_ids, max_new_tokens) == continued
    if not check:
        return continuations, None
    return continuations, "match" if matched else "mismatch"


def _print_restore(payload: dict[str, Any]) -> None:
    stdout.print(
        f"restored {payload['sequences']} sequence(s), {format_bytes(payload['bytes'])} "
        f"in {payload['seconds']:.3f} s"
    )
    for sequence_id, continuation in payload["continuations"].items():
        line = Text()
        line.append(sequence_id, style="bold")
        line.append(f" → {continuation!r}")
        stdout.print(line)
    if payload["check"] is not None:
        colour = "green" if payload["check"] == "match" else "red"
        stdout.print(
            f"check: [bold {colour}]{payload['check']}[/] (generation without the snapshot)"
        )
