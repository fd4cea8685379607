"""The ``kvsnap`` command line: capture, inspect, verify, restore, fixture, bench.

Every command is a thin client of the library: it parses options, calls :mod:`kvsnap`, and
formats the answer as rich tables (people) or one JSON object (``--json``, scripts).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from kvsnap import __version__
from kvsnap.pipeline import TransferOptions
from kvsnap.snapshot import Snapshot

from .bench import bench
from .fixture import fixture
from .output import (
    EXIT_VERIFY_FAILED,
    UsageError,
    emit_json,
    handle_errors,
    progress_bar,
    settings,
    stdout,
)

app = typer.Typer(
    name="kvsnap",
    help="Snapshot an LLM's KV cache to disk and restore it: fast, bit-exact, refusing cleanly.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

JsonOption = Annotated[
    bool, typer.Option("--json", help="Print one JSON object on stdout, nothing else.")
]
ModelOption = Annotated[
    str | None,
    typer.Option(
        "--model",
        "-m",
        help=(
            "A local transformers model directory or a cached hub id "
            "(default: the built-in tiny model)."
        ),
    ),
]
DeviceOption = Annotated[str, typer.Option("--device", help="torch device to run the model on.")]
DtypeOption = Annotated[
    str, typer.Option("--dtype", help="Model and KV dtype: float32, bfloat16, float16.")
]
#: What ``kvsnap capture`` runs when given no prompt.
DEFAULT_PROMPT = "kvsnap keeps the KV cache of this prompt, bit for bit, across restarts."

BackendOption = Annotated[
    str, typer.Option("--backend", help="Copy backend: auto, cuda-batch, triton, torch, cpu.")
]


def _version_callback(value: bool) -> None:
    if value:
        stdout.print(f"kvsnap {__version__}")
        raise typer.Exit()


@app.callback()
def main_options(
    debug: Annotated[
        bool, typer.Option("--debug", help="Show full tracebacks for errors.")
    ] = False,
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_version_callback, is_eager=True, help="Print the version."
        ),
    ] = False,
) -> None:
    """kvsnap: capture → inspect → verify → restore KV cache snapshots."""
    settings.debug = debug


def _require_snapshot_path(path: Path) -> str:
    text = str(path)
    if "://" not in text and not path.exists():
        raise UsageError(f"{path}: no such file")
    return text


# --------------------------------------------------------------------------------------------
# capture


@app.command()
@handle_errors
def capture(
    output: Annotated[Path, typer.Option("--output", "-o", help="Snapshot file to write.")],
    model: ModelOption = None,
    prompt: Annotated[
        list[str] | None,
        typer.Option("--prompt", "-p", help="A prompt (repeat for several sequences)."),
    ] = None,
    prompts_file: Annotated[
        Path | None, typer.Option("--prompts-file", help="A file with one prompt per line.")
    ] = None,
    device: DeviceOption = "cpu",
    dtype: DtypeOption = "float32",
    block_size: Annotated[
        int, typer.Option("--block-size", min=1, help="Tokens per KV block.")
    ] = 16,
    reproducible: Annotated[
        bool, typer.Option("--reproducible", help="Leave out everything time- or host-dependent.")
    ] = False,
    backend: BackendOption = "auto",
    as_json: JsonOption = False,
) -> None:
    """Run prefill for each prompt on the model and write the KV cache as a snapshot."""
    from kvsnap.engines import transformers as hf
    from kvsnap.engines.default_model import load_model

    prompts = list(prompt or [])
    if prompts_file is not None:
        if not prompts_file.exists():
            raise UsageError(f"{prompts_file}: no such file")
        prompts += [line for line in prompts_file.read_text().splitlines() if line.strip()]
    if not prompts:
        prompts = [DEFAULT_PROMPT]
    if not all(text.strip() for text in prompts):
        raise UsageError("prompts must not be empty")
    loaded = load_model(model, dtype=_dtype(dtype), device=device)
    prefilled = hf.prefill(loaded, prompts)
    with progress_bar("capture", enabled=not as_json) as progress:
        result = hf.capture_dynamic_caches(
            prefilled,
            output,
            model=loaded,
            block_size=block_size,
            transfer=TransferOptions(backend=backend),
            progress=progress,
            reproducible=reproducible,
        )
    payload = {
        "path": result.path,
        "sequences": result.num_sequences,
        "tokens": result.num_tokens,
        "bytes": result.num_bytes,
        "seconds": round(result.seconds, 6),
    }
    if as_json:
        emit_json(payload)
        return
    stdout.print(
        f"captured {result.num_sequences} sequence(s), {result.num_tokens} tokens, "
        f"{_bytes(result.num_bytes)} → [bold]{result.path}[/] in {result.seconds:.2f} s"
    )


# --------------------------------------------------------------------------------------------
# inspect


@app.command()
@handle_errors
def inspect(
    snapshot: Annotated[Path, typer.Argument(help="Snapshot file or URL.")],
    stats: Annotated[
        bool, typer.Option("--stats", help="Per layer absmax, mean, std, NaN and Inf counts.")
    ] = False,
    plot: Annotated[
        Path | None,
        typer.Option("--plot", help="Write a PNG heatmap of per-layer, per-token K/V norms."),
    ] = None,
    as_json: JsonOption = False,
) -> None:
    """Show a snapshot's metadata and sequences (and optionally statistics and a plot)."""
    with Snapshot.open(_require_snapshot_path(snapshot)) as snap:
        meta = snap.metadata
        geometry = snap.geometry
        shared = snap.shared_blocks()
        payload: dict[str, Any] = {
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
        }
        if stats:
            payload["stats"] = {name: snap.tensor_stats(name) for name in geometry.tensor_names()}
        if plot is not None:
            _plot_norms(snap, plot)
            payload["plot"] = str(plot)
    if as_json:
        emit_json(payload)
        return
    _print_inspect(payload)


