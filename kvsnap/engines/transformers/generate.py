"""Running the model with a ``DynamicCache``: forward, prefill, greedy continuation."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache

from kvsnap.engines.default_model import LoadedModel, prompt_problem
from kvsnap.engines.transformers.model import ModelLike, module_of


def _cache_keyword(module: torch.nn.Module) -> str:
    """The forward keyword of the cache: ``cache`` in 5.2x, ``past_key_values`` in 5.17."""
    parameters = inspect.signature(module.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def new_dynamic_cache(model: ModelLike | None = None) -> DynamicCache:
    """An empty ``DynamicCache``, built from the model's config when one is given."""
    if model is None:
        return DynamicCache()
    return DynamicCache(config=module_of(model).config)


@torch.no_grad()
def forward_with_cache(model: ModelLike, input_ids: Sequence[int], cache: Cache) -> torch.Tensor:
    """Run ``input_ids`` (one sequence) through the model, appending their KV to ``cache``.

    Positions continue from the cache's length. Returns the logits of the last token, ``(vocab,)``.
    """
    module = module_of(model)
    device = next(module.parameters()).device
    ids = torch.tensor([list(input_ids)], dtype=torch.long, device=device)
    outputs = module(input_ids=ids, use_cache=True, **{_cache_keyword(module): cache})
    return outputs.logits[0, -1]


def prefill(
    model: LoadedModel, prompts: Sequence[str], *, force: bool = False
) -> list[tuple[DynamicCache, list[int]]]:
    """Encode and run each prompt on its own, returning its ``DynamicCache`` and token ids.

    Each cache holds the KV of every token of its prompt (batch 1), ready for
    ``capture_dynamic_caches`` and, after a restore, ``continue_generation``.

    Args:
        model: kvsnap's ``LoadedModel``, which carries the tokenizer.
        prompts: The prompts, as text.
        force: Run a prompt longer than the model's positions anyway (see
            ``prefill_token_ids``). Default ``False``.

    Returns:
        Per prompt, its cache and its token ids.

    Raises:
        TypeError: A plain transformers model (no tokenizer): use ``prefill_token_ids``.
        ValueError: A prompt that is not what the model would read: it encodes to no
            ordinary token, to unknown tokens only, or to tokens that decode to less than
            half of its characters (a tokenizer that drops text); or one longer than the
            model's positions.

    Example:
        >>> from kvsnap.engines import transformers as kt
        >>> from kvsnap.engines.default_model import load_model
        >>> model = load_model()  # the built-in tiny Llama; any transformers causal LM works
        >>> [(cache, ids)] = kt.prefill(model, ["Hello"])
        >>> ids, cache.get_seq_length()
        ([256, 72, 101, 108, 108, 111], 6)
    """
    if not callable(getattr(model, "encode", None)):
        raise TypeError(
            f"prefill needs a LoadedModel, which carries the tokenizer "
            f"(kvsnap.engines.default_model.load_model), not a {type(model).__name__}: "
            "tokenize the prompts yourself and call prefill_token_ids(model, token_id_lists)"
        )
    token_id_lists = []
    for prompt in prompts:
        token_ids = model.encode(prompt)
        problem = prompt_problem(model, prompt, token_ids)
        if problem is not None:
            shown = prompt if len(prompt) <= 60 else prompt[:57] + "..."
            raise ValueError(f"prompt {shown!r} {problem}")
        token_id_lists.append(token_ids)
    return prefill_token_ids(model, token_id_lists, force=force)


def max_positions(model: ModelLike) -> int | None:
    """The most positions ``model`` takes (its config's ``max_position_embeddings``), if it
    says."""
    config = getattr(module_of(model), "config", None)
    text_config = getattr(config, "get_text_config", lambda: config)()
    value = getattr(text_config, "max_position_embeddings", None)
    return int(value) if isinstance(value, int) and value > 0 else None


def prefill_token_ids(
    model: ModelLike, token_id_lists: Sequence[Sequence[int]], *, force: bool = False
) -> list[tuple[DynamicCache, list[int]]]:
    """Run each token id list on its own (batch 1) and return its ``DynamicCache`` and the ids.

    Args:
        model: kvsnap's ``LoadedModel`` or a transformers model.
        token_id_lists: One list of token ids per sequence.
        force: Run a list longer than the model's positions (``max_position_embeddings``)
            anyway: its KV beyond them is whatever the model computes for positions it was
            not built for. Default ``False``.

    Returns:
        Per list, a cache holding the KV of every token, and the ids as ints.

    Raises:
        ValueError: An empty token id list, or one longer than the model's positions.

    Example:
        >>> from kvsnap.engines import transformers as kt
        >>> from kvsnap.engines.default_model import load_model
        >>> model = load_model()  # the built-in tiny Llama; any transformers causal LM works
        >>> [(cache, ids)] = kt.prefill_token_ids(model, [[256, 72, 105]])
        >>> cache.get_seq_length()
        3
    """
    limit = max_positions(model)
    longest = max((len(token_ids) for token_ids in token_id_lists), default=0)
    if limit is not None and longest > limit and not force:
        raise ValueError(
            f"a sequence of {longest} tokens is longer than the model's {limit} positions "
            "(max_position_embeddings): its KV beyond them would be computed at positions the "
            "model was not built for (force=True runs it anyway)"
        )
    results = []
    for token_ids in token_id_lists:
        ids = [int(token) for token in token_ids]
        cache = new_dynamic_cache(model)
        forward_with_cache(model, ids, cache)
        results.append((cache, ids))
    return results


