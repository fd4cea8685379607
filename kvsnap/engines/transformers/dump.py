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
    pass that filled the cache for them; at step ``step`` (0 is the prompt's prefill, ``s`` is
    after ``s`` generated tokens) this one captures the cache, one sequence per batch row named
    ``sequence_ids`` (default ``seq-0``, ...), with the row's tokens so far. It returns the scores
    unchanged, so generation is not affected.

    The cache object is found by a forward pre-hook on the model (``attached``), so it works with
    the cache ``generate`` creates itself::

        hook = KVDumpHook("step5.safetensors", step=5, model=loaded)
        with hook.attached(loaded.model):
            out = loaded.model.generate(ids, max_new_tokens=20, logits_processor=[hook])
        hook.result  # the CaptureResult, or None if generation stopped before step 5
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

    ``model`` is a :class:`~kvsnap.engines.default_model.LoadedModel` or a plain transformers
    model; ``input_ids`` one sequence or a ``(batch, tokens)`` tensor. Returns ``generate``'s
    output (unchanged by the dump) and the capture result. Raises ``RuntimeError`` when
    generation ends before ``step``.
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
