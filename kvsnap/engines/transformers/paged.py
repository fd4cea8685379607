"""Capture and restore through a continuous-batching cache's block tables and allocator.

``capture_paged_cache`` captures live requests by their block tables,
``capture_paged_prefix`` captures the complete blocks the cache keeps for prefix sharing,
and ``restore_paged_cache`` allocates blocks through the cache's own allocator, restores
into them and (by default) registers them as cached prefix blocks, so that the next request
whose prompt starts with those tokens skips their prefill — exactly how continuous batching
resumes from its own prefix cache.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers

from kvsnap.engines.transformers.model import (
    ModelLike,
    fingerprint_of,
    open_snapshot,
    pick_sequence,
    source_info,
)
from kvsnap.engines.transformers.paged_cache import PagedCacheAdapter, paged_cache_adapter
from kvsnap.layout import LayoutError
from kvsnap.pipeline import TransferOptions
from kvsnap.snapshot import CaptureResult, SequenceBlocks, Snapshot, capture


def _sequence_blocks(
    sequence_id: str, tokens: Sequence[int], blocks: Sequence[int], block_size: int
) -> SequenceBlocks:
    needed = math.ceil(len(tokens) / block_size)
    if needed == 0:
        raise ValueError(f"sequence {sequence_id!r} has no tokens")
    if len(blocks) < needed:
        raise ValueError(
            f"sequence {sequence_id!r}: {len(tokens)} tokens need {needed} blocks of {block_size}, "
            f"the cache holds {len(blocks)}"
        )
    return SequenceBlocks(
        id=sequence_id,
        token_ids=np.asarray(tokens, dtype=np.int64),
        block_ids=np.asarray(blocks[:needed], dtype=np.int64),
    )


@contextmanager
def _held_still(cache_or_manager: Any) -> Iterator[None]:
    """Keep a continuous-batching cache from changing while kvsnap reads or writes it.

    A running manager is paused (``manager.pause()``, transformers 5.2x), and on CUDA the device
    is synchronized so the last forward pass has finished writing KV. A bare cache, or a manager
    that is not running, is the caller's to keep still; so is a running 5.17 manager, which
    cannot pause.
    """
    running = hasattr(cache_or_manager, "input_queue") and cache_or_manager.is_running()
    pause = getattr(cache_or_manager, "pause", None) if running else None
    with pause() if pause is not None else nullcontext():
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        yield


def capture_paged_cache(
    cache: Any,
    request_ids: Sequence[str],
    token_ids: Mapping[str, Sequence[int]],
    path: str | Path,
    *,
    model: ModelLike | None,
    **capture_kwargs: Any,
) -> CaptureResult:
    """Snapshot live requests of a continuous-batching cache, found through their block tables.

    Each request becomes a snapshot sequence named by its request id. A running manager is
    paused for the capture (``capture_manager_requests`` also finds the tokens).

    Args:
        cache: A ``PagedAttentionCache``, or a ``ContinuousBatchingManager``.
        request_ids: The requests to capture.
        token_ids: Per request id, the tokens whose KV its blocks hold, in order.
        path: Where the snapshot goes.
        model: The model whose KV it is: it fills the snapshot's source (model id,
            fingerprint); ``None`` records an unknown source.
        **capture_kwargs: Passed on to ``kvsnap.capture``.

    Returns:
        The ``CaptureResult`` of ``kvsnap.capture``.

    Raises:
        KeyError: A request id that holds no blocks in the cache.
        ValueError: More tokens than the request's blocks hold, or a manager without a
            cache yet.
        LayoutError: A cache kvsnap cannot describe (sliding-window layer groups).

    Example:
        >>> from kvsnap.engines import transformers as kt
        >>> from kvsnap.engines.default_model import load_model
        >>> model = load_model()  # the built-in tiny Llama; any transformers causal LM works
        >>> [(cache, ids)] = kt.prefill(model, ["kvsnap restores the KV cache exactly."])
        >>> _ = kt.capture_dynamic_cache(cache, [ids], "prompt.safetensors", model=model)
        >>> from transformers import GenerationConfig
        >>> from transformers.generation.configuration_utils import ContinuousBatchingConfig
        >>> manager = model.model.init_continuous_batching(  # transformers 5.2x; not started
        ...     generation_config=GenerationConfig(max_new_tokens=8, do_sample=False),
        ...     continuous_batching_config=ContinuousBatchingConfig(
        ...         num_blocks=16, max_batch_tokens=64, page_size=16, use_async_batching=False
        ...     ),
        ... )
        >>> held = kt.restore_paged_cache(
        ...     "prompt.safetensors", manager, request_id="held", as_prefix=False, model=model
        ... )
        >>> result = kt.capture_paged_cache(
        ...     manager, ["held"], {"held": ids}, "held.safetensors", model=model
        ... )
        >>> result.num_sequences, result.num_tokens
        (1, 38)
    """
    with _held_still(cache):
        return _capture_requests(
            paged_cache_adapter(cache), request_ids, token_ids, path, model, capture_kwargs
        )


def _capture_requests(
    adapter: PagedCacheAdapter,
    request_ids: Sequence[str],
    token_ids: Mapping[str, Sequence[int]],
    path: str | Path,
    model: ModelLike | None,
    capture_kwargs: dict[str, Any],
) -> CaptureResult:
    sequences = [
        _sequence_blocks(
            request_id, token_ids[request_id], adapter.block_table(request_id), adapter.block_size
        )
        for request_id in request_ids
    ]
    return capture(adapter.layout(), sequences, path, source=source_info(model), **capture_kwargs)


def capture_paged_prefix(
    cache: Any,
    token_ids: Mapping[str, Sequence[int]],
    path: str | Path,
    *,
    model: ModelLike | None,
    **capture_kwargs: Any,
) -> CaptureResult:
    """Snapshot the prefix blocks a continuous-batching cache keeps for these token sequences.

    With block sharing on (the default), the cache keeps the complete blocks of finished
    requests, hashed by their tokens, to reuse them for later prompts. For each sequence this
    captures the longest chain of such blocks: a whole number of blocks, so possibly fewer
    tokens than given. A running manager is paused meanwhile.

    Args:
        cache: A ``PagedAttentionCache``, or a ``ContinuousBatchingManager``.
        token_ids: Per sequence name, its tokens.
        path: Where the snapshot goes.
        model: The model whose KV it is: it fills the snapshot's source (model id,
            fingerprint); ``None`` records an unknown source.
        **capture_kwargs: Passed on to ``kvsnap.capture``.

    Returns:
        The ``CaptureResult`` of ``kvsnap.capture``.

    Raises:
        ValueError: The cache holds no complete block of a sequence.
        LayoutError: A cache kvsnap cannot describe (sliding-window layer groups).

    Example:
        >>> from kvsnap.engines import transformers as kt
        >>> from kvsnap.engines.default_model import load_model
        >>> model = load_model()  # the built-in tiny Llama; any transformers causal LM works
        >>> [(cache, ids)] = kt.prefill(model, ["kvsnap restores the KV cache exactly."])
        >>> _ = kt.capture_dynamic_cache(cache, [ids], "prompt.safetensors", model=model)
        >>> from transformers import GenerationConfig
        >>> from transformers.generation.configuration_utils import ContinuousBatchingConfig
        >>> manager = model.model.init_continuous_batching(  # transformers 5.2x; not started
        ...     generation_config=GenerationConfig(max_new_tokens=8, do_sample=False),
        ...     continuous_batching_config=ContinuousBatchingConfig(
        ...         num_blocks=16, max_batch_tokens=64, page_size=16, use_async_batching=False
        ...     ),
        ... )
        >>> _ = kt.restore_paged_cache("prompt.safetensors", manager, model=model)
        >>> result = kt.capture_paged_prefix(
        ...     manager, {"prompt": ids}, "cached.safetensors", model=model
        ... )
        >>> result.num_tokens  # the two whole blocks of the 38 tokens
        32
    """
    with _held_still(cache):
        adapter = paged_cache_adapter(cache)
        sequences = []
        for name, tokens in token_ids.items():
            blocks = adapter.cached_prefix_blocks(tokens)
            if not blocks:
                raise ValueError(
                    f"the cache holds no complete block of sequence {name!r} "
                    f"(blocks of {adapter.block_size} tokens, {len(tokens)} tokens given)"
                )
            covered = len(blocks) * adapter.block_size
            sequences.append(
                _sequence_blocks(name, list(tokens[:covered]), blocks, adapter.block_size)
            )
        return capture(
            adapter.layout(), sequences, path, source=source_info(model), **capture_kwargs
        )


def live_request_tokens(manager: Any, request_id: str) -> list[int]:
    """The tokens whose KV a live request of a paused manager holds in the cache.

    That is its prompt and generated tokens up to its current length: the newest generated
    token has no KV yet (it is the next forward pass's input).
    """
    processor = manager.batch_processor
    if processor is None:
        raise ValueError("the continuous batching manager has no cache yet: start it first")
    state = processor.scheduler.active_requests.get(request_id)
    if state is None:
        known = ", ".join(sorted(processor.scheduler.active_requests)) or "none"
        raise KeyError(f"request {request_id!r} is not active in the manager (active: {known})")
    tokens = list(state.initial_tokens) + list(state.generated_tokens)
    return [int(token) for token in tokens[: state.current_len()]]


def capture_manager_requests(
    manager: Any,
    request_ids: Sequence[str],
    path: str | Path,
    *,
    model: ModelLike | None,
    **capture_kwargs: Any,
) -> CaptureResult:
    """Snapshot live requests of a running ``ContinuousBatchingManager`` mid-generation.

    The manager is paused for the capture (``manager.pause()``, transformers 5.2x) and resumes
    afterwards with its requests intact; each request's tokens are found with
    ``live_request_tokens``, so each sequence holds the request's prompt and the tokens
    generated so far whose KV the cache holds.

    Args:
        manager: A running ``ContinuousBatchingManager``.
        request_ids: The live requests to capture.
        path: Where the snapshot goes.
        model: The model whose KV it is: it fills the snapshot's source (model id,
            fingerprint); ``None`` records an unknown source.
        **capture_kwargs: Passed on to ``kvsnap.capture``.

    Returns:
        The ``CaptureResult`` of ``kvsnap.capture``.

    Raises:
        ValueError: A manager that is not running, one batching asynchronously (the newest
            tokens' KV may still be in flight at a pause), or one that cannot pause
            (transformers 5.17: call ``capture_paged_cache`` from the generation thread).
        KeyError: A request that is not active in the manager.

    Example:
        >>> from kvsnap.engines import transformers as kt
        >>> from kvsnap.engines.default_model import load_model
        >>> model = load_model()  # the built-in tiny Llama; any transformers causal LM works
        >>> ids = model.encode("kvsnap restores the KV cache exactly.")  # 38 tokens
        >>> from transformers import GenerationConfig
        >>> from transformers.generation.configuration_utils import ContinuousBatchingConfig
        >>> manager = model.model.init_continuous_batching(  # transformers 5.2x; not started
        ...     generation_config=GenerationConfig(max_new_tokens=8, do_sample=False),
        ...     continuous_batching_config=ContinuousBatchingConfig(
        ...         num_blocks=16, max_batch_tokens=64, page_size=16, use_async_batching=False
        ...     ),
        ... )
        >>> manager.start()
        >>> request_id = manager.add_request(ids, max_new_tokens=8, streaming=True)
        >>> for output in manager.request_id_iter(request_id):
        ...     if len(output.generated_tokens) == 3:
        ...         result = kt.capture_manager_requests(
        ...             manager, [request_id], "live.safetensors", model=model
        ...         )
        ...     if output.is_finished():
        ...         break
        >>> manager.stop(block=True)
        >>> len(ids) < result.num_tokens < len(ids) + 8  # the prompt and what was generated
        True
    """
    processor = manager.batch_processor
    if processor is None or not manager.is_running():
        raise ValueError("capture_manager_requests needs a running manager (live requests)")
    if getattr(processor, "use_async_batching", False):
        raise ValueError(
            "the manager uses asynchronous batching, whose newest KV may still be in flight at a "
            "pause: set use_async_batching=False in its ContinuousBatchingConfig to capture live "
            "requests"
        )
    if not hasattr(manager, "pause"):
        raise ValueError(
            f"transformers {transformers.__version__} cannot pause a running manager: capture "
            "from the generation thread with capture_paged_cache instead"
        )
    with _held_still(manager):
        tokens = {
            request_id: live_request_tokens(manager, request_id) for request_id in request_ids
        }
        return _capture_requests(
            paged_cache_adapter(manager), request_ids, tokens, path, model, capture_kwargs
        )


@dataclass(frozen=True)
class PagedRestore:
    """What ``restore_paged_cache`` did.

    ``block_ids`` are the cache blocks holding the sequence (the request's block table when the
    blocks were kept; otherwise the blocks as restored, the complete ones now cached for prefix
    sharing). ``prefix_tokens`` is how many leading tokens a new request can take from the
    prefix cache (whole blocks); 0 when the blocks were kept for ``request_id``.
    """

    request_id: str
    token_ids: list[int]
    block_ids: list[int]
    prefix_tokens: int


def restore_paged_cache(
    snapshot: Snapshot | str | Path,
    cache: Any,
    *,
    sequence_id: str | None = None,
    request_id: str | None = None,
    as_prefix: bool = True,
    model: ModelLike | None = None,
    force: bool = False,
    backend: str = "auto",
) -> PagedRestore:
    """Restore one snapshot sequence into a continuous-batching cache, through its own allocator.

    Blocks for the sequence are allocated by the cache's allocator and the snapshot's KV is
    restored into them. A fresh engine is restored into before it starts (``manager =
    model.init_continuous_batching(...)``, restore, ``manager.start()``): the manager is warmed
    up here to create its cache, and starting it keeps the prefix blocks. A running manager is
    paused for the restore (transformers 5.2x).

    Args:
        snapshot: An open ``Snapshot``, or the path of one.
        cache: A ``PagedAttentionCache``, or a ``ContinuousBatchingManager``.
        sequence_id: The sequence. Default ``None``: the snapshot's only one.
        request_id: The request the blocks are allocated to. Default ``None``:
            ``"kvsnap-restore-<sequence id>"``.
        as_prefix: ``True``: hash the complete blocks the way the cache hashes its own and
            release the request, so that they stay as prefix blocks and a request whose
            prompt starts with the sequence's tokens skips their prefill (needs
            ``allow_block_sharing``). ``False``: the blocks stay held by ``request_id``;
            release them with ``cache.free_blocks(request_id)``. Default ``True``.
        model: Check the snapshot's fingerprint against this model. Default ``None``: not
            checked.
        force: Skip the fingerprint check. Default ``False``.
        backend: The copy backend (``TransferOptions.backend``). Default ``"auto"``.

    Returns:
        A ``PagedRestore``: the request id, the token ids, the cache blocks holding them and
        how many leading tokens a new request can take from the prefix cache.

    Raises:
        IncompatibleSnapshotError: The snapshot does not fit the cache's geometry (page size,
            layers, KV heads, head dim, dtype) or the model; nothing is allocated.
        UnknownSequenceError: No sequence of that id.
        CacheCapacityError: The cache has too few free blocks.
        LayoutError: ``as_prefix`` with block sharing off, or a cache kvsnap cannot
            describe.

    Example:
        >>> from kvsnap.engines import transformers as kt
        >>> from kvsnap.engines.default_model import load_model
        >>> model = load_model()  # the built-in tiny Llama; any transformers causal LM works
        >>> [(cache, ids)] = kt.prefill(model, ["kvsnap restores the KV cache exactly."])
        >>> _ = kt.capture_dynamic_cache(cache, [ids], "prompt.safetensors", model=model)
        >>> from transformers import GenerationConfig
        >>> from transformers.generation.configuration_utils import ContinuousBatchingConfig
        >>> manager = model.model.init_continuous_batching(  # transformers 5.2x; not started
        ...     generation_config=GenerationConfig(max_new_tokens=8, do_sample=False),
        ...     continuous_batching_config=ContinuousBatchingConfig(
        ...         num_blocks=16, max_batch_tokens=64, page_size=16, use_async_batching=False
        ...     ),
        ... )
        >>> restored = kt.restore_paged_cache("prompt.safetensors", manager, model=model)
        >>> restored.prefix_tokens  # whole blocks: a request starting so skips 32 tokens
        32
    """
    with _held_still(cache):
        return _restore_paged(
            snapshot,
            paged_cache_adapter(cache, create=True),
            sequence_id,
            request_id,
            as_prefix,
            model,
            force,
            backend,
        )


def _restore_paged(
    snapshot: Snapshot | str | Path,
    adapter: PagedCacheAdapter,
    sequence_id: str | None,
    request_id: str | None,
    as_prefix: bool,
    model: ModelLike | None,
    force: bool,
    backend: str,
) -> PagedRestore:
    if as_prefix and not adapter.uses_prefix_sharing:
        raise LayoutError(
            "the cache does not share prefix blocks (allow_block_sharing is off), so a restored "
            "prefix could not be reused; restore with as_prefix=False to keep the blocks for a "
            "request id"
        )
    layout = adapter.layout()
    with open_snapshot(snapshot) as opened:
        record = pick_sequence(opened, sequence_id)
        fingerprint = fingerprint_of(model) if model is not None else None
        opened.check_compatible(layout.geometry, model_fingerprint=fingerprint, force=force)
        tokens = record.token_ids.tolist()
        owner = request_id or f"kvsnap-restore-{record.id}"
        blocks = adapter.allocate(owner, len(tokens))
        try:
            opened.restore(
                layout,
                {record.id: np.asarray(blocks, dtype=np.int64)},
                transfer=TransferOptions(backend=backend),
                model_fingerprint=fingerprint,
                force=force,
            )
        except BaseException:
            adapter.free(owner)
            raise
    if not as_prefix:
        return PagedRestore(owner, tokens, blocks, 0)
    blocks = adapter.register_complete_blocks(owner, tokens)
    adapter.free(owner)
    return PagedRestore(
        owner, tokens, blocks, (len(tokens) // adapter.block_size) * adapter.block_size
    )
