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
from .output import (
    EXIT_VERIFY_FAILED,
    UsageError,
    emit_json,
    progress_bar,
    status,
    stderr,
    stdout,
    step_progress,
    text,
)
from .prompts import position_warning

if TYPE_CHECKING:
    from kvsnap.snapshot import Snapshot


def restore(
    snapshot: SnapshotArgument,
    model: ModelOption = None,
    device: DeviceOption = "cpu",
    prompt: Annotated[
        str | None,
        typer.Option(
            "--prompt",
            "-p",
            metavar="TEXT",
            help="A follow-up to run after each restored prefix before generating.",
        ),
    ] = None,
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
        bool,
        typer.Option(
            "--force",
            help="Restore even if the model fingerprint differs, or past the model's positions.",
        ),
    ] = False,
    backend: BackendOption = "auto",
    key_file: KeyFileOption = None,
    as_json: JsonOption = False,
) -> None:
    """Restore every sequence into a fresh cache of the model and continue generation.

    With --prompt a follow-up runs after each restored prefix first; --check compares with
    generation without the snapshot; with --key-file only a snapshot signed by one of the
    keys is restored."""
    from kvsnap.snapshot import Snapshot

    location = snapshot_location(snapshot)
    keys = key_ring(key_file)
    if prompt is not None and not prompt.strip():
        raise UsageError("--prompt: a follow-up must not be empty")
    engine = models.transformers_engine("restore")
    models.check_device(device)
    models.check_backend(backend, device)
    with Snapshot.open(location, keys=keys) as snap:
        with status(f"loading the model ({model or 'built-in'})", enabled=not as_json):
            loaded = models.load(model, dtype=_model_dtype(snap), device=device, quiet=as_json)
        # Refuse before anything is allocated or written, naming both sides.
        models.check_fits(engine, snap, loaded, force=force, command="restore")
        follow_up = [] if prompt is None else _follow_up(loaded, prompt)
        lengths = [len(r.token_ids) + len(follow_up) + max_new_tokens for r in snap.sequences]
        warning = position_warning(loaded, lengths, force=force, what="a restored sequence")
        if warning is not None and not as_json:
            stderr.print(f"[yellow]warning:[/] {text(warning)}")
        started = time.perf_counter()
        restored = _restore_all(engine, snap, device, backend, quiet=as_json)
        seconds = time.perf_counter() - started
        blocks = sum(len(record.block_ids) for record in snap.sequences)
        total_bytes = blocks * snap.geometry.bytes_per_block
    run = _Generation(engine, loaded, follow_up, max_new_tokens, check)
    continuations, check_result, mismatches = run.all(restored, quiet=as_json)
    payload = {
        "sequences": len(restored),
        "bytes": total_bytes,
        "seconds": round(seconds, 6),
        **({"prompt": prompt} if prompt is not None else {}),
        "continuations": continuations,
        "check": check_result,
        **({"mismatches": mismatches} if mismatches else {}),
        **({"notes": notes} if (notes := [*loaded.notes, *([warning] if warning else [])]) else {}),
    }
    if as_json:
        emit_json(payload)
    else:
        _print_restore(payload)
    if check_result == "mismatch":
        raise typer.Exit(EXIT_VERIFY_FAILED)


def _follow_up(loaded: Any, prompt: str) -> list[int]:
    """The ``--prompt`` follow-up's token ids (no BOS: it continues the restored text)."""
    ids = loaded.encode_follow_up(prompt)
    from kvsnap.engines.default_model import prompt_problem

    problem = prompt_problem(loaded, prompt, ids)
    if problem is not None:
        raise UsageError(f"--prompt {prompt[:60]!r} {problem}")
    return ids


def _restore_all(
    engine: Any, snap: Snapshot, device: str, backend: str, *, quiet: bool
) -> list[tuple[str, Any, Any]]:
    """Every sequence restored into a fresh cache, on one byte bar for them all."""
    restored = []
    page_bytes = snap.geometry.bytes_per_block
    total = sum(len(record.block_ids) for record in snap.sequences) * page_bytes
    done = 0
    with progress_bar("restore", enabled=not quiet) as progress:
        for record in snap.sequences:
            cache, token_ids = engine.restore_dynamic_cache(
                snap,
                sequence_id=record.id,
                device=device,
                backend=backend,
                progress=lambda moved, _total, base=done: progress(min(base + moved, total), total),
            )
            done += len(record.block_ids) * page_bytes
            progress(done, total)
            restored.append((record.id, cache, token_ids))
    return restored


