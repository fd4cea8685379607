"""The model side of ``capture``, ``verify --recompute`` and ``restore``: checked up front.

Everything a user can get wrong is checked here before a model is loaded or a token computed:
the transformers extra, the device, the copy backend, the dtype; and, once the model is loaded,
whether a snapshot's token ids and KV geometry fit it (naming the model the snapshot came from).
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import TYPE_CHECKING, Any

from kvsnap.errors import IncompatibleSnapshotError

from .output import UsageError, stderr, text

if TYPE_CHECKING:
    import torch

    from kvsnap.engines.default_model import LoadedModel
    from kvsnap.snapshot import Snapshot

#: The copy backends ``--backend`` accepts.
BACKENDS = ("auto", "cuda-batch", "triton", "torch", "cpu")
#: The model dtypes ``--dtype`` accepts.
MODEL_DTYPES = ("float32", "bfloat16", "float16")


def transformers_engine(command: str) -> ModuleType:
    """:mod:`kvsnap.engines.transformers`, or a usage error naming the extra to install."""
    try:
        importlib.import_module("transformers")
        return importlib.import_module("kvsnap.engines.transformers")
    except ModuleNotFoundError as error:
        if error.name is None or not error.name.startswith("transformers"):
            raise
        raise UsageError(
            f"kvsnap {command} runs a transformers model, and transformers is not installed: "
            "pip install 'kvsnap[transformers]'"
        ) from None


def check_device(device: str) -> str:
    """``device`` checked as a torch device kvsnap can run a model on: ``cpu`` or ``cuda[:N]``
    (CUDA only when this torch build sees that GPU)."""
    import torch

    try:
        resolved = torch.device(device)
    except (RuntimeError, ValueError):
        raise UsageError(
            f"--device {device}: not a torch device (use cpu, cuda or cuda:N)"
        ) from None
    if resolved.type == "cpu":
        return device
    if resolved.type != "cuda":
        raise UsageError(
            f"--device {device}: kvsnap runs models on cpu or cuda, not {resolved.type}"
        )
    if not torch.cuda.is_available():
        raise UsageError(
            f"--device {device}: CUDA is not available (torch {torch.__version__} sees no GPU); "
            "use --device cpu"
        )
    if resolved.index is not None and resolved.index >= torch.cuda.device_count():
        raise UsageError(f"--device {device}: no such GPU ({torch.cuda.device_count()} visible)")
    return device


def check_backend(backend: str, device: str) -> str:
    """``backend`` checked against the known names and, unless ``auto``, against ``device``."""
    if backend not in BACKENDS:
        raise UsageError(f"--backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "auto":
        return backend
    from kvsnap.transfer.backends import unavailable_reason

    reason = unavailable_reason(backend, device)
    if reason is not None:
        raise UsageError(f"--backend {backend} cannot run with --device {device}: {reason}")
    return backend


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of ``--dtype`` ``name`` (one of :data:`MODEL_DTYPES`)."""
    import torch

    if name not in MODEL_DTYPES:
        raise UsageError(f"--dtype must be one of {', '.join(MODEL_DTYPES)}, got {name!r}")
    return getattr(torch, name)


def load(model: str | None, *, dtype: torch.dtype, device: str, quiet: bool) -> LoadedModel:
    """Load ``model`` (``None``: the built-in one). transformers' loading bar shows only on a
    terminal and never when ``quiet`` (``--json``: stderr carries errors only)."""
    from kvsnap.engines.default_model import load_model

    if quiet or not stderr.is_terminal:
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()
    loaded = load_model(model, dtype=dtype, device=device)
    if not quiet:  # with --json the command's JSON carries them
        for note in loaded.notes:
            stderr.print(f"[yellow]note:[/] {text(note)}")
    return loaded


def model_advice(snap: Snapshot) -> str:
    """How to load the model ``snap`` was captured from, as ``--model`` advice (the model's
    name only where the advice is to pass it)."""
    from kvsnap.engines.default_model import DEFAULT_MODEL_ID

    model_id = snap.metadata.source.model_id
    if model_id == DEFAULT_MODEL_ID:
        return "leave out --model (the built-in model)"
    if model_id in ("", "unknown"):
        return "pass the model it was captured from with --model DIR"
    return f"pass --model {model_id}"


def snapshot_model_hint(snap: Snapshot) -> str:
    """What to pass to load the model ``snap`` was captured from, as the end of a message."""
    model_id = snap.metadata.source.model_id
    if snap.metadata.source.engine == "kvsnap-synthetic":
        return (
            f"it holds synthetic KV written by `kvsnap fixture` (model {model_id!r}), which no "
            "model reproduces"
        )
    if model_id in ("", "unknown"):
        return f"it does not record which model it was captured from: {model_advice(snap)}"
    return f"it was captured from model {model_id!r}: {model_advice(snap)}"


def check_fits(
    engine: ModuleType, snap: Snapshot, loaded: LoadedModel, *, force: bool, command: str
) -> None:
    """Refuse a snapshot whose token ids or KV geometry do not fit ``loaded``, or whose model
    fingerprint differs (unless ``force``), before any prefill or restore, naming the model
    the snapshot came from once and advising what ``command`` takes."""
    vocab_size = _vocab_size(loaded)
    for record in snap.sequences:
        if len(record.token_ids) and int(record.token_ids.max()) >= vocab_size:
            raise UsageError(
                f"sequence {record.id!r} holds token id {int(record.token_ids.max())}, outside "
                f"the vocabulary of model {loaded.model_id!r} ({vocab_size} ids); "
                + snapshot_model_hint(snap)
            )
    try:  # the geometry; the fingerprint is checked below, with advice for this command
        engine.check_snapshot_fits(snap, loaded, force=True)
    except IncompatibleSnapshotError as error:
        raise IncompatibleSnapshotError(f"{error}; {snapshot_model_hint(snap)}") from error
    source = snap.metadata.source
    stored = source.model_fingerprint
    if force or not stored or stored == loaded.fingerprint:
        return
    forcing = "; or use --force to restore anyway" if command == "restore" else ""
    raise IncompatibleSnapshotError(
        f"{snap.path} was captured from model {source.model_id!r} (fingerprint {stored[:16]}), "
        f"not from {loaded.model_id!r} (fingerprint {loaded.fingerprint[:16]}: other weights "
        f"or config); {model_advice(snap)}{forcing}",
        snapshot=source.model_id,
        target=loaded.model_id,
    )


def _vocab_size(loaded: LoadedModel) -> int:
    embeddings: Any = loaded.model.get_input_embeddings()
    return int(embeddings.num_embeddings)
