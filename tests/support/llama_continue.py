"""llama.cpp continuing from an exported sequence state, against its own fresh prefill.

Usage (``.venv-llama``): ``python llama_continue.py JOB.json``. The job names ``weights`` (an
``.npz`` of a transformers Llama's state dict, float32), its ``config`` (hidden size, layers,
heads, KV heads, intermediate size, vocabulary, RMS epsilon, rope theta), the ``prompt`` token
ids, the ``state`` file kvsnap exported, ``new_tokens`` and ``out``. The weights are written as
GGUF the way llama.cpp's converter writes a Llama (the query and key rows of each head
reordered for its interleaved rotary pairs), with a byte-level vocabulary, and loaded with
f32 K and V caches. Then, greedily, ``new_tokens`` tokens:

- fresh: llama.cpp evaluates the whole prompt itself;
- loaded: a new context loads the state with ``llama_state_seq_load_file``, drops the last
  cell and evaluates the last prompt token on top of the loaded KV (a state file keeps no
  logits).

``out`` gets both continuations and the largest difference of their logits at each step.
"""

from __future__ import annotations

import ctypes
import json
import sys
from pathlib import Path
from typing import Any

import gguf
import llama_cpp
import numpy as np


def _interleave_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's reordering of a head's query or key rows."""
    rows, columns = weight.shape
    head_dim = rows // heads
    return weight.reshape(heads, 2, head_dim // 2, columns).swapaxes(1, 2).reshape(rows, columns)


def write_gguf(path: Path, weights: Any, config: dict[str, Any]) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_rope_freq_base(float(config["rope_theta"]))
    writer.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    writer.add_tokenizer_model("llama")
    vocab = config["vocab_size"]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), "▁"][:vocab]
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * vocab)
    writer.add_token_types([2, 3, 3, *([6] * 256), 1][:vocab])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)

    def add(name: str, source: str) -> None:
        writer.add_tensor(name, np.ascontiguousarray(weights[source], dtype=np.float32))

    add("token_embd.weight", "model.embed_tokens.weight")
    for layer in range(config["num_hidden_layers"]):
        hf, blk = f"model.layers.{layer}.", f"blk.{layer}."
        add(blk + "attn_norm.weight", hf + "input_layernorm.weight")
        q = _interleave_rows(weights[hf + "self_attn.q_proj.weight"], heads)
        k = _interleave_rows(weights[hf + "self_attn.k_proj.weight"], config["num_key_value_heads"])
        writer.add_tensor(blk + "attn_q.weight", np.ascontiguousarray(q, dtype=np.float32))
        writer.add_tensor(blk + "attn_k.weight", np.ascontiguousarray(k, dtype=np.float32))
        add(blk + "attn_v.weight", hf + "self_attn.v_proj.weight")
        add(blk + "attn_output.weight", hf + "self_attn.o_proj.weight")
        add(blk + "ffn_norm.weight", hf + "post_attention_layernorm.weight")
        add(blk + "ffn_gate.weight", hf + "mlp.gate_proj.weight")
        add(blk + "ffn_up.weight", hf + "mlp.up_proj.weight")
        add(blk + "ffn_down.weight", hf + "mlp.down_proj.weight")
    add("output_norm.weight", "model.norm.weight")
    add("output.weight", "lm_head.weight")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _model(path: Path, flash: bool) -> Any:
    return llama_cpp.Llama(
        model_path=str(path),
        n_ctx=128,
        n_batch=64,
        flash_attn=flash,
        type_k=llama_cpp.GGML_TYPE_F32,
        type_v=llama_cpp.GGML_TYPE_F32,
        logits_all=True,
        verbose=False,
        seed=0,
    )


def _greedy(llm: Any, steps: int) -> tuple[list[int], list[np.ndarray]]:
    """``steps`` greedy tokens from the logits the last evaluation left."""
    tokens, logits = [], []
    for _ in range(steps):
        scores = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float64)
        logits.append(scores)
        token = int(np.argmax(scores))
        tokens.append(token)
        llm.eval([token])
    return tokens, logits


def main(job_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    weights = np.load(job["weights"])
    model = Path(job["out"]).with_suffix(".gguf")
    write_gguf(model, weights, job["config"])
    prompt, steps, flash = job["prompt"], job["new_tokens"], job.get("flash", True)
    fresh = _model(model, flash)
    fresh.eval(prompt)
    fresh_tokens, fresh_logits = _greedy(fresh, steps)
    loaded = _model(model, flash)
    capacity = len(prompt) + 8
    out_tokens = (llama_cpp.llama_token * capacity)()
    count = ctypes.c_size_t(0)
    read = llama_cpp.llama_state_seq_load_file(
        loaded._ctx.ctx, job["state"].encode(), 0, out_tokens, capacity, ctypes.byref(count)
    )
    if read == 0:
        raise SystemExit("llama_state_seq_load_file loaded nothing")
    assert list(out_tokens[: count.value]) == prompt
    memory = llama_cpp.llama_get_memory(loaded._ctx.ctx)
    llama_cpp.llama_memory_seq_rm(memory, 0, len(prompt) - 1, -1)
    loaded.n_tokens = len(prompt) - 1
    loaded.input_ids[: len(prompt) - 1] = prompt[:-1]
    loaded.eval(prompt[-1:])
    loaded_tokens, loaded_logits = _greedy(loaded, steps)
    differences = [
        float(np.abs(a - b).max()) for a, b in zip(fresh_logits, loaded_logits, strict=True)
    ]
    Path(job["out"]).write_text(
        json.dumps(
            {
                "fresh": fresh_tokens,
                "loaded": loaded_tokens,
                "max_logit_difference": differences,
                "logit_scale": float(np.abs(fresh_logits[0]).max()),
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1])