def generate_greedy(model: ModelLike, token_ids: Sequence[int], max_new_tokens: int) -> list[int]:
    """Greedy tokens after ``token_ids``, computed from scratch: what a restore must match."""
    return continue_generation(model, new_dynamic_cache(model), token_ids, max_new_tokens)


@torch.no_grad()
def continue_generation(
    model: ModelLike,
    cache: Cache,
    token_ids: Sequence[int],
    max_new_tokens: int,
    *,
    eos_token_id: int | None = None,
) -> list[int]:
    """Greedy-decode ``max_new_tokens`` tokens after ``token_ids``, from a cache holding a prefix.

    The tokens the cache lacks are run in one forward pass; when it already holds all of them,
    the last token's KV is dropped and recomputed, because a snapshot stores KV and not the
    logits that pick the next token. Decoding then proceeds one token at a time. The cache is
    extended in place.

    Args:
        model: kvsnap's ``LoadedModel`` or a transformers model.
        cache: A batch-1 cache holding the KV of ``token_ids[:k]`` for some ``k`` (its
            length), e.g. from ``restore_dynamic_cache``.
        token_ids: The whole sequence so far.
        max_new_tokens: How many tokens to generate.
        eos_token_id: Stop after generating this token. Default ``None``: never stop early.

    Returns:
        The new tokens only.

    Raises:
        ValueError: A negative ``max_new_tokens``, no token ids, or a cache holding more
            tokens than given.

    Example:
        >>> from kvsnap.engines import transformers as kt
        >>> from kvsnap.engines.default_model import load_model
        >>> model = load_model()  # the built-in tiny Llama; any transformers causal LM works
        >>> [(cache, ids)] = kt.prefill(model, ["kvsnap restores the KV cache exactly."])
        >>> _ = kt.capture_dynamic_cache(cache, [ids], "prompt.safetensors", model=model)
        >>> restored, token_ids = kt.restore_dynamic_cache("prompt.safetensors", model=model)
        >>> continued = kt.continue_generation(model, restored, token_ids, 8)
        >>> continued == kt.generate_greedy(model, token_ids, 8)  # as if never interrupted
        True
    """
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    cached = _leave_tokens_to_run(cache, token_ids, "continue_generation")
    if max_new_tokens == 0:
        return []
    generated: list[int] = []
    pending = list(token_ids[cached:])
    while len(generated) < max_new_tokens:
        logits = forward_with_cache(model, pending, cache)
        token = int(torch.argmax(logits))
        generated.append(token)
        if eos_token_id is not None and token == eos_token_id:
            break
        pending = [token]
    return generated


def _leave_tokens_to_run(cache: Cache, token_ids: Sequence[int], caller: str) -> int:
    """Check ``cache`` holds a prefix of ``token_ids``, and drop the last token's KV when it
    holds them all, so that at least one token is left to run; return the cached length."""
    if not token_ids:
        raise ValueError(f"{caller} needs at least one token id")
    cached = cache.get_seq_length()
    if cached > len(token_ids):
        raise ValueError(
            f"the cache holds {cached} tokens, more than the {len(token_ids)} token ids given"
        )
    if cached == len(token_ids):
        cache.crop(-1)
        cached -= 1
    return cached


@torch.no_grad()
def generate_from_restored(
    model: ModelLike, cache: Cache, token_ids: Sequence[int], **generate_kwargs: Any
) -> Any:
    """Transformers' own ``model.generate``, continued from a cache holding a prefix of the tokens.

    ``generate`` must be given *all* of ``token_ids`` and a cache holding *fewer* of them: it
    runs the uncached ones and takes the next token from the last one's logits. Given a cache
    holding every token, transformers 5.17-5.24 runs the last token a second time and appends
    its KV twice, and the continuation silently drifts. So when the cache holds all of
    ``token_ids``, the last token's KV is dropped first (it is recomputed bit for bit). The
    cache is extended in place.

    Args:
        model: kvsnap's ``LoadedModel`` or a transformers model.
        cache: A batch-1 cache holding the KV of ``token_ids[:k]``, e.g. from
            ``restore_dynamic_cache``.
        token_ids: The whole sequence so far.
        **generate_kwargs: Passed on to ``generate`` (``max_new_tokens``, ``do_sample``, ...);
            an all-ones ``attention_mask`` is passed unless one is given.

    Returns:
        ``generate``'s output: ``(1, len(token_ids) + new)`` token ids, prompt included.

    Raises:
        ValueError: No token ids, or a cache holding more tokens than given.

    Example:
        >>> from kvsnap.engines import transformers as kt
        >>> from kvsnap.engines.default_model import load_model
        >>> model = load_model()  # the built-in tiny Llama; any transformers causal LM works
        >>> [(cache, ids)] = kt.prefill(model, ["kvsnap restores the KV cache exactly."])
        >>> _ = kt.capture_dynamic_cache(cache, [ids], "prompt.safetensors", model=model)
        >>> restored, token_ids = kt.restore_dynamic_cache("prompt.safetensors", model=model)
        >>> output = kt.generate_from_restored(
        ...     model, restored, token_ids, max_new_tokens=4, do_sample=False
        ... )
        >>> output[0, : len(token_ids)].tolist() == token_ids
        True
    """
    _leave_tokens_to_run(cache, token_ids, "generate_from_restored")
    module = module_of(model)
    device = next(module.parameters()).device
    ids = torch.tensor([[int(token) for token in token_ids]], dtype=torch.long, device=device)
    generate_kwargs.setdefault("attention_mask", torch.ones_like(ids))
    # generate takes the cache under the forward's name: ``cache`` in 5.2x, else past_key_values.
    return module.generate(ids, **{_cache_keyword(module): cache}, **generate_kwargs)
