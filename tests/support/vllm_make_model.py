"""Save a small random-weight Llama (bf16) that vLLM's CPU backend can serve.

Usage: ``python vllm_make_model.py DIR [SEED [WINDOW]]`` (``WINDOW``: a Mistral of the same size
whose every layer uses a sliding window of that many tokens). Two KV heads of head size 32 (a
size the CPU attention backend supports) so that tensor parallelism over 2 ranks splits the
heads; a large init range so greedy decoding of random weights does not collapse onto one token.
"""

from __future__ import annotations

import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM


def main() -> None:
    directory = sys.argv[1]
    seed = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    torch.manual_seed(seed)
    if len(sys.argv) > 3:  # a sliding window: every layer attends to that many tokens only
        sliding_mistral(directory, int(sys.argv[3]))
        return
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=1024,
        initializer_range=0.2,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(directory)


def sliding_mistral(directory: str, window: int) -> None:
    """The same small model as a Mistral whose every layer uses a sliding window."""
    config = MistralConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=1024,
        initializer_range=0.2,
        tie_word_embeddings=False,
        sliding_window=window,
    )
    MistralForCausalLM(config).to(torch.bfloat16).save_pretrained(directory)


if __name__ == "__main__":
    main()
