"""Run one real vLLM engine (CPU) on prompt token ids and write what it generated as JSON.

Usage: ``python vllm_run_engine.py JOB.json`` with the vLLM virtualenv's Python. ``JOB.json``::

    {"model": DIR, "tensor_parallel_size": 1, "connector": {...} | null,
     "load_failure_policy": "recompute" | null, "enable_lora": false,
     "prompts": [{"token_ids": [...], "persist": true, "dump": false,
                  "lora": {"name": ..., "id": 1, "path": DIR} (optional),
                  "cache_salt": "..." (optional)}, ...],
     "max_tokens": 8, "output": PATH, "fsync_delay_s": 0.0,
     "executor": null | "mp", "sequential": false, "connector_class": null | "tampering",
     "tamper": {...} (optional)}

``connector`` is KVSnapConnector's ``kv_connector_extra_config`` (null: no KV connector at
all); ``load_failure_policy`` vLLM's ``kv_load_failure_policy`` (default ``recompute``; null
leaves vLLM's own default). Request ``i`` gets the id ``str(i)`` (vLLM numbers the prompts of
a fresh ``LLM``).
``fsync_delay_s`` (optional) makes every ``fsync`` under the connector's ``path`` in the
engine's processes wait that long (``tests/support/slow_fsync.py``): a slow disk under the
store, so that saves are still being written when the engine shuts down.
``executor`` (optional) is vLLM's ``distributed_executor_backend`` (``mp``: the worker in a
process of its own even at TP 1, vLLM's default on CPU; ``uni``: in the scheduler's process,
with the engine core in this one, which vLLM's CPU platform needs for it); ``sequential``
(optional) sends the prompts one at a time, each request finished before the next is sent;
``connector_class`` ``"tampering"`` runs ``vllm_tampering_connector.TamperingConnector`` with
``tamper`` as what it does. ``pause`` (optional, with ``sequential``): ``{"before": i, "file":
PATH}`` stops before prompt ``i`` until ``PATH`` exists, having written ``PATH.waiting`` (the
test does something to the world meanwhile: stops a server).
The output holds, per prompt, the generated token ids, vLLM's ``num_cached_tokens`` and the
finish reason.
"""

from __future__ import annotations

import json
import os
import sys
import time

#: Seconds vLLM waits for its workers to exit once told to (the connector drains its saves
#: within them), and for the engine core process as a whole (its own teardown on top).
WORKER_WINDOW_S = 120
ENGINE_WINDOW_S = WORKER_WINDOW_S + 60


