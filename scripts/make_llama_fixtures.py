"""Write the committed llama.cpp state files under fixtures/foreign/llama-state/.

Usage: ``.venv-llama/bin/python scripts/make_llama_fixtures.py [OUT]`` (``.venv-llama`` from
``scripts/setup_llama_venv.sh``). Writes a tiny random Llama as GGUF with the ``gguf`` package,
loads it with llama-cpp-python (llama.cpp built from source), evaluates one 40-token prompt and
saves llama.cpp's own state files: a sequence save with flash attention on (V stored by rows)
and off (V stored transposed), and a whole-context session save. ``weights.npz`` keeps the
weights the tests recompute layer 0's keys and values from.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import gguf
import llama_cpp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
VOCAB, EMBD, FF, HEADS, KV_HEADS, LAYERS = 260, 64, 64, 4, 2, 2
HEAD_DIM = EMBD // HEADS


def write_gguf(path: Path, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """A random-weight Llama with a byte-level SentencePiece-style vocabulary, as GGUF."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(256)
    writer.add_embedding_length(EMBD)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FF)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("llama")
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), "▁"]
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * VOCAB)
    types = [2, 3, 3, *([6] * 256), 1]  # unknown, control, control, bytes, normal
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    weights: dict[str, np.ndarray] = {}

    def tensor(name: str, *shape: int, scale: float = 0.2) -> None:
        weights[name] = (rng.standard_normal(shape) * scale).astype(np.float32)
        writer.add_tensor(name, weights[name])

    tensor("token_embd.weight", VOCAB, EMBD, scale=1.0)
    for layer in range(LAYERS):
        weights[f"blk.{layer}.attn_norm.weight"] = (1 + 0.1 * rng.standard_normal(EMBD)).astype(
            np.float32
        )
        writer.add_tensor(f"blk.{layer}.attn_norm.weight", weights[f"blk.{layer}.attn_norm.weight"])
        tensor(f"blk.{layer}.attn_q.weight", EMBD, EMBD)
        tensor(f"blk.{layer}.attn_k.weight", KV_HEADS * HEAD_DIM, EMBD)
        tensor(f"blk.{layer}.attn_v.weight", KV_HEADS * HEAD_DIM, EMBD)
        tensor(f"blk.{layer}.attn_output.weight", EMBD, EMBD)
        weights[f"blk.{layer}.ffn_norm.weight"] = np.ones(EMBD, dtype=np.float32)
        writer.add_tensor(f"blk.{layer}.ffn_norm.weight", weights[f"blk.{layer}.ffn_norm.weight"])
        tensor(f"blk.{layer}.ffn_gate.weight", FF, EMBD)
        tensor(f"blk.{layer}.ffn_up.weight", FF, EMBD)
        tensor(f"blk.{layer}.ffn_down.weight", EMBD, FF)
    weights["output_norm.weight"] = np.ones(EMBD, dtype=np.float32)
    writer.add_tensor("output_norm.weight", weights["output_norm.weight"])
    tensor("output.weight", VOCAB, EMBD)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return weights


def save_states(model: Path, prompt: list[int], out: Path) -> None:
    """Evaluate ``prompt`` and save llama.cpp's state files, flash attention on and off."""
    array = (llama_cpp.llama_token * len(prompt))(*prompt)
    for flash in (True, False):
        llm = llama_cpp.Llama(
            model_path=str(model), n_ctx=128, n_batch=64, flash_attn=flash, verbose=False, seed=0
        )
        llm.eval(prompt)
        context = llm._ctx.ctx
        name = "seq-flash.bin" if flash else "seq-noflash.bin"
        written = llama_cpp.llama_state_seq_save_file(
            context, str(out / name).encode(), 0, array, len(prompt)
        )
        if not written:
            raise SystemExit(f"llama_state_seq_save_file wrote nothing for {name}")
        if flash:
            ok = llama_cpp.llama_state_save_file(
                context, str(out / "session.bin").encode(), array, len(prompt)
            )
            if not ok:
                raise SystemExit("llama_state_save_file failed")
        llm.close()


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "fixtures" / "foreign" / "llama-state"
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(23)
    model = out / "tiny-llama.gguf"
    weights = write_gguf(model, rng)
    prompt = [1, *rng.integers(3, VOCAB, size=39).tolist()]
    save_states(model, prompt, out)
    keep = [
        "token_embd.weight",
        "blk.0.attn_norm.weight",
        "blk.0.attn_k.weight",
        "blk.0.attn_v.weight",
    ]
    np.savez(out / "weights.npz", **{name: weights[name] for name in keep})
    (out / "prompt.json").write_text(json.dumps(prompt) + "\n")
    (out / "versions.json").write_text(
        json.dumps(
            {
                "llama_cpp_python": llama_cpp.__version__,
                "gguf": gguf.__version__ if hasattr(gguf, "__version__") else "0.19.0",
            }
        )
        + "\n"
    )
    model.unlink()  # the weights the tests need are in weights.npz; the GGUF is regenerated
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