def _print_inspect(payload: dict[str, Any]) -> None:
    layout = payload["layout"]
    model = payload["model"]
    table = Table(title=payload["path"], show_header=False, title_justify="left")
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
        ("blocks", f"{payload['num_blocks']} ({_bytes(payload['total_bytes'])})"),
    ]
    for key, value in rows:
        table.add_row(key, str(value))
    stdout.print(table)
    sequences = Table(title="sequences", title_justify="left")
    for column in ("id", "tokens", "blocks", "shared blocks"):
        sequences.add_column(column, justify="right" if column != "id" else "left")
    for record in payload["sequences"]:
        sequences.add_row(
            record["id"],
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
                name,
                f"{values['absmax']:.4g}",
                f"{values['mean']:.4g}",
                f"{values['std']:.4g}",
                str(values["nan"]),
                str(values["inf"]),
            )
        stdout.print(stats)
    if "plot" in payload:
        stdout.print(f"plot written to {payload['plot']}")


def _plot_norms(snap: Snapshot, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install 'kvsnap[plot]'") from None
    sequence_id = snap.sequences[0].id
    norms = snap.token_norms(sequence_id)
    figure, axes = plt.subplots(len(norms), 1, figsize=(10, 2 + 1.5 * len(norms)), squeeze=False)
    for axis, (part, values) in zip(axes[:, 0], norms.items(), strict=True):
        image = axis.imshow(values, aspect="auto", interpolation="nearest", cmap="viridis")
        axis.set_title(f"{part} norm per token, sequence {sequence_id}")
        axis.set_xlabel("token")
        axis.set_ylabel("layer")
        figure.colorbar(image, ax=axis)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


# --------------------------------------------------------------------------------------------
# verify


@app.command()
@handle_errors
def verify(
    snapshot: Annotated[Path, typer.Argument(help="Snapshot file or URL.")],
    against: Annotated[
        Path | None,
        typer.Option("--against", help="Compare numerically with this reference snapshot."),
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
    as_json: JsonOption = False,
) -> None:
    """Check structure and every checksum; optionally compare with another snapshot or prefill."""
    from kvsnap.errors import NotASnapshotError, SnapshotCorruptError

    path = _require_snapshot_path(snapshot)
    problems: list[dict[str, Any]] = []
    report = ""
    try:
        with Snapshot.open(path) as snap:
            with progress_bar("verify", enabled=not as_json) as progress:
                problems += [_problem(problem) for problem in snap.verify(progress=progress)]
            if not problems and against is not None:
                with Snapshot.open(_require_snapshot_path(against)) as reference:
                    comparison = snap.compare(reference, atol=atol, rtol=rtol)
                problems += _comparison_problems(comparison)
                report = comparison.report()
            if not problems and recompute:
                comparison = _recompute(snap, model, device, atol, rtol)
                problems += _comparison_problems(comparison)
                report = comparison.report()
    except (SnapshotCorruptError, NotASnapshotError) as error:
        problems.append(
            {
                "tensor": getattr(error, "tensor", None),
                "block": getattr(error, "block", None),
                "message": str(error),
            }
        )
    ok = not problems
    if as_json:
        emit_json({"ok": ok, "problems": problems})
    else:
        if report:
            stdout.print(report)
        for problem in problems:
            stdout.print(f"[red]problem:[/] {problem['message']}")
        stdout.print(
            "[bold green]OK[/]" if ok else f"[bold red]FAILED[/] ({len(problems)} problem(s))"
        )
    if not ok:
        raise typer.Exit(EXIT_VERIFY_FAILED)


def _problem(problem: Any) -> dict[str, Any]:
    return {"tensor": problem.tensor, "block": problem.block, "message": problem.message}


def _comparison_problems(comparison: Any) -> list[dict[str, Any]]:
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
                        f"{layer.max_abs_diff:.6g}; first at sequence {where.get('sequence')}, "
                        f"token {where.get('token')}, head {where.get('head')}"
                    ),
                    "max_abs_diff": layer.max_abs_diff,
                    "first_mismatch": where,
                }
            )
    return problems


