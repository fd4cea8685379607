"""``kvsnap convert``: another engine's persisted KV as an ordinary kvsnap snapshot."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from .common import (
    CompressOption,
    JsonOption,
    KeyFileOption,
    compression_for,
    key_ring,
    output_location,
)
from .output import UsageError, emit_json, stderr, stdout, text

_PathOption = Annotated[
    str,
    typer.Argument(
        metavar="PATH",
        help="vLLM fs-tier namespace, rank directory, root or block file, a llama.cpp "
        "state file, an SGLang HiCache or LMCache fs L2 directory, a thaw KV snapshot, or "
        "a kvsnap snapshot file (to re-encode with --compress).",
    ),
]

_OutputOption = Annotated[
    str, typer.Option("--output", "-o", metavar="PATH", help="Snapshot file to write.")
]

_TokensOption = Annotated[
    str | None,
    typer.Option(
        "--tokens", metavar="FILE", help="The prompt's token ids (JSON list or whitespace)."
    ),
]

_ModelOption = Annotated[
    str | None,
    typer.Option("--model", "-m", metavar="DIR", help="Model directory (its config.json)."),
]

_PageOrderOption = Annotated[
    str | None,
    typer.Option(
        "--page-order",
        metavar="ORDER",
        help="How the engine laid out each page: cells-nhd, cells-hnd, or an .npz file "
        "(vLLM); layer_first, page_first or page_first_direct (SGLang HiCache).",
    ),
]

_KvHeadsOption = Annotated[
    int | None,
    typer.Option("--kv-heads", min=1, help="KV heads per layer (llama.cpp state files)."),
]

_TpOption = Annotated[
    int | None, typer.Option("--tp", min=1, help="TP size of the engine that wrote it.")
]

_HashSeedOption = Annotated[
    str | None,
    typer.Option("--hash-seed", metavar="S", help="The writer's PYTHONHASHSEED, if set."),
]

_ReproducibleOption = Annotated[
    bool, typer.Option("--reproducible", help="Leave out time-dependent metadata.")
]


def convert(
    path: _PathOption,
    output: _OutputOption,
    tokens: _TokensOption = None,
    model: _ModelOption = None,
    page_order: _PageOrderOption = None,
    kv_heads: _KvHeadsOption = None,
    tp: _TpOption = None,
    hash_seed: _HashSeedOption = None,
    reproducible: _ReproducibleOption = False,
    compress: CompressOption = "none",
    key_file: KeyFileOption = None,
    as_json: JsonOption = False,
) -> None:
    """Convert another engine's persisted KV into a checksummed kvsnap snapshot, or re-encode
    a kvsnap snapshot (--compress none|lossless|fp8; an encoded one signed with --key-file)."""
    target = output_location(output, option="--output")
    compression = compression_for(compress, target)
    if not Path(path).exists():
        raise UsageError(f"{path}: no such file or directory")
    from .foreign_paths import is_foreign

    if not is_foreign(path):
        return _recode(path, target, compression, key_ring(key_file), as_json=as_json)
    token_ids = None if tokens is None else read_token_ids(tokens)
    hints: dict[str, Any] = {
        "num_kv_heads": kv_heads,
        "model": model,
        "page_order": page_order,
        "tp_size": tp,
        "tokens": token_ids,
        "hash_seed": hash_seed,
    }
    expected = _config_heads(path, hints)
    if compression == "none":
        _write(path, target, hints, reproducible=reproducible, as_json=as_json, expected=expected)
        return
    converted = f"{target}.uncompressed.tmp"
    try:
        _write(
            path,
            converted,
            hints,
            reproducible=reproducible,
            as_json=True,
            quiet=True,
            expected=expected,
        )
        _recode(converted, target, compression, key_ring(key_file), as_json=as_json)
    finally:
        Path(converted).unlink(missing_ok=True)


def _recode(source: str, target: str, compression: str, keys: Any, *, as_json: bool) -> None:
    """Write the kvsnap snapshot ``source`` to ``target`` as ``compression`` and report it."""
    from kvsnap.encoded.summary import error_line
    from kvsnap.encoded.write import recode_file

    if Path(source).is_dir():
        raise UsageError(f"{source}: is a directory, not a snapshot file")
    try:
        result = recode_file(source, target, compression, keys=keys)
    except ValueError as error:
        raise UsageError(str(error)) from None
    payload = {
        "path": result.path,
        "encoding": compression,
        "decoded_bytes": result.decoded_bytes,
        "stored_bytes": result.stored_bytes,
        "ratio": round(result.ratio, 4),
        "seconds": round(result.seconds, 3),
        "error": None if result.error is None else result.error.worst,
        "notes": list(result.notes),
    }
    for note in result.notes:
        stderr.print(f"[yellow]note:[/] {text(note)}")
    if as_json:
        emit_json(payload)
        return
    stdout.print(
        f"wrote {text(result.path)}: {compression}, {result.stored_bytes} bytes for "
        f"{result.decoded_bytes} ({result.ratio:.2f}x smaller) in {result.seconds:.2f} s"
    )
    if result.error is not None:
        stdout.print(f"error: {error_line(result.error.worst)}")


def _config_heads(path: str, hints: dict[str, Any]) -> tuple[int, int] | None:
    """For a llama.cpp state file, which does not record its KV heads: the ``(KV heads, head
    size)`` of ``--model DIR``'s config.json (the ``model`` hint is used up here), which
    ``--kv-heads`` defaults to and must agree with; ``None`` without ``--model``."""
    from kvsnap.foreign import recognise
    from kvsnap.foreign.llama_state import FORMAT_NAME

    found = recognise(path)
    if found is None or found.name != FORMAT_NAME or hints["model"] is None:
        return None
    model = hints.pop("model")
    config_path = Path(model) / "config.json"
    try:
        config = json.loads(config_path.read_text())
        text_config = config.get("text_config", config)
        attention = int(text_config["num_attention_heads"])
        heads = int(text_config.get("num_key_value_heads") or attention)
        dim = int(text_config.get("head_dim") or int(text_config["hidden_size"]) // attention)
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise UsageError(
            f"--model {model}: no model config with KV heads there ({error})"
        ) from None
    if hints["num_kv_heads"] is None:
        hints["num_kv_heads"] = heads
    return heads, dim


def _check_head_split(source: Any, expected: tuple[int, int] | None) -> None:
    """Refuse a split of the rows into heads that does not fit: another one than the model
    config's, or heads of an odd size (a head's dimensions come in RoPE pairs)."""
    geometry = source.geometry()
    if geometry.is_mla:
        return
    heads, dim = geometry.num_kv_heads, geometry.head_dim
    split = f"{heads} KV heads of {dim} dimensions (rows of {heads * dim} elements)"
    if expected is not None and (heads, dim) != expected:
        raise UsageError(
            f"--kv-heads {heads} splits the KV into {split}, and the model config has "
            f"{expected[0]} KV heads of {expected[1]}: pass --kv-heads {expected[0]}, or the "
            "model the file was written by"
        )
    if dim % 2:
        raise UsageError(
            f"--kv-heads {heads} splits the KV into {split}: a head's size is even (RoPE "
            "rotates its dimensions in pairs); pass the model's KV heads (num_key_value_heads "
            "in its config.json), or --model DIR to take them from there"
        )


def _write(
    path: str,
    target: str,
    hints: dict[str, Any],
    *,
    reproducible: bool,
    as_json: bool,
    quiet: bool = False,
    expected: tuple[int, int] | None = None,
) -> None:
    """Open ``path`` with ``hints``, write the snapshot to ``target`` and report it."""
    from kvsnap.foreign import convert_to_snapshot, open_foreign

    token_ids = hints["tokens"]
    started = time.perf_counter()
    with open_foreign(path, **hints) as source:
        _check_head_split(source, expected)
        if token_ids is None and source.needs_tokens:
            raise UsageError(
                f"--tokens FILE is required: {source.version} holds no token ids (its blocks "
                "are found by the prompt's hashes)"
            )
        info = source.describe()
        model_id = info.get("config", {}).get("model_name") or info.get("architecture") or "unknown"
        result = convert_to_snapshot(
            source, target, engine=source.engine, model_id=model_id, reproducible=reproducible
        )
        notes = source.notes()
    for note in notes:
        stderr.print(f"[yellow]note:[/] {text(note)}")
    payload = {
        "path": result.path,
        "sequences": result.num_sequences,
        "tokens": result.num_tokens,
        "blocks": result.num_blocks,
        "bytes": result.num_bytes,
        "seconds": round(time.perf_counter() - started, 3),
        "notes": notes,
    }
    if quiet:
        return
    if as_json:
        emit_json(payload)
        return
    stdout.print(
        f"wrote {text(result.path)}: {result.num_sequences} sequence(s), {result.num_tokens} "
        f"tokens, {result.num_blocks} blocks"
    )


def read_token_ids(path: str) -> list[int]:
    """Token ids from ``path``: a JSON list of integers, or integers separated by whitespace."""
    try:
        content = Path(path).read_text()
    except OSError as error:
        raise UsageError(f"--tokens {path}: {error.strerror or error}") from None
    try:
        values = json.loads(content) if content.lstrip().startswith("[") else content.split()
        ids = [int(value) for value in values]
    except (ValueError, TypeError):
        raise UsageError(f"--tokens {path}: not a list of integer token ids") from None
    if not ids or min(ids) < 0:
        raise UsageError(f"--tokens {path}: needs at least one non-negative token id")
    return ids
