"""Dumping the KV cache from inside ``model.generate(...)``, without changing its output."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from transformers import LogitsProcessor, LogitsProcessorList
from transformers.cache_utils import Cache

from kvsnap.engines.transformers.dynamic import capture_dynamic_cache
from kvsnap.engines.transformers.model import ModelLike, module_of
from kvsnap.snapshot import CaptureResult


class KVDumpHook(LogitsProcessor):
    """Snapshot the KV cache of a running ``model.generate(...)`` at one generation step.

    A logits processor is called once per step with every token so far, right after the forward
    pass that filled the cache for them; at step ``step`` this one captures the cache, one
    sequence per batch row, with the row's tokens so far. It returns the scores unchanged, so
    generation is not affected. The cache object is found by a forward pre-hook on the model
    (``attached``), so it works with the cache ``generate`` creates itself. ``result`` is the
    ``CaptureResult`` afterwards, or ``None`` if generation stopped before ``step``.

    Args:
        path: Where the snapshot goes.
        step: The generation step: 0 is the prompt's prefill, ``s`` is after ``s`` generated
            tokens.
        model: The model, recorded as the snapshot's source. Default ``None``: unknown.
        block_size: Tokens per snapshot block. Default ``16``.
        sequence_ids: The sequences' names. Default ``None``: ``"seq-0"``, ``"seq-1"``, ...
        **capture_kwargs: Passed on to ``kvsnap.capture``.

    Raises:
        ValueError: A negative ``step``; during ``generate``, a hook used outside
            ``with hook.attached(model):``.

    Example:
        >>> from kvsnap.engines import transformers as kt
        >>> from kvsnap.engines.default_model import load_model
        >>> model = load_model()  # the built-in tiny Llama; any transformers causal LM works
        >>> import torch
        >>> ids = torch.tensor([model.encode("Hello")])  # 6 tokens
        >>> hook = kt.KVDumpHook("step3.safetensors", step=3, model=model)
        >>> with hook.attached(model), torch.no_grad():
        ...     output = model.model.generate(
        ...         ids, max_new_tokens=5, do_sample=False, logits_processor=[hook]
        ...     )
        >>> hook.result.num_tokens  # the prompt and 3 generated tokens
        9
    """

    def __init__(
        self,
        path: str | Path,
        *,
        step: int,
        model: ModelLike | None = None,
        block_size: int = 16,
        sequence_ids: Sequence[str] | None = None,
        **capture_kwargs: Any,
    ) -> None:
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        self.path = path
        self.step = step
        self.model = model
        self.block_size = block_size
        self.sequence_ids = sequence_ids
        self.capture_kwargs = capture_kwargs
        self.result: CaptureResult | None = None
        self.cache: Cache | None = None
        self._prompt_length: int | None = None

    def _remember_cache(
        self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        for value in kwargs.values():
            if isinstance(value, Cache):
                self.cache = value
                return

    @contextmanager
    def attached(self, module: ModelLike) -> Iterator[KVDumpHook]:
        """Watch ``module``'s forward calls for the cache while the ``with`` block runs.

        Each ``with`` block starts afresh (no cache, no result, steps counted from the next
        ``generate``'s prompt), so one hook can dump several runs in turn.
        """
        self.cache, self.result, self._prompt_length = None, None, None
        handle = module_of(module).register_forward_pre_hook(self._remember_cache, with_kwargs=True)
        try:
            yield self
        finally:
            handle.remove()

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self._prompt_length is None:
            self._prompt_length = input_ids.shape[1]
        if input_ids.shape[1] - self._prompt_length == self.step and self.result is None:
            if self.cache is None:
                raise ValueError(
                    "KVDumpHook saw no cache: use it inside `with hook.attached(model):`"
                )
            self.result = capture_dynamic_cache(
                self.cache,
                input_ids,
                self.path,
                model=self.model,
                block_size=self.block_size,
                sequence_ids=self.sequence_ids,
                **self.capture_kwargs,
            )
        return scores


def dump_at_step(
    model: ModelLike,
    input_ids: Sequence[int] | torch.Tensor,
    step: int,
    path: str | Path,
    *,
    block_size: int = 16,
    **generate_kwargs: Any,
) -> tuple[Any, CaptureResult]:
    """Run ``model.generate`` on ``input_ids`` and snapshot its KV cache at ``step``.

    Args:
        model: kvsnap's ``LoadedModel`` or a transformers model.
        input_ids: One sequence of token ids, or a ``(batch, tokens)`` tensor.
        step: The generation step to snapshot (0: the prompt's prefill).
        path: Where the snapshot goes.
        block_size: Tokens per snapshot block. Default ``16``.
        **generate_kwargs: Passed on to ``generate`` (``max_new_tokens``, ``do_sample``, a
            ``logits_processor`` list the hook joins, ...).

    Returns:
        ``generate``'s output (unchanged by the dump) and the ``CaptureResult``.

    Raises:
        ValueError: Generation ended before ``step``; nothing was dumped.

    Example:
        >>> from kvsnap.engines import transformers as kt
        >>> from kvsnap.engines.default_model import load_model
        >>> model = load_model()  # the built-in tiny Llama; any transformers causal LM works
        >>> ids = model.encode("Hello")
        >>> output, result = kt.dump_at_step(
        ...     model, ids, 0, "prefill.safetensors", max_new_tokens=4, do_sample=False
        ... )
        >>> result.num_tokens  # step 0: the prompt's prefill
        6
    """
    ids = input_ids if isinstance(input_ids, torch.Tensor) else torch.tensor([list(input_ids)])
    module = module_of(model)
    ids = ids.to(next(module.parameters()).device)
    hook = KVDumpHook(path, step=step, model=model, block_size=block_size)
    processors = LogitsProcessorList(generate_kwargs.pop("logits_processor", None) or [])
    processors.append(hook)
    with hook.attached(module):
        output = module.generate(ids, logits_processor=processors, **generate_kwargs)
    if hook.result is None:
        raise ValueError(f"generation ended before step {step}; nothing was dumped")
    return output, hook.result
