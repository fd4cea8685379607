"""The model side: its KV geometry, what a snapshot records about it, and matching the two.

Every ``model`` parameter of ``kvsnap.engines.transformers`` takes either kvsnap's
``kvsnap.engines.default_model.LoadedModel`` or a plain transformers model (any
``torch.nn.Module`` with a ``config``, e.g. a ``PreTrainedModel`` built from a config). A
snapshot records the model's id (the ``LoadedModel``'s, else the config's ``name_or_path``,
else the model's class name), its revision and its fingerprint (the config and the weights:
``kvsnap.engines.weights.loaded_model_fingerprint``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import transformers

from kvsnap.caches import register_cache_clear
from kvsnap.engines.default_model import LoadedModel
from kvsnap.engines.open_snapshots import OpenSnapshots
from kvsnap.engines.weights import loaded_model_fingerprint, remembered_answer
from kvsnap.format import SourceInfo
from kvsnap.layout import KVGeometry, dtype_name
from kvsnap.snapshot import Snapshot

#: transformers' layer type names, as snapshot attention types.
_ATTENTION_TYPES = {"full_attention": "full", "sliding_attention": "sliding"}

ModelLike = LoadedModel | torch.nn.Module


def module_of(model: ModelLike) -> Any:
    """The transformers model itself: a LoadedModel's ``model``, or ``model``.

    Typed ``Any``: its ``config`` and ``generate`` are the transformers model's own, which a
    ``torch.nn.Module`` annotation would type as submodules or tensors.
    """
    return model.model if isinstance(model, LoadedModel) else model


def _text_config(model: ModelLike | Any) -> Any:
    """The decoder config of a LoadedModel, a transformers model, or a config."""
    config = module_of(model).config if isinstance(model, (LoadedModel, torch.nn.Module)) else model
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def attention_types(model: ModelLike | Any) -> tuple[str, ...]:
    """Per layer, ``"full"`` or ``"sliding"``; other transformers layer types keep their name."""
    config = _text_config(model)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        kind = "sliding" if getattr(config, "sliding_window", None) is not None else "full"
        return (kind,) * config.num_hidden_layers
    return tuple(_ATTENTION_TYPES.get(layer_type, layer_type) for layer_type in layer_types)


def geometry_for_model(
    model: ModelLike | Any, block_size: int, dtype: torch.dtype | str | None = None
) -> KVGeometry:
    """The KV geometry of ``model``'s cache: what a snapshot must match to restore into it.

    Args:
        model: kvsnap's ``LoadedModel``, a transformers model, or its config.
        block_size: Tokens per block.
        dtype: The KV dtype. Default ``None``: the model's parameter dtype (a bare config
            needs one).

    Returns:
        The ``KVGeometry``: layers, block size, dtype, KV heads, head size, attention types.

    Raises:
        ValueError: A bare config without ``dtype``.

    Example:
        >>> from kvsnap.engines import transformers as kt
        >>> from kvsnap.engines.default_model import load_model
        >>> model = load_model()  # the built-in tiny Llama; any transformers causal LM works
        >>> kt.geometry_for_model(model, block_size=16).describe()
        '4 layers, 2 KV heads x head dim 32, 16 tokens/block, float32'
    """
    config = _text_config(model)
    if dtype is None:
        if isinstance(model, (LoadedModel, torch.nn.Module)):
            dtype = next(module_of(model).parameters()).dtype
        else:
            raise ValueError("geometry_for_model needs a dtype when given a config")
    name = dtype if isinstance(dtype, str) else dtype_name(dtype)
    num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return KVGeometry(
        num_layers=config.num_hidden_layers,
        block_size=block_size,
        dtype=name,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        attention_types=attention_types(config),
    )


def fingerprint_of(model: ModelLike) -> str:
    """The fingerprint a snapshot of ``model`` records: its config and its weights as they are
    now (``kvsnap.engines.weights.loaded_model_fingerprint``; remembered per model until a
    module, a parameter or a config setting changes, so a call costs one comparison pass over
    the module tree)."""
    return loaded_model_fingerprint(module_of(model))


def model_id_of(model: ModelLike) -> str:
    """The id a snapshot of ``model`` records: the ``LoadedModel``'s, else the config's
    ``name_or_path`` (where it was loaded from), else the model's class name."""
    if isinstance(model, LoadedModel):
        return model.model_id
    module = module_of(model)
    return getattr(module.config, "name_or_path", None) or type(module).__name__