class _Generation:
    """Greedy continuation of restored sequences (after the follow-up, if any), and the check
    against generation without the snapshot, on one bar of steps."""

    def __init__(
        self,
        engine: Any,
        loaded: Any,
        follow_up: list[int],
        max_new_tokens: int,
        check: bool,
    ) -> None:
        self.engine, self.loaded = engine, loaded
        self.follow_up = follow_up
        self.max_new_tokens = max_new_tokens
        self.check = check

    def all(
        self, restored: list[tuple[str, Any, Any]], *, quiet: bool
    ) -> tuple[dict[str, str], str | None, list[dict[str, Any]]]:
        """Per sequence its continuation's text; ``"match"``/``"mismatch"`` (``None`` without
        ``--check``); and per mismatching sequence where it differs and what each produced."""
        continuations: dict[str, str] = {}
        mismatches: list[dict[str, Any]] = []
        steps = len(restored) * (2 if self.check else 1)
        with step_progress("generating", enabled=not quiet) as progress:
            for number, (sequence_id, cache, token_ids) in enumerate(restored):
                done = number * (2 if self.check else 1)
                progress(done, steps, f"sequence {sequence_id}")
                whole = [int(token) for token in token_ids] + self.follow_up
                continued = self.engine.continue_generation(
                    self.loaded, cache, whole, self.max_new_tokens
                )
                continuations[sequence_id] = self.loaded.decode(continued)
                if self.check:
                    progress(done + 1, steps, f"checking {sequence_id} without the snapshot")
                    reference = self.engine.generate_greedy(self.loaded, whole, self.max_new_tokens)
                    if reference != continued:
                        mismatches.append(self._mismatch(sequence_id, continued, reference))
            progress(steps, steps, "")
        if not self.check:
            return continuations, None, mismatches
        return continuations, ("mismatch" if mismatches else "match"), mismatches

    def _mismatch(self, sequence_id: str, restored: list[int], reference: list[int]) -> dict:
        first = next(
            (i for i, (a, b) in enumerate(zip(restored, reference, strict=False)) if a != b),
            min(len(restored), len(reference)),
        )
        return {
            "sequence": sequence_id,
            "first_differing_token": first,
            "restored": self.loaded.decode(restored),
            "reference": self.loaded.decode(reference),
            "restored_ids": restored,
            "reference_ids": reference,
        }


def _model_dtype(snap: Snapshot) -> Any:
    """The model dtype that matches the snapshot's KV (float32 for a KV dtype no model runs in:
    the fit check then names the difference)."""
    name = snap.geometry.dtype
    return models.torch_dtype(name if name in models.MODEL_DTYPES else "float32")


def _print_restore(payload: dict[str, Any]) -> None:
    stdout.print(
        f"restored {payload['sequences']} sequence(s), {format_bytes(payload['bytes'])} "
        f"in {payload['seconds']:.3f} s"
    )
    if "prompt" in payload:
        stdout.print(f"follow-up: {text(repr(payload['prompt']))}")
    for sequence_id, continuation in payload["continuations"].items():
        line = Text()
        line.append(sequence_id, style="bold")
        line.append(f" → {continuation!r}")
        stdout.print(line)
    if payload["check"] is None:
        return
    colour = "green" if payload["check"] == "match" else "red"
    stdout.print(f"check: [bold {colour}]{payload['check']}[/] (generation without the snapshot)")
    for mismatch in payload.get("mismatches", []):
        stdout.print(
            f"  sequence {text(mismatch['sequence'])}: generated token "
            f"{mismatch['first_differing_token']} differs; restored → "
            f"{text(repr(mismatch['restored']))}, without the snapshot → "
            f"{text(repr(mismatch['reference']))}"
        )
