"""Small transformers models saved the way a user has them: a directory with ``config.json``
and weights, with or without tokenizer files (a real byte-level BPE tokenizer trained here,
offline, with a chat template), built from configs with no download."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

#: What the test tokenizer is trained on: enough for ordinary English words to be tokens.
CORPUS = [
    "The quick brown fox jumps over the lazy dog. Hello world, kvsnap keeps the KV cache.",
    "A system prompt worth keeping, and a question about it: what comes next?",
] * 20
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def save_tokenizer(
    directory: Path, vocab_size: int = 300, *, chat: bool = True, words: bool = False
) -> None:
    """A byte-level BPE tokenizer (its own ``<unk>``, ``<s>``, ``</s>``) saved in
    ``directory``, with a chat template when ``chat``; with ``words``, a word-level one that
    knows only the corpus's words (anything else is ``<unk>``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    special = ["<unk>", "<s>", "</s>"]
    trainer: Any
    if words:
        tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
        tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
        tokenizer.decoder = decoders.WordPiece()
        trainer = trainers.WordLevelTrainer(vocab_size=vocab_size, special_tokens=special)
    else:
        tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=special,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
    tokenizer.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    if chat:
        fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(directory)


def save_model(directory: Path, kind: str = "llama", seed: int = 0, **config: Any) -> Path:
    """A random-weight ``kind`` (llama, qwen2, gemma2) causal LM of 2 layers saved in
    ``directory`` (no tokenizer files); ``config`` overrides the small defaults."""
    import transformers

    classes = {
        "llama": ("LlamaConfig", "LlamaForCausalLM"),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
        "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    }
    config_class, model_class = (getattr(transformers, name) for name in classes[kind])
    settings = {
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 512,
        **config,
    }
    torch.manual_seed(seed)
    model_class(config_class(**settings)).save_pretrained(directory)
    return directory
