"""Greedy decoding after restoring an encoded snapshot, against the plain restore's, and fp8's
attention error with the model's own queries (issue 39).

``python -m benchmarks.encoded_agreement --json-out out/encoded_agreement.json``: for the
built-in model (``kvsnap/engines/default_model.py``) and a tiny Qwen2 built from a config
(random weights, seeded; ``benchmarks.encodings.tiny_qwen2``), and with ``--models 8b-shape``
the 8B shape's KV (``benchmarks.engine.kv_shaped_llama``, random weights), each run in
``--dtype`` (bf16 by default: the models and their caches run bf16 on the CPU), and each of
``--prompts`` prompts of ``--tokens`` byte tokens of English text
(``benchmarks.encodings.fixed_text``, 13,834 tokens, the prompts spread over it without
overlapping):

1. prefill the prompt into a ``DynamicCache`` and capture it
   (``kvsnap.engines.transformers.capture_dynamic_cache``) three times: ``none`` (the plain
   snapshot), ``lossless`` and ``fp8`` (``compression=``);
2. restore each file into a new ``DynamicCache`` (``restore_dynamic_cache``: an encoded file
   is decoded on the host when it opens) and greedy-decode ``--new-tokens`` tokens from it
   (``continue_generation``: the prompt's last token runs again);
3. compare each continuation with the plain restore's: tokens equal position by position, the
   first position that differs, and teacher-forced (the plain continuation fed to both
   caches) the next-token choices that agree, each unaffected by the ones before it;
4. for fp8 (``--fp8-scales``: kvsnap's quantizer, or ``amax / 448`` alone to compare), the
   attention error of each layer (relative L2 of ``softmax(q K^T / sqrt(d)) V``
   over the prompt's tokens, fp8 restore against plain restore, fp32): as recorded in the
   file (48 of the keys as queries, ``kvsnap.encoding.measure``), with 48 of the model's own
   prompt queries, and with the model's queries of the continuation (the ones decoding
   attended with; ``benchmarks.model_queries``), and how sharply each kind of query attends
   (the largest attention weight, mean over queries, heads and prompts).

The plain restore's continuation is also checked against the in-memory cache's, and the
lossless restore's KV against the plain one's, bit for bit.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from benchmarks.encodings import fixed_text, tiny_qwen2
from benchmarks.engine import kv_shaped_llama
from benchmarks.model_queries import model_queries, per_kv_head
from kvsnap.encoded.read import read_encoded
from kvsnap.encoding import fp8, measure
from kvsnap.engines import transformers as kt
from kvsnap.engines.default_model import ByteTokenizer, load_model
from kvsnap.engines.transformers.generate import _cache_keyword
from kvsnap.engines.transformers.model import module_of

ENCODINGS = ("none", "lossless", "fp8")
#: Prompt queries per layer of the model-query check (the recorded check's count).
PROMPT_QUERIES = measure.DEFAULT_QUERIES


def cache_kv(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer a copy of the keys and values of a batch-1 cache, ``(tokens, kv_heads,
    head_dim)`` fp32."""
    return [
        (
            keys[0].transpose(0, 1).to(torch.float32, copy=True),
            values[0].transpose(0, 1).to(torch.float32, copy=True),
        )
        for keys, values in kt.dynamic_cache_states(cache)
    ]


@torch.no_grad()
def teacher_forced(model: Any, cache: Any, fed: list[int]) -> torch.Tensor:
    """The fp32 logits after each of ``fed``, run at once after a copy of ``cache`` without
    its last token (which ``fed`` starts with, as ``continue_generation`` runs it again)."""
    cache = copy.deepcopy(cache)
    cache.crop(-1)
    return logits_after(model, cache, fed)


@torch.no_grad()
def logits_after(model: Any, cache: Any, fed: list[int]) -> torch.Tensor:
    """The fp32 logits after each of ``fed``, run at once after ``cache`` (which it extends)."""
    module = module_of(model)
    logits = module(
        input_ids=torch.tensor([fed]), use_cache=True, **{_cache_keyword(module): cache}
    ).logits
    return logits[0].float()


