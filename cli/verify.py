"""``kvsnap verify``: structure and checksums; optionally compared with a reference snapshot
(``--against``) or with a fresh prefill of its token ids (``--recompute``)."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from kvsnap.encoded.summary import error_line
from kvsnap.errors import (
    NotASnapshotError,
    SignatureError,
    SnapshotCorruptError,
    UnsignedSnapshotError,
)

from . import models
from .common import (
    DeviceOption,
    JsonOption,
    KeyFileOption,
    ModelOption,
    SnapshotArgument,
    key_ring,
    snapshot_location,
)
from .foreign_paths import is_foreign, verify_foreign
from .output import EXIT_VERIFY_FAILED, UsageError, emit_json, progress_bar, stdout, text

if TYPE_CHECKING:
    from kvsnap.analysis import Comparison
    from kvsnap.format.signing import KeyRing
    from kvsnap.snapshot import Snapshot


def verify(
    snapshot: SnapshotArgument,
    against: Annotated[
        str | None,
        typer.Option(
            "--against", metavar="REF", help="Compare numerically with this reference snapshot."
        ),
    ] = None,
    atol: Annotated[
        float, typer.Option("--atol", min=0.0, help="Absolute tolerance for --against.")
    ] = 0.0,
    rtol: Annotated[
        float, typer.Option("--rtol", min=0.0, help="Relative tolerance for --against.")
    ] = 0.0,
    recompute: Annotated[
        bool,
        typer.Option(
            "--recompute", help="Rerun prefill on the model and compare with the snapshot."
        ),
    ] = False,
    model: ModelOption = None,
    device: DeviceOption = "cpu",
    key_file: KeyFileOption = None,
    as_json: JsonOption = False,
) -> None:
    """Check structure and every checksum (and, with --key-file, the signature); optionally
    compare with another snapshot or prefill."""
    if is_foreign(snapshot):
        unsupported = {
            "--against": against is not None,
            "--recompute": recompute,
            "--key-file": bool(key_file),
        }
        return verify_foreign(snapshot, as_json=as_json, unsupported=unsupported)
    from kvsnap.snapshot import Snapshot

    location = snapshot_location(snapshot)
    keys = key_ring(key_file)
    reference = None if against is None else snapshot_location(against)
    engine = models.transformers_engine("verify --recompute") if recompute else None
    if recompute:
        models.check_device(device)
    problems: list[dict[str, Any]] = []
    comparison: Comparison | None = None
    measured: dict[str, Any] | None = None
    check = _SignatureCheck(keys)
    try:
        with _open_checked(location, check) as snap:
            with progress_bar("verify", enabled=not as_json) as progress:
                problems += [_problem(problem) for problem in snap.verify(progress=progress)]
            problems[:0] = check.refused
            if not problems and reference is not None:
                with Snapshot.open(reference) as other:
                    if _is_lossy(snap) and not (atol or rtol):
                        measured = _measured_error(snap, other)
                        problems += measured.pop("problems")
                    else:
                        comparison = snap.compare(other, atol=atol, rtol=rtol)
            if not problems and engine is not None:
                comparison = _recompute(engine, snap, model, device, atol, rtol, quiet=as_json)
    except (SnapshotCorruptError, NotASnapshotError) as error:
        problems[:0] = check.refused  # a file refused by its signature, then found damaged
        problems.append({"tensor": error.tensor, "block": error.block, "message": str(error)})
    if comparison is not None:
        problems += _comparison_problems(comparison)
    _report(problems, comparison, as_json=as_json, signature=check.verdict, error=measured)
    if problems:
        raise typer.Exit(EXIT_VERIFY_FAILED)


def _report(
    problems: list[dict[str, Any]],
    comparison: Comparison | None,
    *,
    as_json: bool,
    signature: str | None,
    error: dict[str, Any] | None = None,
) -> None:
    """Print the outcome: each problem once, after the per-tensor comparison table."""
    notes = [] if comparison is None else comparison.notes
    if as_json:
        emit_json(
            {
                "ok": not problems,
                "problems": problems,
                **({"signature": signature} if signature is not None else {}),
                **({"notes": notes} if notes else {}),
                **({"error": error} if error is not None else {}),
            }
        )
        return
    if signature is not None:
        stdout.print(f"signature: {signature}")
    if error is not None:
        if error["measured"] is not None:
            stdout.print(f"error measured against the reference: {error_line(error['measured'])}")
        stdout.print(f"error recorded in the file: {error_line(error['recorded'])}")
    for note in notes:
        stdout.print(f"[yellow]note:[/] {text(note)}")
    if comparison is not None:
        for line in comparison.layer_lines():
            stdout.print(text(line))
    for problem in problems:
        stdout.print(f"[red]problem:[/] {text(problem['message'])}")
    if problems:
        stdout.print(f"[bold red]FAILED[/] ({len(problems)} problem(s))")
    else:
        stdout.print("[bold green]OK[/]")


class _SignatureCheck:
    """What ``--key-file`` found: ``verdict`` (``None`` without keys; else ``valid``,
    ``unsigned``, ``bad signature``, or ``unchecked``: the file did not open) and the
    signature problems, one per file the keys do not vouch for."""

    def __init__(self, keys: KeyRing | None) -> None:
        self.keys = keys
        self.verdict: str | None = None if keys is None else "unchecked"
        self.refused: list[dict[str, Any]] = []

    def refuse(self, errors: list[SignatureError]) -> None:
        self.refused = [_signature_problem(error) for error in errors]
        self.verdict = self.refused[0]["kind"]


@contextlib.contextmanager
def _open_checked(location: str, check: _SignatureCheck) -> Iterator[Snapshot]:
    """The snapshot at ``location`` opened with ``check``'s keys: its signature checked, and
    every page verified later against what the signature binds (a page changed after signing
    is named by its BLAKE3 digest). When the keys do not vouch for it, opened without them
    (its checksums are still verified), ``check`` noting why, file by file."""
    from kvsnap.snapshot import Snapshot

    try:
        snap = Snapshot.open(location, keys=check.keys)
    except SignatureError as error:
        check.refuse([error])  # stands if the file does not even open without the keys
        snap = Snapshot.open(location)
        assert check.keys is not None
        check.refuse(snap.signature_problems(check.keys) or [error])
    else:
        if check.keys is not None:
            check.verdict = "valid"
    with snap:
        yield snap


def _is_lossy(snap: Snapshot) -> bool:
    """Whether ``snap`` was stored with a lossy encoding (fp8): compared by its error."""
    return snap.encoded is not None and snap.encoded.error is not None


def _measured_error(snap: Snapshot, reference: Snapshot) -> dict[str, Any]:
    """An fp8 snapshot's error measured again against ``reference`` (the snapshot it was made
    from): ``measured`` and ``recorded`` worst values, and a problem when the reference holds
    other blocks or the file's report is not what the two files give."""
    from kvsnap.encoded.summary import measured_error, reports_agree

    assert snap.encoded is not None and snap.encoded.error is not None
    recorded = snap.encoded.error
    result: dict[str, Any] = {"recorded": recorded.worst, "measured": None, "problems": []}
    same_blocks = snap.num_blocks == reference.num_blocks and [
        (r.id, r.token_ids.tolist(), r.block_ids.tolist()) for r in snap.sequences
    ] == [(r.id, r.token_ids.tolist(), r.block_ids.tolist()) for r in reference.sequences]
    if not same_blocks or snap.geometry != reference.geometry:
        message = "the reference holds other sequences, blocks or geometry than the snapshot"
        result["problems"].append({"tensor": None, "block": None, "message": message})
        return result
    names = snap.geometry.tensor_names()
    # As recorded: rounded to 6 significant digits.
    measured = type(recorded).from_dict(
        measured_error(snap, reference, names, recorded.encoding).to_dict()
    )
    result["measured"] = measured.worst
    if not reports_agree(measured.to_dict(), recorded.to_dict()):
        message = "the error recorded in the file is not the error measured against the reference"
        result["problems"].append({"tensor": None, "block": None, "message": message})
    return result


