"""Prompts as a user holds them, for ``capture`` and ``restore``: text (``--prompt``,
``--prompts-file``), text through the model's chat template (``--chat``), and token ids
(``--tokens FILE``); each checked before any prefill is run, so that a capture is never
silently of something else: a prompt the tokenizer drops, ids outside the vocabulary, or a
sequence longer than the model's positions (refused, or run with a warning under ``--force``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .output import UsageError

if TYPE_CHECKING:
    from kvsnap.engines.default_model import LoadedModel


def read_token_file(path: Path) -> list[list[int]]:
    """The token id sequences in ``path``: a JSON list of ids (one sequence), a JSON list of
    such lists, or plain text with one sequence per non-blank line (ids separated by
    whitespace or commas)."""
    option = f"--tokens {path}"
    if not path.is_file():
        raise UsageError(f"{option}: no such file")
    content = path.read_text()
    try:
        parsed: Any = json.loads(content)
    except json.JSONDecodeError:
        parsed = None
    if parsed is not None:
        sequences = (
            parsed if parsed and all(isinstance(item, list) for item in parsed) else [parsed]
        )
    else:
        sequences = [line.replace(",", " ").split() for line in content.splitlines()]
        sequences = [sequence for sequence in sequences if sequence]
    try:
        ids = [[_token(value) for value in sequence] for sequence in sequences]
    except ValueError:
        raise UsageError(
            f"{option}: token ids are non-negative integers: a JSON list, a JSON list of lists, "
            "or one sequence per line"
        ) from None
    if not ids or not all(ids):
        raise UsageError(f"{option}: holds no token ids (a sequence must not be empty)")
    return ids


def _token(value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError(value)
    number = int(value) if isinstance(value, str) else value
    if not isinstance(number, int) or number < 0:
        raise ValueError(value)
    return number


def encode_prompts(loaded: LoadedModel, prompts: list[str], *, chat: bool) -> list[list[int]]:
    """Each prompt's token ids (through the model's chat template with ``chat``), refused
    when they are not the prompt (``kvsnap.engines.default_model.prompt_problem``)."""
    from kvsnap.engines.default_model import prompt_problem

    sequences = []
    for prompt in prompts:
        ids = _chat_ids(loaded, prompt) if chat else loaded.encode(prompt)
        problem = prompt_problem(loaded, prompt, ids)
        if problem is not None:
            shown = prompt if len(prompt) <= 60 else prompt[:57] + "..."
            raise UsageError(f"--prompt {shown!r} {problem}")
        sequences.append(ids)
    return sequences


def _chat_ids(loaded: LoadedModel, prompt: str) -> list[int]:
    """``prompt`` as the user's message in the model's chat template, ready for the reply."""
    tokenizer = loaded.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise UsageError(
            f"--chat: model {loaded.model_id!r} has no chat template (its tokenizer files "
            "define none): leave out --chat to capture the prompt as written"
        )
    messages = [{"role": "user", "content": prompt}]
    templated = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return [int(token) for token in tokenizer.encode(templated, add_special_tokens=False)]


def check_token_ids(loaded: LoadedModel, sequences: list[list[int]]) -> None:
    """Refuse ``--tokens`` ids outside the model's vocabulary."""
    embeddings: Any = loaded.model.get_input_embeddings()
    vocab_size = int(embeddings.num_embeddings)
    for number, sequence in enumerate(sequences, start=1):
        largest = max(sequence)
        if largest >= vocab_size:
            raise UsageError(
                f"--tokens: sequence {number} holds token id {largest}, outside the vocabulary "
                f"of model {loaded.model_id!r} ({vocab_size} ids)"
            )


def position_warning(
    loaded: LoadedModel, lengths: list[int], *, force: bool, what: str
) -> str | None:
    """Refuse (without ``force``) a sequence longer than the model's positions; with
    ``force``, the warning to show. ``what`` names the sequences (``a prompt``)."""
    from kvsnap.engines.transformers.generate import max_positions

    limit = max_positions(loaded)
    longest = max(lengths, default=0)
    if limit is None or longest <= limit:
        return None
    message = (
        f"{what} of {longest} tokens is longer than the {limit} positions of model "
        f"{loaded.model_id!r} (max_position_embeddings): its KV beyond them would be computed "
        "at positions the model was not built for"
    )
    if not force:
        raise UsageError(f"{message}; use --force to run it anyway")
    return f"{message} (run anyway: --force)"
