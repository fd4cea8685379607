"""``kvsnap fixture``: write a reproducible snapshot of a synthetic KV cache.

A thin client of :mod:`kvsnap.testing.synthetic`: it writes what
:func:`~kvsnap.testing.synthetic.generate` writes (the same options give the same file, byte for
byte, on every machine; see docs/fixtures.md for what the values model), showing progress on
stderr while it synthesizes and writes.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Annotated, Any

import typer

from .common import JsonOption, format_bytes, is_url, output_location
from .output import UsageError, emit_json, progress_bar, status, stdout, text

_SYNTHETIC_DTYPES = ("bfloat16", "float16", "float32", "float64", "float8_e4m3fn", "float8_e5m2")


LayoutOption = Annotated[
    str | None,
    typer.Option(
        "--layout",
        help="Cache layout captured from: vllm-split-nhd, vllm-split-hnd, packed, legacy, "
        "flat-paged, cross-layer, mla (default: mla for --attention mla, else vllm-split-nhd).",
    ),
]
LatentDimOption = Annotated[
    int | None,
    typer.Option("--latent-dim", min=4, help="MLA latent width incl. its RoPE part (e.g. 576)."),
]
SharedPrefixOption = Annotated[
    int,
    typer.Option("--shared-prefix", min=0, help="Leading tokens (and KV) all sequences share."),
]


def _parse_lengths(text: str) -> list[int]:
    try:
        lengths = [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError:
        raise UsageError(
            f"--lengths must be comma-separated token counts like 64,100, got {text!r}"
        ) from None
    if not lengths or min(lengths) < 1:
        raise UsageError(f"--lengths needs at least one positive token count, got {text!r}")
    return lengths


def _check_kind(dtype: str, attention: str, latent_dim: int | None) -> None:
    """Refuse a KV dtype the generator lacks and a latent width without (or beyond) MLA."""
    if dtype not in _SYNTHETIC_DTYPES:
        raise UsageError(f"--dtype must be one of {', '.join(_SYNTHETIC_DTYPES)}, got {dtype!r}")
    is_mla = attention == "mla"
    if is_mla and latent_dim is None:
        raise UsageError(
            "--attention mla needs --latent-dim (576 = 512 latent + 64 RoPE, as DeepSeek-V3)"
        )
    if not is_mla and latent_dim is not None:
        raise UsageError("--latent-dim is only for --attention mla")


def _sha256(location: str) -> str:
    digest = hashlib.sha256()
    if is_url(location):
        import fsspec

        opened: Any = fsspec.open(location, "rb")
    else:
        opened = Path(location).open("rb")
    with opened as file:
        for chunk in iter(lambda: file.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def fixture(
    output: Annotated[str, typer.Argument(help="Snapshot file or URL to write.")],
    layers: Annotated[int, typer.Option("--layers", min=1, help="Number of layers.")] = 2,
    seed: Annotated[int, typer.Option("--seed", min=0, help="Seed of every random draw.")] = 0,
    layout: LayoutOption = None,
    attention: Annotated[
        str, typer.Option("--attention", help="full, sliding (alternating with full) or mla.")
    ] = "full",
    dtype: Annotated[
        str, typer.Option("--dtype", help=f"KV dtype: {', '.join(_SYNTHETIC_DTYPES)}.")
    ] = "bfloat16",
    block_size: Annotated[int, typer.Option("--block-size", min=1, help="Tokens per block.")] = 16,
    heads: Annotated[int, typer.Option("--heads", min=1, help="KV heads (not for MLA).")] = 2,
    head_dim: Annotated[
        int, typer.Option("--head-dim", min=2, help="Head dimension, even (not for MLA).")
    ] = 64,
    latent_dim: LatentDimOption = None,
    lengths: Annotated[
        str, typer.Option("--lengths", help="Comma-separated token count of each sequence.")
    ] = "64,100",
    shared_prefix: SharedPrefixOption = 0,
    as_json: JsonOption = False,
) -> None:
    """Write a reproducible snapshot of a synthetic KV cache (RoPE'd keys with outlier channels)."""
    from kvsnap.testing import synthetic

    target = output_location(output, option="OUTPUT")
    _check_kind(dtype, attention, latent_dim)
    is_mla = attention == "mla"
    spec = synthetic.make_spec(
        num_layers=layers,
        num_kv_heads=None if is_mla else heads,
        head_dim=None if is_mla else head_dim,
        block_size=block_size,
        dtype=dtype,
        sequence_lengths=_parse_lengths(lengths),
        attention=attention,
        latent_dim=latent_dim,
        layout=layout,
        seed=seed,
        shared_prefix_tokens=shared_prefix,
    )
    payload = _write(synthetic, spec, target, show_progress=not as_json)
    if as_json:
        emit_json(payload)
        return
    stdout.print(
        f"wrote {payload['sequences']} synthetic sequence(s), {payload['tokens']} tokens, "
        f"{format_bytes(payload['bytes'])} → [bold]{text(payload['path'])}[/]\n"
        f"sha256 {payload['sha256']}"
    )


def _write(synthetic: Any, spec: Any, target: str, *, show_progress: bool) -> dict[str, Any]:
    """Synthesize ``spec``'s cache and capture it to ``target`` as ``generate`` does, with a
    spinner while synthesizing and a byte progress bar while writing."""
    from kvsnap.snapshot import capture

    with status("synthesizing KV", enabled=show_progress):
        cache = synthetic.build_cache(spec)
    with progress_bar("writing", enabled=show_progress) as progress:
        result = capture(
            cache.layout,
            cache.sequences,
            target,
            source=synthetic.source_info(spec),
            reproducible=True,
            progress=progress,
        )
    return {
        "path": result.path,
        "sequences": result.num_sequences,
        "tokens": result.num_tokens,
        "bytes": result.num_bytes,
        "sha256": _sha256(result.path),
    }