def logit_figures(logits: torch.Tensor, plain: torch.Tensor) -> dict[str, float]:
    """Teacher-forced, how far ``logits`` are from the plain restore's at each position: the
    choices that agree, the mean relative L2 of the logits, and the mean KL divergence of the
    next-token distribution from the plain one (nats)."""
    log_p, log_q = torch.log_softmax(plain, dim=-1), torch.log_softmax(logits, dim=-1)
    return {
        "teacher_forced_agree": int((logits.argmax(-1) == plain.argmax(-1)).sum()),
        "logit_rel_l2": float(((logits - plain).norm(dim=-1) / plain.norm(dim=-1)).mean()),
        "kl": float((log_p.exp() * (log_p - log_q)).sum(-1).mean()),
    }


def capture_and_restore(model: Any, ids: list[int], work: Path) -> dict[str, Any]:
    """A fresh prefill of ``ids`` captured as each encoding and restored: per encoding the
    restored cache and the file's size, and the fp8 file's recorded error report."""
    [(cache, _)] = kt.prefill_token_ids(model, [ids])
    restored: dict[str, Any] = {"in-memory": cache, "bytes": {}}
    for encoding in ENCODINGS:
        path = work / f"{encoding}.safetensors"
        kt.capture_dynamic_cache(cache, [ids], path, model=model, compression=encoding)
        restored[encoding], token_ids = kt.restore_dynamic_cache(path, model=model)
        assert token_ids == ids, f"{encoding}: the restored token ids differ"
        restored["bytes"][encoding] = path.stat().st_size
    restored["report"] = read_encoded(work / "fp8.safetensors").error
    return restored


def agreement(want: list[int], got: list[int]) -> tuple[int, int | None]:
    """Positions where ``got`` equals ``want``, and the first where it does not (``None``)."""
    same = [a == b for a, b in zip(want, got, strict=True)]
    return sum(same), (same.index(False) if False in same else None)


def top_weight(query: torch.Tensor, keys: torch.Tensor) -> float:
    """How sharply ``query`` ``(queries, heads, dim)`` attends over ``keys``: the mean, over
    queries and heads, of the largest attention weight."""
    scores = torch.einsum("qhd,thd->hqt", query, keys) / keys.shape[-1] ** 0.5
    return float(torch.softmax(scores, dim=-1).amax(dim=-1).mean())


def model_attention(
    model: Any,
    ids: list[int],
    continuation: list[int],
    kv: tuple[list[tuple[torch.Tensor, torch.Tensor]], ...],
    seed: int,
) -> dict[str, Any]:
    """Per layer the attention error over the prompt's KV (``kv``: plain, then fp8) with the
    model's own queries: ``prompt`` (48 prompt positions) and ``decode`` (the queries greedy
    decoding attended with: the prompt's last token, run again, and the continuation's); and
    ``top_weight`` of those and of the recorded check's queries (keys drawn as
    ``kvsnap.encoding.measure`` draws them)."""
    original, decoded = kv
    queries = model_queries(model, [*ids, *continuation[:-1]])
    positions = torch.randperm(len(ids), generator=torch.Generator().manual_seed(seed))
    result: dict[str, Any] = {"prompt": [], "decode": [], "top_weight": {}}
    for layer, layer_queries in enumerate(queries):
        keys = original[layer][0]
        chosen = {
            "keys": measure.draw_queries(
                keys, PROMPT_QUERIES, "keys", torch.Generator().manual_seed(layer)
            ),
            "prompt": per_kv_head(layer_queries[positions[:PROMPT_QUERIES]], keys.shape[1]),
            "decode": per_kv_head(layer_queries[len(ids) - 1 :], keys.shape[1]),
        }
        for name, query in chosen.items():
            result["top_weight"].setdefault(name, []).append(top_weight(query, keys))
            if name != "keys":
                error = measure.output_error(layer, query, original[layer], decoded[layer])
                result[name].append(error.rel_l2)
    return result