def source_info(model: ModelLike | None) -> SourceInfo:
    """What a snapshot records about its origin: transformers, its version, the model."""
    if model is None:
        # Empty model id and fingerprint mean "unknown": restores then skip the fingerprint check.
        return SourceInfo(
            engine="transformers",
            engine_version=transformers.__version__,
            model_id="",
            model_revision=None,
            model_fingerprint="",
        )
    if isinstance(model, LoadedModel):
        revision = model.model_revision
    else:
        revision = getattr(module_of(model).config, "_commit_hash", None)
    return SourceInfo(
        engine="transformers",
        engine_version=transformers.__version__,
        model_id=model_id_of(model),
        model_revision=revision,
        model_fingerprint=fingerprint_of(model),
    )


def check_snapshot_fits(
    snapshot: Snapshot, model: ModelLike, *, dtype: torch.dtype | None = None, force: bool = False
) -> None:
    """Refuse a snapshot that does not fit ``model``, before anything is restored.

    The KV geometry must match (layers, KV heads, head dim, dtype), and the model fingerprint
    too unless ``force``.

    Args:
        snapshot: The open snapshot.
        model: kvsnap's ``LoadedModel`` or a transformers model.
        dtype: The KV dtype the target holds. Default ``None``: the model's.
        force: Skip the fingerprint check. Default ``False``.

    Raises:
        IncompatibleSnapshotError: The snapshot does not fit; the message names each
            differing field.

    Example:
        >>> from kvsnap.engines import transformers as kt
        >>> from kvsnap.engines.default_model import load_model
        >>> model = load_model()  # the built-in tiny Llama; any transformers causal LM works
        >>> [(cache, ids)] = kt.prefill(model, ["kvsnap restores the KV cache exactly."])
        >>> _ = kt.capture_dynamic_cache(cache, [ids], "prompt.safetensors", model=model)
        >>> import kvsnap
        >>> with kvsnap.Snapshot.open("prompt.safetensors") as snap:
        ...     kt.check_snapshot_fits(snap, model)  # fits: nothing happens
        >>> with kvsnap.Snapshot.open("prefix.safetensors") as snap:  # another model's KV
        ...     kt.check_snapshot_fits(snap, model)
        Traceback (most recent call last):
        ...
        kvsnap.errors.IncompatibleSnapshotError: ...(num_layers: snapshot 2, target 4; ...
    """
    geometry, fingerprint = _fit_answers(model, snapshot.geometry.block_size, dtype)
    snapshot.check_compatible(geometry, model_fingerprint=fingerprint, force=force)


def _fit_answers(
    model: ModelLike, block_size: int, dtype: torch.dtype | None
) -> tuple[KVGeometry, str]:
    """:func:`geometry_for_model` and :func:`fingerprint_of` ``model``, remembered per
    transformers model until its module tree, a parameter or a setting of its config changes
    (``kvsnap.engines.weights.remembered_answer``): recomputing the geometry from the config
    and checking the fingerprint's module walk cost 0.8-1.4 ms of every warm restore."""
    return remembered_answer(
        module_of(model),
        ("fit", block_size, dtype),
        lambda: (geometry_for_model(model, block_size, dtype), fingerprint_of(model)),
    )


def pick_sequence(snapshot: Snapshot, sequence_id: str | None) -> Any:
    """The record of sequence ``sequence_id``, or the only one when ``None``."""
    if sequence_id is not None:
        return snapshot.sequence(sequence_id)
    if len(snapshot.sequences) != 1:
        known = ", ".join(record.id for record in snapshot.sequences)
        raise ValueError(
            f"{snapshot.path} holds {len(snapshot.sequences)} sequences ({known}): name one"
        )
    return snapshot.sequences[0]


#: Snapshots these restores opened from a path, kept open for the next restore of the same
#: file version (:class:`~kvsnap.engines.open_snapshots.OpenSnapshots`: a rewrite in place, a
#: rename over it or its removal opens it anew). A descriptor each; ``kvsnap.clear_caches()``
#: closes them.
KEPT_SNAPSHOTS = OpenSnapshots(8, change_time=True)
register_cache_clear(KEPT_SNAPSHOTS.clear)


@contextmanager
def open_snapshot(snapshot: Snapshot | str | Path) -> Iterator[Snapshot]:
    """``snapshot`` itself when already open, else the snapshot at that path for the ``with``
    block: kept open after a block that raised nothing (:data:`KEPT_SNAPSHOTS`), so a process
    restoring the same file again opens, reads and checks its header only once."""
    if isinstance(snapshot, Snapshot):
        yield snapshot
        return
    path = os.fspath(snapshot)
    opened = KEPT_SNAPSHOTS.take(path, None) or Snapshot.open(path)
    try:
        yield opened
    except BaseException:
        opened.close()
        raise
    if not KEPT_SNAPSHOTS.keep(path, opened, None):
        opened.close()
