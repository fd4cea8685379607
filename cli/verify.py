"""``kvsnap verify``: structure and checksums; optionally compared with a reference snapshot
(``--against``) or with a fresh prefill of its token ids (``--recompute``)."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
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
    key_ring,
    snapshot_location,
)
from .comparison_output import TopOption, print_report
from .foreign_paths import is_foreign, verify_foreign
from .output import (
    EXIT_VERIFY_FAILED,
    UsageError,
    emit_json,
    progress_bar,
    status,
    stdout,
    text,
)

if TYPE_CHECKING:
    from kvsnap.analysis import Comparison
    from kvsnap.format.signing import KeyRing
    from kvsnap.snapshot import Snapshot


SnapshotsArgument = Annotated[
    list[str],
    typer.Argument(metavar="SNAPSHOT...", help="Snapshot files or URLs to check (one or more)."),
]


_AgainstOption = Annotated[
    str | None,
    typer.Option(
        "--against",
        metavar="REF",
        help="Compare numerically with this reference snapshot (the report of kvsnap diff).",
    ),
]

#: Unlike diff's, verify's tolerances default to None: an fp8 snapshot given --against is
#: measured by its error unless a tolerance is given, and --atol 0 is a tolerance (exact).
_AtolOption = Annotated[
    float | None,
    typer.Option(
        "--atol",
        min=0.0,
        show_default="0",
        help="Absolute tolerance: |a - b| <= atol + rtol*|b|.",
    ),
]
_RtolOption = Annotated[
    float | None,
    typer.Option(
        "--rtol",
        min=0.0,
        show_default="0",
        help="Relative tolerance: |a - b| <= atol + rtol*|b|.",
    ),
]

_RecomputeOption = Annotated[
    bool,
    typer.Option("--recompute", help="Rerun prefill on the model and compare with the snapshot."),
]


def verify(
    snapshot: SnapshotsArgument,
    against: _AgainstOption = None,
    atol: _AtolOption = None,
    rtol: _RtolOption = None,
    top: TopOption = 10,
    recompute: _RecomputeOption = False,
    model: ModelOption = None,
    device: DeviceOption = "cpu",
    key_file: KeyFileOption = None,
    as_json: JsonOption = False,
) -> None:
    """Check snapshots' structure and every checksum, or compare one with another.

    With --key-file also the signature; --against compares with a reference snapshot (the
    report of kvsnap diff), --recompute with a fresh prefill of its tokens."""
    if len(snapshot) == 1 and is_foreign(snapshot[0]):
        unsupported = {
            "--against": against is not None,
            "--recompute": recompute,
            "--key-file": bool(key_file),
        }
        return verify_foreign(snapshot[0], as_json=as_json, unsupported=unsupported)
    for location in snapshot:
        if is_foreign(location):
            raise UsageError(
                f"{location}: another engine's files are verified one at a time: "
                f"kvsnap verify {location}"
            )
    locations = [snapshot_location(location) for location in snapshot]
    check = _Check(
        reference=None if against is None else snapshot_location(against),
        keys=key_ring(key_file),
        engine=models.transformers_engine("verify --recompute") if recompute else None,
        model=model,
        device=models.check_device(device) if recompute else device,
        atol=atol,
        rtol=rtol,
        top=top,
        quiet=as_json,
    )
    results = []
    for location in locations:
        if len(locations) > 1 and not as_json:
            stdout.print(f"[bold]{text(location)}[/]")
        results.append(check.run(location))
    failed = [result for result in results if not result["ok"]]
    if as_json:
        if len(results) == 1:
            emit_json({key: value for key, value in results[0].items() if key != "path"})
        else:
            emit_json({"ok": not failed, "files": results})
    elif len(results) > 1:
        colour, word = ("red", "FAILED") if failed else ("green", "OK")
        stdout.print(f"[bold {colour}]{word}[/]: {len(results) - len(failed)} of {len(results)} ok")
    if failed:
        raise typer.Exit(EXIT_VERIFY_FAILED)


@dataclass
class _Check:
    """What ``verify`` checks in each snapshot it is given."""

    reference: str | None
    keys: KeyRing | None
    engine: Any
    model: str | None
    device: str
    #: ``None``: not given (0 where a comparison needs one).
    atol: float | None
    rtol: float | None
    top: int
    quiet: bool

    @property
    def tolerances(self) -> dict[str, float]:
        return {"atol": self.atol or 0.0, "rtol": self.rtol or 0.0}

    def run(self, location: str) -> dict[str, Any]:
        """Check the snapshot at ``location``, print the outcome (unless ``--json``) and
        return its JSON object."""
        problems: list[dict[str, Any]] = []
        notes: list[str] = []
        comparison: Comparison | None = None
        measured: dict[str, Any] | None = None
        check = _SignatureCheck(self.keys)
        try:
            with _open_checked(location, check) as snap:
                with progress_bar("verify", enabled=not self.quiet) as progress:
                    problems += [_problem(problem) for problem in snap.verify(progress=progress)]
                problems[:0] = check.refused
                if not problems and self._measures_error(snap):
                    measured = self._measured(snap)
                    problems += measured.pop("problems")
                    notes += measured.pop("notes")
                elif not problems:
                    comparison = self._compare(snap)
        except (SnapshotCorruptError, NotASnapshotError) as error:
            problems[:0] = check.refused  # a file refused by its signature, then found damaged
            problems.append({"tensor": error.tensor, "block": error.block, "message": str(error)})
        signature = check.verdict
        if not self.quiet:
            _print(problems, comparison, signature, self.top, error=measured, notes=notes)
        if comparison is not None:
            problems += _comparison_problems(comparison)
            notes += comparison.notes
        return {
            "path": location,
            "ok": not problems,
            "problems": problems,
            **({"signature": signature} if signature is not None else {}),
            **({"notes": notes} if notes else {}),
            **({"comparison": comparison.to_dict()} if comparison else {}),
            **({"error": measured} if measured is not None else {}),
        }

    def _measures_error(self, snap: Snapshot) -> bool:
        """Whether ``--against`` checks ``snap``'s recorded error rather than comparing it
        element by element: a lossy (fp8) snapshot, no tolerance given (``--atol 0`` is one:
        an exact comparison)."""
        given = self.atol is not None or self.rtol is not None
        return self.reference is not None and _is_lossy(snap) and not given

    def _measured(self, snap: Snapshot) -> dict[str, Any]:
        from kvsnap.snapshot import Snapshot

        assert self.reference is not None
        with Snapshot.open(self.reference) as other:
            return _measured_error(snap, other)

    def _compare(self, snap: Snapshot) -> Comparison | None:
        from kvsnap.snapshot import Snapshot

        if self.reference is not None:
            with Snapshot.open(self.reference) as other:
                with progress_bar("comparing", enabled=not self.quiet) as progress:
                    return snap.compare(other, **self.tolerances, top=self.top, progress=progress)
        if self.engine is not None:
            return _recompute(self, snap)
        return None


def _print(
    problems: list[dict[str, Any]],
    comparison: Comparison | None,
    signature: str | None,
    top: int,
    *,
    error: dict[str, Any] | None = None,
    notes: Sequence[str] = (),
) -> None:
    """The outcome for people: the signature, an fp8 snapshot's error (measured against the
    reference, and as recorded, with ``notes`` on how), each verification problem once, the
    comparison's report (its structural problems, mismatches and notes are in it), a verdict."""
    if signature is not None:
        stdout.print(f"signature: {signature}")
    if error is not None:
        if error["measured"] is not None:
            stdout.print(f"error measured against the reference: {error_line(error['measured'])}")
        stdout.print(f"error recorded in the file: {error_line(error['recorded'])}")
        for note in notes:
            stdout.print(f"[yellow]note:[/] {text(note)}")
    for problem in problems:
        stdout.print(f"[red]problem:[/] {text(problem['message'])}")
    if comparison is not None:
        print_report(comparison, top=top, verdict=False)
        stdout.print()
    failures = len(problems) + (0 if comparison is None else len(_comparison_problems(comparison)))
    if failures:
        stdout.print(f"[bold red]FAILED[/] ({failures} problem(s))")
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
    from): ``measured`` and ``recorded`` worst values, and a problem when it cannot be
    measured (:func:`_unmeasurable`) or the file's report is not what the two files give. A
    reference of another dtype is measured against in float64, as every error is (each value
    of either dtype held exactly), the recorded error (against the pages the file was encoded
    from) left unchecked, which ``notes`` says."""
    from kvsnap.encoded.summary import measured_error, reports_agree

    assert snap.encoded is not None and snap.encoded.error is not None
    recorded = snap.encoded.error
    result: dict[str, Any] = {
        "recorded": recorded.worst,
        "measured": None,
        "problems": [],
        "notes": [],
    }
    refused = _unmeasurable(snap, reference)
    if refused is not None:
        result["problems"].append({"tensor": None, "block": None, "message": refused})
        return result
    names = snap.geometry.tensor_names()
    # As recorded: rounded to 6 significant digits.
    measured = type(recorded).from_dict(
        measured_error(snap, reference, names, recorded.encoding).to_dict()
    )
    result["measured"] = measured.worst
    mine, theirs = snap.geometry.dtype, reference.geometry.dtype
    if mine != theirs:
        result["notes"].append(
            f"dtype: {mine} (the snapshot) vs {theirs} (the reference): the error measured in "
            f"float64 against the {theirs} reference; the recorded error, measured against the "
            f"{mine} pages the file was encoded from, is not checked against it"
        )
    elif not reports_agree(measured.to_dict(), recorded.to_dict()):
        message = "the error recorded in the file is not the error measured against the reference"
        result["problems"].append({"tensor": None, "block": None, "message": message})
    return result


#: What a refusal to measure an fp8 snapshot's error against a reference points to instead.
_COMPARE_INSTEAD = (
    "its error is measured block by block against the same blocks; give --atol or --rtol to "
    "compare the sequences token by token (as kvsnap diff does)"
)


def _unmeasurable(snap: Snapshot, reference: Snapshot) -> str | None:
    """Why an fp8 snapshot's error cannot be measured against ``reference``, naming the first
    difference (``None``: it can; the dtypes may differ)."""
    from kvsnap.analysis.pairing import geometry_problem

    shape = geometry_problem(snap, reference)
    if shape is not None:
        return shape.message
    mine, theirs = snap.geometry.block_size, reference.geometry.block_size
    if mine != theirs:
        return f"block size: {mine} (the snapshot) vs {theirs} (the reference): {_COMPARE_INSTEAD}"
    ids = [record.id for record in snap.sequences]
    other_ids = [record.id for record in reference.sequences]
    if ids != other_ids:
        return f"sequences: {ids} (the snapshot) vs {other_ids} (the reference): {_COMPARE_INSTEAD}"
    for what in ("token_ids", "block_ids"):
        for one, other in zip(snap.sequences, reference.sequences, strict=True):
            if getattr(one, what).tolist() != getattr(other, what).tolist():
                return (
                    f"sequence {one.id!r}: its {what.replace('_', ' ')} differ in the "
                    f"reference: {_COMPARE_INSTEAD}"
                )
    if snap.num_blocks != reference.num_blocks:
        return (
            f"the snapshot holds {snap.num_blocks} blocks, the reference {reference.num_blocks}: "
            f"{_COMPARE_INSTEAD}"
        )
    return None


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
                        f"{layer.tensor}: {layer.num_mismatches} of {layer.num_elements} "
                        f"element(s) beyond the tolerance ({100 * layer.share:.3g}%), max |diff| "
                        f"{layer.max_abs_diff:.6g}; first at sequence {where.get('sequence')!r}, "
                        f"token {where.get('token')}, head {where.get('head')}, channel "
                        f"{where.get('channel')}"
                    ),
                    "max_abs_diff": layer.max_abs_diff,
                    "first_mismatch": where,
                }
            )
    return problems


def _recompute(check: _Check, snap: Snapshot) -> Comparison:
    """Prefill ``snap``'s token ids on the model, capture that, and compare it with ``snap``."""
    from kvsnap.snapshot import Snapshot

    engine = check.engine
    kv_dtype = snap.geometry.dtype
    if kv_dtype not in models.MODEL_DTYPES:
        raise UsageError(
            f"--recompute runs the model in the snapshot's KV dtype, and {kv_dtype} is not a "
            f"model dtype ({', '.join(models.MODEL_DTYPES)}); {models.snapshot_model_hint(snap)}"
        )
    with status(f"loading the model ({check.model or 'built-in'})", enabled=not check.quiet):
        loaded = models.load(
            check.model, dtype=models.torch_dtype(kv_dtype), device=check.device, quiet=check.quiet
        )
    models.check_fits(engine, snap, loaded, force=False, command="verify --recompute")
    token_lists = [record.token_ids for record in snap.sequences]
    with status(f"prefill of {len(token_lists)} sequence(s)", enabled=not check.quiet):
        prefilled = engine.prefill_token_ids(loaded, token_lists)
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
            return snap.compare(fresh, **check.tolerances, top=check.top)
