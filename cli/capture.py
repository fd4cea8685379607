"""``kvsnap capture``: run prefill for each prompt and write the KV cache as a snapshot.

On a terminal each phase shows on stderr as it runs: a spinner while the model loads, a bar
counting prompts through prefill, a byte bar while the snapshot is written; the summary gives
the total time and each phase's.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Any

import typer

from . import models
from .common import (
    BackendOption,
    CompressOption,
    DeviceOption,
    DtypeOption,
    JsonOption,
    KeyFileOption,
    ModelOption,
    compression_for,
    format_bytes,
    key_ring,
    output_location,
)
from .output import (
    UsageError,
    emit_json,
    progress_bar,
    status,
    stderr,
    stdout,
    step_progress,
    text,
)
from .prompts import check_token_ids, encode_prompts, position_warning, read_token_file

#: What ``kvsnap capture`` runs when given no prompt.
DEFAULT_PROMPT = "kvsnap keeps the KV cache of this prompt, bit for bit, across restarts."


def _prompts(prompt: list[str] | None, prompts_file: Path | None, *, default: bool) -> list[str]:
    """The prompts to capture: ``--prompt``s, then the file's non-blank lines; the built-in
    prompt only when none is given and ``default``. An empty ``--prompt`` and a file without a
    prompt are refused alike: both ask for a capture of nothing."""
    prompts = list(prompt or [])
    if not all(prompt_text.strip() for prompt_text in prompts):
        raise UsageError("--prompt: a prompt must not be empty")
    if prompts_file is not None:
        if not prompts_file.is_file():
            raise UsageError(f"--prompts-file {prompts_file}: no such file")
        lines = [line for line in prompts_file.read_text().splitlines() if line.strip()]
        if not lines:
            raise UsageError(
                f"--prompts-file {prompts_file}: no prompt in it (every line is blank); "
                "a prompt must not be empty"
            )
        prompts += lines
    return prompts or ([DEFAULT_PROMPT] if default else [])


_OutputOption = Annotated[
    str, typer.Option("--output", "-o", metavar="PATH", help="Snapshot file or URL to write.")
]

_PromptOption = Annotated[
    list[str] | None,
    typer.Option("--prompt", "-p", help="A prompt (repeat for several sequences)."),
]

_PromptsFileOption = Annotated[
    Path | None, typer.Option("--prompts-file", help="A file with one prompt per line.")
]

_TokensOption = Annotated[
    list[Path] | None,
    typer.Option(
        "--tokens",
        metavar="FILE",
        help="Token ids to capture: a JSON list (of lists), or one sequence per line.",
    ),
]

_ChatOption = Annotated[
    bool, typer.Option("--chat", help="Wrap each prompt in the model's chat template.")
]

_BlockSizeOption = Annotated[int, typer.Option("--block-size", min=1, help="Tokens per KV block.")]

_ReproducibleOption = Annotated[
    bool, typer.Option("--reproducible", help="Leave out everything time- or host-dependent.")
]

_ForceOption = Annotated[
    bool,
    typer.Option("--force", help="Capture a sequence longer than the model's positions."),
]


def capture(
    output: _OutputOption,
    model: ModelOption = None,
    prompt: _PromptOption = None,
    prompts_file: _PromptsFileOption = None,
    tokens: _TokensOption = None,
    chat: _ChatOption = False,
    device: DeviceOption = "cpu",
    dtype: DtypeOption = "float32",
    block_size: _BlockSizeOption = 16,
    reproducible: _ReproducibleOption = False,
    backend: BackendOption = "auto",
    key_file: KeyFileOption = None,
    force: _ForceOption = False,
    compress: CompressOption = "none",
    as_json: JsonOption = False,
) -> None:
    """Run prefill on each prompt and write the KV cache as a snapshot.

    The prompts are text (--prompt, --prompts-file; --chat wraps them in the model's chat
    template) or token ids (--tokens); with --key-file the snapshot is signed, with --compress
    encoded."""
    from kvsnap.pipeline import TransferOptions

    target = output_location(output, option="--output")
    compression = compression_for(compress, target)
    keys = key_ring(key_file)
    prompts = _prompts(prompt, prompts_file, default=not tokens)
    if chat and not prompts:
        raise UsageError("--chat wraps --prompt text in the chat template: give a --prompt")
    token_lists = [ids for path in tokens or [] for ids in read_token_file(path)]
    model_dtype = models.torch_dtype(dtype)
    engine = models.transformers_engine("capture")
    models.check_device(device)
    models.check_backend(backend, device)
    started = time.perf_counter()
    with status(f"loading the model ({model or 'built-in'})", enabled=not as_json):
        loaded = models.load(model, dtype=model_dtype, device=device, quiet=as_json)
    sequences, notes = _sequences(loaded, prompts, token_lists, chat=chat, force=force)
    if len(notes) > len(loaded.notes) and not as_json:
        stderr.print(f"[yellow]warning:[/] {text(notes[-1])}")
    loaded_at = time.perf_counter()
    prefilled = _prefill(engine, loaded, sequences, force=force, show_progress=not as_json)
    prefilled_at = time.perf_counter()
    with progress_bar("writing", enabled=not as_json) as progress:
        result = engine.capture_dynamic_caches(
            prefilled,
            target,
            model=loaded,
            block_size=block_size,
            transfer=TransferOptions(backend=backend),
            progress=progress,
            reproducible=reproducible,
            keys=keys,
            compression=compression,
        )
    encoding = None if compression == "none" else _encoded(result.path, compression)
    moments = (started, loaded_at, prefilled_at, time.perf_counter())
    _report(result, encoding, notes, moments, as_json)


def _report(
    result: Any,
    encoding: dict[str, Any] | None,
    notes: list[str],
    moments: tuple[float, float, float, float],
    as_json: bool,
) -> None:
    """Print what a capture wrote (``--json``: as JSON, with its ``notes``), with its
    ``encoding``'s summary and each phase's time from ``moments``: started, model loaded,
    prefill done, snapshot written (and encoded). ``bytes`` is the snapshot's size
    uncompressed (an encoded one's decoded size)."""
    started, loaded_at, prefilled_at, finished = moments
    payload = {
        "path": result.path,
        "sequences": result.num_sequences,
        "tokens": result.num_tokens,
        "bytes": result.num_bytes if encoding is None else encoding["decoded_bytes"],
        "seconds": round(result.seconds, 6),
        "encoding": encoding or {"name": "none"},
        **({"notes": notes} if notes else {}),
    }
    if as_json:
        emit_json(payload)
        return
    stored = (
        "" if encoding is None else f", stored {encoding['name']} {encoding['ratio']:.2f}x smaller"
    )
    stdout.print(
        f"captured {result.num_sequences} sequence(s), {result.num_tokens} tokens, "
        f"{format_bytes(payload['bytes'])}{stored} → [bold]{text(payload['path'])}[/] "
        f"in {finished - started:.2f} s (model load {loaded_at - started:.2f} s, prefill "
        f"{prefilled_at - loaded_at:.2f} s, write {finished - prefilled_at:.2f} s)"
    )


def _encoded(path: str, compression: str) -> dict[str, Any]:
    """The summary of the encoded snapshot the capture wrote at ``path``, from its header: its
    sizes and ratio (and for fp8 its error report's worst values)."""
    from kvsnap.encoded.file import read_header

    header = read_header(path)
    summary: dict[str, Any] = {
        "name": compression,
        "ratio": round(header.ratio, 4),
        "stored_bytes": header.layout.file_size,
        "decoded_bytes": header.decoded_bytes,
    }
    if header.error is not None:
        summary["error"] = header.error.worst
    return summary


def _sequences(
    loaded: Any, prompts: list[str], token_lists: list[list[int]], *, chat: bool, force: bool
) -> tuple[list[list[int]], list[str]]:
    """The token ids to capture (the prompts', then ``--tokens``'), each checked, and the notes
    to give: the model's own, then the warning for a sequence past its positions (``force``)."""
    check_token_ids(loaded, token_lists)
    sequences = encode_prompts(loaded, prompts, chat=chat) + token_lists
    lengths = [len(ids) for ids in sequences]
    warning = position_warning(loaded, lengths, force=force, what="a sequence")
    return sequences, [*loaded.notes, *([] if warning is None else [warning])]


def _prefill(
    engine: Any, loaded: Any, sequences: list[list[int]], *, force: bool, show_progress: bool
) -> list[Any]:
    """Prefill each sequence on its own, counting them on a bar."""
    prefilled: list[Any] = []
    with step_progress("prefill", enabled=show_progress) as progress:
        for number, token_ids in enumerate(sequences):
            progress(number, len(sequences), f"sequence {number + 1}")
            prefilled += engine.prefill_token_ids(loaded, [token_ids], force=force)
        progress(len(sequences), len(sequences), "")
    return prefilled