def _recompute(snap: Snapshot, model: str | None, device: str, atol: float, rtol: float) -> Any:
    import tempfile

    from kvsnap.engines import transformers as hf
    from kvsnap.engines.default_model import load_model

    loaded = load_model(model, dtype=_dtype(snap.geometry.dtype), device=device)
    prefilled = hf.prefill_token_ids(loaded, [record.token_ids for record in snap.sequences])
    with tempfile.TemporaryDirectory(prefix="kvsnap-recompute-") as scratch:
        fresh_path = Path(scratch) / "recomputed.safetensors"
        hf.capture_dynamic_caches(
            prefilled,
            fresh_path,
            model=loaded,
            block_size=snap.geometry.block_size,
            sequence_ids=[record.id for record in snap.sequences],
        )
        with Snapshot.open(fresh_path) as fresh:
            return snap.compare(fresh, atol=atol, rtol=rtol)


# --------------------------------------------------------------------------------------------
# restore


@app.command()
@handle_errors
def restore(
    snapshot: Annotated[Path, typer.Argument(help="Snapshot file or URL.")],
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
    as_json: JsonOption = False,
) -> None:
    """Restore every sequence into a fresh cache of the model and continue generation."""
    from kvsnap.engines import transformers as hf
    from kvsnap.engines.default_model import load_model

    path = _require_snapshot_path(snapshot)
    continuations: dict[str, str] = {}
    check_result = None
    with Snapshot.open(path) as snap:
        loaded = load_model(model, dtype=_dtype(snap.geometry.dtype), device=device)
        # Refuse before anything is allocated or written, naming both sides.
        hf.check_snapshot_fits(snap, loaded, force=force)
        started = time.perf_counter()
        restored = []
        with progress_bar("restore", enabled=not as_json) as progress:
            for record in snap.sequences:
                cache, token_ids = hf.restore_dynamic_cache(
                    snap, sequence_id=record.id, device=device, backend=backend, progress=progress
                )
                restored.append((record.id, cache, token_ids))
        total_bytes = (
            sum(len(record.block_ids) for record in snap.sequences) * snap.geometry.bytes_per_block
        )
    restore_seconds = time.perf_counter() - started
    for sequence_id, cache, token_ids in restored:
        continued = hf.continue_generation(loaded, cache, token_ids, max_new_tokens)
        continuations[sequence_id] = loaded.decode(continued)
        if check:
            reference = hf.generate_greedy(loaded, token_ids, max_new_tokens)
            matched = reference == continued
            check_result = "mismatch" if not matched or check_result == "mismatch" else "match"
    payload = {
        "sequences": len(restored),
        "bytes": total_bytes,
        "seconds": round(restore_seconds, 6),
        "continuations": continuations,
        "check": check_result,
    }
    if as_json:
        emit_json(payload)
    else:
        stdout.print(
            f"restored {payload['sequences']} sequence(s), {_bytes(total_bytes)} "
            f"in {restore_seconds:.3f} s"
        )
        for sequence_id, text in continuations.items():
            stdout.print(f"[bold]{sequence_id}[/] → {text!r}")
        if check_result is not None:
            colour = "green" if check_result == "match" else "red"
            stdout.print(
                f"check: [bold {colour}]{check_result}[/] (generation without the snapshot)"
            )
    if check_result == "mismatch":
        raise typer.Exit(EXIT_VERIFY_FAILED)


app.command()(handle_errors(fixture))
app.command()(handle_errors(bench))


# --------------------------------------------------------------------------------------------


def _dtype(name: str) -> Any:
    import torch

    choices = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in choices:
        raise UsageError(f"--dtype must be one of {', '.join(choices)}, got {name!r}")
    return choices[name]


def _bytes(count: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count} B"


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