def one_prompt(model: Any, ids: list[int], new_tokens: int, work: Path, seed: int) -> dict:
    """Every figure of one prompt (see the module)."""
    restored = capture_and_restore(model, ids, work)
    kv = {name: cache_kv(restored[name]) for name in ENCODINGS}
    kept = {name: copy.deepcopy(restored[name]) for name in ENCODINGS}  # decoding extends them
    continuations = {
        name: kt.continue_generation(model, restored[name], ids, new_tokens)
        for name in ("in-memory", *ENCODINGS)
    }
    plain = continuations["none"]
    fed = [ids[-1], *plain[:-1]]
    plain_logits = teacher_forced(model, kept["none"], fed)
    figures: dict[str, Any] = {"plain_equals_in_memory": plain == continuations["in-memory"]}
    for encoding in ENCODINGS[1:]:
        agree, first = agreement(plain, continuations[encoding])
        figures[encoding] = {
            "bytes": restored["bytes"][encoding],
            "ratio": restored["bytes"]["none"] / restored["bytes"][encoding],
            "agree": agree,
            "first_divergence": first,
            **logit_figures(teacher_forced(model, kept[encoding], fed), plain_logits),
        }
    figures["lossless"]["kv_bit_exact"] = all(
        torch.equal(a, b)
        for pair in zip(kv["none"], kv["lossless"], strict=True)
        for a, b in zip(*pair, strict=True)
    )
    figures["fp8"]["attention"] = {
        "recorded_keys": [check.rel_l2 for check in restored["report"].attention],
        **model_attention(model, ids, plain, (kv["none"], kv["fp8"]), seed),
    }
    return figures


def prompts_of(count: int, tokens: int) -> list[list[int]]:
    """``count`` prompts of ``tokens`` byte tokens of :func:`fixed_text`, spread over it
    without overlapping."""
    ids = ByteTokenizer().encode(fixed_text())  # both models read bytes (vocabulary 259)
    if count * tokens > len(ids):
        raise SystemExit(f"the text holds {len(ids)} tokens: fewer than {count} x {tokens}")
    step = (len(ids) - tokens) // max(count - 1, 1)
    return [ids[start : start + tokens] for start in range(0, count * step, step)][:count]


def run_model(name: str, model: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Every prompt of one model, summed: see :func:`summary`."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvsnap-agreement-") as work:
        for index, ids in enumerate(prompts_of(args.prompts, args.tokens)):
            print(f"{name}: prompt {index + 1}/{args.prompts}", file=sys.stderr, flush=True)
            rows.append(one_prompt(model, ids, args.new_tokens, Path(work), seed=index))
    return {"per_prompt": rows, **summary(rows, args.new_tokens)}


def summary(rows: list[dict], new_tokens: int) -> dict[str, Any]:
    """Totals over the prompts: tokens agreeing, first divergences, teacher-forced choices,
    file ratio, lossless exactness, and per layer the worst attention error of each kind."""
    result: dict[str, Any] = {
        "plain_equals_in_memory": all(row["plain_equals_in_memory"] for row in rows)
    }
    for encoding in ENCODINGS[1:]:
        items = [row[encoding] for row in rows]
        result[encoding] = {
            "ratio": sum(item["ratio"] for item in items) / len(items),
            "agree": sum(item["agree"] for item in items),
            "of": new_tokens * len(items),
            "first_divergences": [item["first_divergence"] for item in items],
            "teacher_forced_agree": sum(item["teacher_forced_agree"] for item in items),
            "logit_rel_l2": sum(item["logit_rel_l2"] for item in items) / len(items),
            "kl": sum(item["kl"] for item in items) / len(items),
        }
    result["lossless"]["kv_bit_exact"] = all(row["lossless"]["kv_bit_exact"] for row in rows)
    attention = [row["fp8"]["attention"] for row in rows]
    result["fp8"]["attention_worst"] = {
        kind: [max(values) for values in zip(*(item[kind] for item in attention), strict=True)]
        for kind in ("recorded_keys", "prompt", "decode")
    }
    result["fp8"]["top_weight_mean"] = {
        kind: [
            sum(values) / len(values)
            for values in zip(*(item["top_weight"][kind] for item in attention), strict=True)
        ]
        for kind in ("keys", "prompt", "decode")
    }
    return result


