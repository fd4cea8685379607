"""``kvsnap export``: a kvsnap snapshot as another engine's own persisted KV."""

from __future__ import annotations

import time
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import typer

from .common import JsonOption
from .output import UsageError, emit_json, stderr, stdout, text


class Target(str, Enum):
    """The formats ``export`` writes."""

    VLLM_FS = "vllm-fs"
    LLAMA_STATE = "llama-state"


def export(
    snapshot: Annotated[str, typer.Argument(metavar="SNAPSHOT", help="kvsnap snapshot to export.")],
    to: Annotated[Target, typer.Option("--to", help="The format to write.")],
    target: Annotated[
        str,
        typer.Argument(
            metavar="TARGET",
            help="vllm-fs: the fs tier's root or namespace; llama-state: the file to write.",
        ),
    ],
    page_order: Annotated[
        str | None,
        typer.Option(
            "--page-order",
            metavar="ORDER",
            help="vllm-fs: the engine's page order: cells-nhd, cells-hnd, or an .npz file.",
        ),
    ] = None,
    config: Annotated[
        str | None,
        typer.Option(
            "--config",
            metavar="FILE",
            help="vllm-fs: a namespace config.json, for a root that holds none yet.",
        ),
    ] = None,
    tp: Annotated[
        int | None,
        typer.Option("--tp", min=1, help="vllm-fs: TP size of the engine that will read it."),
    ] = None,
    model: Annotated[
        str | None,
        typer.Option("--model", "-m", metavar="DIR", help="vllm-fs: model directory to check."),
    ] = None,
    hash_seed: Annotated[
        str | None,
        typer.Option("--hash-seed", metavar="S", help="vllm-fs: the engine's PYTHONHASHSEED."),
    ] = None,
    sequence: Annotated[
        str | None,
        typer.Option("--sequence", metavar="ID", help="llama-state: the sequence to write."),
    ] = None,
    v_transposed: Annotated[
        bool,
        typer.Option(
            "--v-transposed",
            help="llama-state: V stored transposed (a llama.cpp context without flash attention).",
        ),
    ] = False,
    hf_rope: Annotated[
        bool,
        typer.Option(
            "--hf-rope",
            help="llama-state: keys from a transformers capture (rotary halves), reordered to "
            "llama.cpp's interleaved pairs.",
        ),
    ] = False,
    as_json: JsonOption = False,
) -> None:
    """Write a kvsnap snapshot as a vLLM fs-tier namespace or a llama.cpp sequence state."""
    from kvsnap.foreign.llama_state_export import export_llama_state  # noqa: F401
    from kvsnap.foreign.vllm_fs_export import export_vllm_fs  # noqa: F401
    from kvsnap.snapshot import Snapshot

    started = time.perf_counter()  # the export, not the library's import
    if not Path(snapshot).is_file():
        raise UsageError(f"{snapshot}: no such snapshot file")
    with Snapshot.open(snapshot) as source:
        if to is Target.VLLM_FS:
            if page_order is None:
                raise UsageError(
                    "--page-order is required: a vLLM block file holds pages in the attention "
                    "backend's order (cells-nhd for CUDA FlashAttention, or a probed .npz)"
                )
            payload = _to_vllm_fs(source, target, page_order, config, tp, model, hash_seed)
        else:
            payload = _to_llama_state(source, target, sequence, v_transposed, hf_rope)
    payload["seconds"] = round(time.perf_counter() - started, 3)
    for note in payload.get("notes", []):
        stderr.print(f"[yellow]note:[/] {text(note)}")
    if as_json:
        emit_json(payload)
        return
    stdout.print(f"wrote {text(payload['path'])}: {text(payload['summary'])}")


def _to_vllm_fs(
    source: Any,
    target: str,
    page_order: str,
    config: str | None,
    tp: int | None,
    model: str | None,
    hash_seed: str | None,
) -> dict[str, Any]:
    from kvsnap.foreign.vllm_fs_export import export_summary, export_vllm_fs

    result = export_vllm_fs(
        source,
        target,
        page_order=page_order,
        config=config,
        tp_size=tp,
        model=model,
        hash_seed=hash_seed,
    )
    payload = dict(export_summary(result))
    summary = f"{payload['written']} block files written, {payload['present']} already there"
    if result.tokens_left_out:
        summary += f", {result.tokens_left_out} tokens of partial blocks left out"
    return {**payload, "summary": summary}


def _to_llama_state(
    source: Any, target: str, sequence: str | None, v_transposed: bool, hf_rope: bool
) -> dict[str, Any]:
    from kvsnap.foreign.llama_state_export import export_llama_state

    if Path(target).is_dir():
        raise UsageError(f"{target}: is a directory; llama-state writes one file")
    tokens = export_llama_state(
        source, target, sequence_id=sequence, v_transposed=v_transposed, hf_rope=hf_rope
    )
    return {"path": target, "tokens": tokens, "summary": f"{tokens} tokens", "notes": []}