def main() -> None:
    with open(sys.argv[1]) as handle:
        job = json.load(handle)
    tensor_parallel = int(job.get("tensor_parallel_size", 1))
    # vLLM's CPU backend sizes its KV cache from this (GiB); keep it small on a 2-core box.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # vLLM gives workers 5 s to exit by default; on a loaded 2-core machine draining the saves
    # still queued (TP = 2: collective ones) can take longer, and the tests read them all.
    os.environ.setdefault("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", str(WORKER_WINDOW_S))
    if job.get("fsync_delay_s"):
        from tests.support.slow_fsync import slow_down_fsync_everywhere

        slow_down_fsync_everywhere(float(job["fsync_delay_s"]), job["connector"]["path"])
    if job.get("executor") == "uni":
        # vLLM's CPU platform runs its workers through the mp executor unless the engine core
        # runs in this process: then "uni" keeps the worker in the scheduler's process.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if tensor_parallel > 1:
        os.environ.setdefault(
            "VLLM_CPU_OMP_THREADS_BIND", "|".join(map(str, range(tensor_parallel)))
        )
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    transfer = None
    if job.get("tamper") is not None:
        os.environ["KVSNAP_TEST_TAMPER"] = json.dumps(job["tamper"])  # the workers' too
    tampering = job.get("connector_class") == "tampering"
    if job.get("connector") is not None:
        policy = job.get("load_failure_policy", "recompute")
        transfer = KVTransferConfig(
            kv_connector="TamperingConnector" if tampering else "KVSnapConnector",
            kv_connector_module_path=(
                "tests.support.vllm_tampering_connector" if tampering else "kvsnap.engines.vllm"
            ),
            kv_role="kv_both",
            kv_connector_extra_config=job["connector"],
            **({} if policy is None else {"kv_load_failure_policy": policy}),
        )
    started = time.perf_counter()
    llm = LLM(
        model=job["model"],
        skip_tokenizer_init=True,
        dtype="bfloat16",
        block_size=32,
        enforce_eager=True,
        gpu_memory_utilization=0.3,
        tensor_parallel_size=tensor_parallel,
        # Every reuse in these runs must come from kvsnap, so vLLM's own prefix cache is off.
        enable_prefix_caching=False,
        kv_transfer_config=transfer,
        **({"distributed_executor_backend": job["executor"]} if job.get("executor") else {}),
        **(
            {"enable_lora": True, "max_lora_rank": 8, "max_loras": 2}
            if job.get("enable_lora")
            else {}
        ),
    )
    ready = time.perf_counter()
    from vllm.lora.request import LoRARequest

    prompts, params, adapters = [], [], []
    for prompt in job["prompts"]:
        request = {"prompt_token_ids": prompt["token_ids"]}
        if prompt.get("cache_salt") is not None:
            request["cache_salt"] = prompt["cache_salt"]
        prompts.append(request)
        lora = prompt.get("lora")
        adapters.append(
            None if lora is None else LoRARequest(lora["name"], int(lora["id"]), lora["path"])
        )
        extra = {}
        if not prompt.get("persist", True):
            extra["kvsnap_persist"] = False
        if prompt.get("dump"):
            extra["kvsnap_dump"] = True
        params.append(
            SamplingParams(
                max_tokens=int(job.get("max_tokens", 8)),
                temperature=0.0,
                ignore_eos=True,
                extra_args=extra or None,
            )
        )
    outputs = []
    runs = (
        [(index, index + 1) for index in range(len(prompts))]
        if job.get("sequential")
        else _adapter_runs(adapters)
    )
    pause = job.get("pause") or {}
    for start, end in runs:
        if pause and start == pause["before"]:
            _wait_for(pause["file"])
        # vLLM 0.32's CPU LoRA path computes other tokens for a request without an adapter
        # batched with adapter requests (seen here: the same prompt alone and in such a batch
        # differ): each run of prompts with adapters, or without, is its own batch.
        outputs += llm.generate(
            prompts[start:end],
            params[start:end],
            use_tqdm=False,
            lora_request=adapters[start:end] if adapters[start] is not None else None,
        )
    finished = time.perf_counter()
    result = {
        "outputs": [
            {
                "request_id": output.request_id,
                "token_ids": list(output.outputs[0].token_ids),
                "num_cached_tokens": output.num_cached_tokens,
                "finish_reason": output.outputs[0].finish_reason,
            }
            for output in outputs
        ],
        "startup_seconds": ready - started,
        "generate_seconds": finished - ready,
    }
    # Shutting the engine down drains the connector's queued snapshot writes. Without a
    # timeout vLLM kills the engine core and its workers 5 s after asking them to stop,
    # whatever VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS says, and saves still running are lost.
    llm.llm_engine.engine_core.shutdown(timeout=ENGINE_WINDOW_S)
    result["shutdown_seconds"] = time.perf_counter() - finished
    with open(job["output"], "w") as handle:
        json.dump(result, handle)


def _wait_for(path: str) -> None:
    """Say ``PATH.waiting``, then wait until ``PATH`` exists (at most 300 s)."""
    with open(f"{path}.waiting", "w") as handle:
        handle.write("waiting")
    deadline = time.monotonic() + 300
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"nobody created {path}")
        time.sleep(0.05)


def _adapter_runs(adapters: list) -> list[tuple[int, int]]:
    """``[start, end)`` of each run of consecutive prompts that all have an adapter, or all
    have none (request ids stay the prompts' positions: vLLM numbers requests in order)."""
    runs: list[tuple[int, int]] = []
    for index, adapter in enumerate(adapters):
        if runs and (adapters[runs[-1][0]] is None) == (adapter is None):
            runs[-1] = (runs[-1][0], index + 1)
        else:
            runs.append((index, index + 1))
    return runs


if __name__ == "__main__":
    main()