def _divergences(firsts: list[int | None]) -> str:
    """``"k/n at m"``: k of n prompts diverged, m the median of their first positions."""
    diverged = sorted(first for first in firsts if first is not None)
    median = f" at {diverged[len(diverged) // 2]}" if diverged else ""
    return f"{len(diverged)}/{len(firsts)}{median}"


def table(results: dict[str, Any]) -> str:
    """The results as two plain-text tables: continuations, then fp8's attention error."""
    lines = [
        f"{'model':<11} {'encoding':<9} {'ratio':>6}  {'free-running agree':>18}  "
        f"{'diverged (median)':>17}  {'teacher-forced':>15}  {'logit rel L2':>12}  "
        f"{'KL (nats)':>9}  KV"
    ]
    for name, model in results["models"].items():
        for encoding in ENCODINGS[1:]:
            item = model[encoding]
            exact = (
                "bit-exact"
                if item.get("kv_bit_exact")
                else ("decoded" if encoding == "fp8" else "DIFFERS")
            )
            free = f"{item['agree']}/{item['of']} {100 * item['agree'] / item['of']:.1f}%"
            forced = item["teacher_forced_agree"]
            forced_text = f"{forced}/{item['of']} {100 * forced / item['of']:.1f}%"
            lines.append(
                f"{name:<11} {encoding:<9} {item['ratio']:>6.3f}  {free:>18}  "
                f"{_divergences(item['first_divergences']):>17}  {forced_text:>15}  "
                f"{100 * item['logit_rel_l2']:>11.3f}%  {item['kl']:>9.2e}  {exact}"
            )
    lines += [
        "",
        "fp8 attention rel L2 per layer, worst over the prompts (keys as queries: recorded)",
    ]
    for name, model in results["models"].items():
        for kind, values in model["fp8"]["attention_worst"].items():
            shown = " ".join(f"{100 * value:5.2f}%" for value in values)
            lines.append(f"{name:<11} {kind:<14} {shown}")
    lines += ["", "largest attention weight per layer, mean over queries, heads and prompts"]
    for name, model in results["models"].items():
        for kind, values in model["fp8"]["top_weight_mean"].items():
            shown = " ".join(f"{value:6.4f}" for value in values)
            lines.append(f"{name:<11} {kind:<14} {shown}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--tokens", type=int, default=512, help="prompt length")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    parser.add_argument(
        "--models",
        default="built-in,qwen2-tiny",
        help="comma-separated: built-in, qwen2-tiny, 8b-shape (benchmarks.engine.kv_shaped_llama: "
        "the 8B shape's KV, random weights)",
    )
    parser.add_argument(
        "--fp8-scales",
        choices=("nearest", "amax"),
        default="nearest",
        help="fp8 scales per (block, head): the nearest of kvsnap's candidates (its quantizer), "
        "or amax / 448 alone (its first rule), for comparison",
    )
    parser.add_argument("--torch-threads", type=int, default=1)
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.torch_threads)
    if args.fp8_scales == "amax":
        fp8.SCALE_FACTORS = (1.0,)  # what the encoder's quantizer reads when it runs
    dtype = getattr(torch, args.dtype)
    makers = {
        "built-in": lambda: load_model(dtype=dtype),
        "qwen2-tiny": lambda: tiny_qwen2().to(dtype),
        "8b-shape": lambda: kv_shaped_llama().to(dtype),
    }
    results: dict[str, Any] = {
        "dtype": args.dtype,
        "fp8_scales": args.fp8_scales,
        "prompts": args.prompts,
        "tokens": args.tokens,
        "new_tokens": args.new_tokens,
        "models": {},
    }
    with torch.no_grad():
        for name in args.models.split(","):
            results["models"][name] = run_model(name, makers[name](), args)
    print(table(results))
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