def _signature_problem(error: SignatureError) -> dict[str, Any]:
    """A file the keys do not vouch for, as a problem of its own kind (not corruption)."""
    kind = "unsigned" if isinstance(error, UnsignedSnapshotError) else "bad signature"
    return {"tensor": None, "block": None, "message": str(error), "kind": kind}


def _problem(problem: Any) -> dict[str, Any]:
    return {"tensor": problem.tensor, "block": problem.block, "message": problem.message}


def _comparison_problems(comparison: Comparison) -> list[dict[str, Any]]:
    """The structural problems, then one problem per tensor with mismatching elements."""
    problems = [_problem(problem) for problem in comparison.problems]
    for layer in comparison.layers:
        if layer.num_mismatches:
            where = layer.first_mismatch or {}
            problems.append(
                {
                    "tensor": layer.tensor,
                    "block": None,
                    "message": (
                        f"{layer.tensor}: {layer.num_mismatches} element(s) differ, max |diff| "
                        f"{layer.max_abs_diff:.6g}; first at sequence {where.get('sequence')!r}, "
                        f"token {where.get('token')}, head {where.get('head')}"
                    ),
                    "max_abs_diff": layer.max_abs_diff,
                    "first_mismatch": where,
                }
            )
    return problems


def _recompute(
    engine: Any,
    snap: Snapshot,
    model: str | None,
    device: str,
    atol: float,
    rtol: float,
    *,
    quiet: bool,
) -> Comparison:
    """Prefill ``snap``'s token ids on the model, capture that, and compare it with ``snap``."""
    from kvsnap.snapshot import Snapshot

    kv_dtype = snap.geometry.dtype
    if kv_dtype not in models.MODEL_DTYPES:
        raise UsageError(
            f"--recompute runs the model in the snapshot's KV dtype, and {kv_dtype} is not a "
            f"model dtype ({', '.join(models.MODEL_DTYPES)}); {models.snapshot_model_hint(snap)}"
        )
    loaded = models.load(model, dtype=models.torch_dtype(kv_dtype), device=device, quiet=quiet)
    models.check_fits(engine, snap, loaded, force=False)
    prefilled = engine.prefill_token_ids(loaded, [record.token_ids for record in snap.sequences])
    with tempfile.TemporaryDirectory(prefix="kvsnap-recompute-") as scratch:
        fresh_path = Path(scratch) / "recomputed.safetensors"
        engine.capture_dynamic_caches(
            prefilled,
            fresh_path,
            model=loaded,
            block_size=snap.geometry.block_size,
            sequence_ids=[record.id for record in snap.sequences],
        )
        with Snapshot.open(fresh_path) as fresh:
            return snap.compare(fresh, atol=atol, rtol=rtol)
