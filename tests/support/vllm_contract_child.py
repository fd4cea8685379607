"""Drive KVSnapConnector the way vLLM's own connector tests do, and report what happened.

Usage: ``python vllm_contract_child.py JOB.json`` with the vLLM virtualenv's Python (kvsnap
importable). A real vLLM v1 ``Scheduler`` or ``AsyncScheduler`` (``"scheduler"``: ``sync`` or
``async``) schedules the job's prompts; its connector is KVSnapConnector's scheduler role,
built by vLLM from the ``KVTransferConfig``. The worker role (a second ``KVSnapConnector``) is
driven as vLLM's model runner drives it, around a fake forward pass over a random
``FLASH_ATTN``-shaped cache: bind the step's metadata, ``start_load_kv``, forward,
``wait_for_save``, ``get_finished``, ``get_block_ids_with_load_errors``,
``build_connector_worker_meta``, clear. Its output goes back through ``update_from_output``.
Under ``AsyncScheduler`` the next step is scheduled before the previous one runs (vLLM's batch
queue of two), the order in which a failed load is learnt a step late.

The fake model makes the KV of each token a function of the prompt's tokens up to it *and of
the cache's bytes of the request's earlier blocks*, as attention does: KV computed on top of
wrong blocks is wrong. The reference KV of a prompt is the same model run on a clean cache.

JOB::

    {"model": DIR, "store": DIR, "event_log": PATH, "output": PATH,
     "engines": [{"scheduler": "sync" | "async", "policy": "recompute" | "fail",
                  "prompts": [[token ids], ...], "max_tokens": 3,
                  "before": [{"flip": "PROMPT_INDEX:CHUNK"} | {"remove": "PROMPT_INDEX:CHUNK"}]}]}

``before`` damages stored chunks before the engine starts (``flip``: one byte of a chunk's KV
data; ``remove``: the chunk's file), naming them by prompt and chunk position. The output
holds per engine: the requests' outcomes, every load compared bit-exact with the reference
(``loads``), the blocks reported as failed loads, and whether the block pool returned to where
it started; and at the end every stored chunk compared with the reference KV of its tokens.
"""

from __future__ import annotations

import json
import struct
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import xxhash

from kvsnap.engines.vllm import KVSnapConnector, registered_cache
from kvsnap.engines.vllm.compat import KVConnectorRole
from kvsnap.snapshot import Snapshot

BLOCK = 16
CHUNK_BLOCKS = 2
NUM_BLOCKS = 96
HEADS, HEAD_DIM, LAYERS = 2, 32, 2
EOS = 0


def _config(job: dict[str, Any], engine: dict[str, Any]) -> Any:
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    model = ModelConfig(model=job["model"], dtype="bfloat16", seed=0, skip_tokenizer_init=True)
    scheduler = SchedulerConfig(
        max_num_seqs=8,
        max_num_batched_tokens=int(engine.get("max_num_batched_tokens", 256)),
        max_model_len=1024,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
        async_scheduling=engine["scheduler"] == "async",
    )
    cache = CacheConfig(block_size=BLOCK, cache_dtype="auto", enable_prefix_caching=True)
    cache.kv_cache_layout = "LBNHC"
    transfer = KVTransferConfig(
        kv_connector="KVSnapConnector",
        kv_connector_module_path="kvsnap.engines.vllm",
        kv_role="kv_both",
        kv_load_failure_policy=engine["policy"],
        kv_connector_extra_config={
            "path": job["store"],
            "chunk_blocks": CHUNK_BLOCKS,
            "event_log": job["event_log"],
            **engine.get("extra", {}),
        },
    )
    return VllmConfig(
        model_config=model,
        scheduler_config=scheduler,
        cache_config=cache,
        kv_transfer_config=transfer,
        device_config=DeviceConfig("cpu"),
    )


def _kv_cache_config() -> Any:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_DIM, dtype=torch.bfloat16
    )
    names = [f"model.layers.{index}.self_attn.attn" for index in range(LAYERS)]
    return KVCacheConfig(
        num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(names, spec)]
    )


class FakeModel:
    """A cache of ``NUM_BLOCKS`` blocks (``FLASH_ATTN``, NHD: ``[B, N, H, 2D]`` per layer) and
    a forward pass whose KV depends on the tokens and on the request's earlier blocks."""

    def __init__(self, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        shape = (NUM_BLOCKS, BLOCK, HEADS, 2 * HEAD_DIM)
        # Random, not zero: a block nobody wrote must never look right.
        self.physical = [
            torch.randn(shape, generator=generator).to(torch.bfloat16) for _ in range(LAYERS)
        ]

    def registered(self) -> Any:
        return registered_cache(
            [tensor.permute(0, 2, 1, 3) for tensor in self.physical],
            backend="FLASH_ATTN",
            kv_cache_layout="LBNHC",
            head_size=HEAD_DIM,
            num_kv_heads=HEADS,
        )

    def blocks_bytes(self, block_ids: list[int]) -> bytes:
        index = torch.as_tensor(block_ids, dtype=torch.long)
        return b"".join(
            layer.index_select(0, index).view(torch.int16).numpy().tobytes()
            for layer in self.physical
        )

    def forward(self, tokens: list[int], block_ids: list[int], start: int, end: int) -> None:
        """Write the KV of positions ``start .. end`` of ``tokens`` into ``block_ids``."""
        position = start
        while position < end:
            block = position // BLOCK
            history = xxhash.xxh3_64_hexdigest(self.blocks_bytes(block_ids[:block]))
            stop = min(end, (block + 1) * BLOCK)
            for here in range(position, stop):
                text = f"{history}:{tokens[block * BLOCK : here + 1]}"
                generator = torch.Generator().manual_seed(
                    xxhash.xxh3_64_intdigest(text.encode()) >> 1
                )
                values = torch.randn((LAYERS, HEADS, 2 * HEAD_DIM), generator=generator)
                for layer in range(LAYERS):
                    self.physical[layer][block_ids[block], here % BLOCK] = values[layer].to(
                        torch.bfloat16
                    )
            position = stop

    def keys_values(self, block_ids: list[int], num_tokens: int) -> list[torch.Tensor]:
        """Per layer ``[tokens, heads, 2D]`` of the first ``num_tokens`` tokens in ``block_ids``."""
        index = torch.as_tensor(block_ids, dtype=torch.long)
        return [
            layer.index_select(0, index).reshape(-1, HEADS, 2 * HEAD_DIM)[:num_tokens]
            for layer in self.physical
        ]


def reference(tokens: list[int]) -> list[torch.Tensor]:
    """The KV the fake model computes for ``tokens`` from a clean start."""
    model = FakeModel(seed=1)
    blocks = list(range(-(-len(tokens) // BLOCK)))
    model.forward(tokens, blocks, 0, len(tokens))
    return model.keys_values(blocks, len(tokens))


@dataclass
class RunnerState:
    tokens: list[int]
    prompt_length: int
    block_ids: list[int] = field(default_factory=list)


class FakeRunner:
    """The model runner's side of one engine: the worker connector around the fake forward."""

    def __init__(self, vllm_config: Any, seed: int) -> None:
        self.model = FakeModel(seed)
        self.connector = KVSnapConnector(vllm_config, KVConnectorRole.WORKER, _kv_cache_config())
        assert self.connector.connector_worker is not None
        self.connector.connector_worker.attach(self.model.registered())
        self.requests: dict[str, RunnerState] = {}
        self.loads: list[dict[str, Any]] = []
        self.failed_blocks: list[int] = []

    def _update_states(self, output: Any) -> dict[str, int]:
        computed: dict[str, int] = {}
        for request_id in output.finished_req_ids:
            self.requests.pop(request_id, None)
        for new in output.scheduled_new_reqs:
            prompt = list(new.prompt_token_ids)
            self.requests[new.req_id] = RunnerState(prompt, len(prompt), list(new.block_ids[0]))
            computed[new.req_id] = new.num_computed_tokens
        cached = output.scheduled_cached_reqs
        for index, request_id in enumerate(cached.req_ids):
            state = self.requests[request_id]
            new_blocks = cached.new_block_ids[index]
            if request_id in cached.resumed_req_ids:
                state.block_ids = list(new_blocks[0]) if new_blocks is not None else []
            elif new_blocks is not None:
                state.block_ids += list(new_blocks[0])
            computed[request_id] = cached.num_computed_tokens[index]
        return computed

    def _check_loads(self, meta: Any, invalid: set[int]) -> None:
        """Compare every loaded block with the reference KV of its request's prompt."""
        for spec in meta.loads:
            state = self.requests[spec.request_id]
            targets = [int(block) for block in spec.target_blocks]
            good = [block for block in targets if block not in invalid]
            positions = [state.block_ids.index(block) for block in good]
            expected = reference(state.tokens[: (max(positions, default=-1) + 1) * BLOCK])
            exact = True
            for block, position in zip(good, positions, strict=True):
                got = self.model.keys_values([block], BLOCK)
                for layer in range(LAYERS):
                    want = expected[layer][position * BLOCK : (position + 1) * BLOCK]
                    exact &= bool(torch.equal(got[layer].view(torch.int16), want.view(torch.int16)))
            self.loads.append(
                {
                    "request": spec.request_id,
                    "blocks": len(targets),
                    "failed": len(targets) - len(good),
                    "exact": exact,
                }
            )

    def execute(self, output: Any) -> Any:
        """One engine step as vLLM's model runner runs it; returns the ``ModelRunnerOutput``."""
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        computed = self._update_states(output)
        connector = self.connector
        worker = connector.connector_worker
        assert worker is not None
        connector.bind_connector_metadata(output.kv_connector_metadata)
        connector.handle_preemptions(output.kv_connector_metadata)
        connector.start_load_kv(None)
        invalid = connector.get_block_ids_with_load_errors()
        self._check_loads(output.kv_connector_metadata, invalid)
        self.failed_blocks += sorted(invalid)
        sampled: list[list[int]] = []
        request_ids = list(output.num_scheduled_tokens)
        for request_id in request_ids:
            state = self.requests[request_id]
            start = computed[request_id]
            end = start + output.num_scheduled_tokens[request_id]
            self.model.forward(state.tokens, state.block_ids, start, end)
            if end >= state.prompt_length:  # a token is sampled once the prompt is computed
                # Tokens past ``end`` were sampled by a step vLLM discarded (a failed load).
                del state.tokens[end:]
                token = 1 + (sum(state.tokens) + len(state.tokens)) % 400
                state.tokens.append(token)
                sampled.append([token])
            else:
                sampled.append([])
        connector.wait_for_save()
        # A copy engine that keeps up: the step's saves read the cache before the next step
        # writes it (the background thread would otherwise race the next fake forward pass).
        worker.wait_for_writes()
        finished, _ = connector.get_finished(set(output.finished_req_ids))
        kv_output = KVConnectorOutput(
            finished_sending=finished,
            invalid_block_ids=invalid,
            kv_connector_worker_meta=connector.build_connector_worker_meta(),
        )
        connector.clear_connector_metadata()
        return ModelRunnerOutput(
            req_ids=request_ids,
            req_id_to_index={request_id: i for i, request_id in enumerate(request_ids)},
            sampled_token_ids=sampled,
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=[],
            kv_connector_output=None if kv_output.is_empty() else kv_output,
        )


def _requests(prompts: list[list[int]], max_tokens: int, engine_index: int) -> list[Any]:
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    requests = []
    for index, prompt in enumerate(prompts):
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        params.update_from_generation_config({}, EOS)
        requests.append(
            Request(
                request_id=f"e{engine_index}-r{index}",
                prompt_token_ids=list(prompt),
                sampling_params=params,
                pooling_params=None,
                block_hasher=get_request_block_hasher(BLOCK, sha256),
            )
        )
    return requests


def _record_hit_sources(connector: Any) -> list[dict[str, int]]:
    """What ``connector.get_external_cache_hit_sources`` answers vLLM, call by call."""
    hit_sources: list[dict[str, int]] = []
    sources_of = connector.get_external_cache_hit_sources

    def record_sources(request: Any, num_external_tokens: int) -> Any:
        sources = sources_of(request, num_external_tokens)
        hit_sources.append({str(getattr(k, "value", k)): v for k, v in sources.items()})
        return sources

    connector.get_external_cache_hit_sources = record_sources
    return hit_sources


def drive(
    scheduler: Any, runner: FakeRunner, depth: int
) -> tuple[dict[str, str], list[tuple[int, bool]]]:
    """Step ``scheduler`` and ``runner`` until every request is done and its blocks freed,
    scheduling up to ``depth`` steps ahead of the one running (vLLM's batch queue: 2 under
    ``AsyncScheduler``). Returns the finish reasons and, after each step, (finished requests
    whose blocks vLLM still holds, what ``has_pending_block_frees()`` says)."""
    in_flight: deque[Any] = deque()
    finished: dict[str, str] = {}
    held_vs_pending: list[tuple[int, bool]] = []
    deadline = time.monotonic() + 60
    while scheduler.has_requests() or in_flight:
        if time.monotonic() > deadline:
            raise RuntimeError("the engine did not finish its requests in 60 s")
        if scheduler.has_requests() and len(in_flight) < depth:
            in_flight.append(scheduler.schedule())
            if len(in_flight) < depth:
                continue
        output = in_flight.popleft()
        if not output.num_scheduled_tokens:
            time.sleep(0.005)  # only held blocks are left: their saves run on another thread
        engine_outputs = scheduler.update_from_output(output, runner.execute(output))
        for outputs in engine_outputs.values():
            for item in outputs.outputs:
                if item.finish_reason is not None:
                    finished[item.request_id] = str(item.finish_reason)
        held = sum(1 for request in scheduler.requests.values() if request.is_finished())
        held_vs_pending.append((held, bool(scheduler.connector.has_pending_block_frees())))
    return finished, held_vs_pending


def run_engine(job: dict[str, Any], engine: dict[str, Any], index: int) -> dict[str, Any]:
    """Run one engine's prompts to the end; what it did, for the parent's assertions."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    vllm_config = _config(job, engine)
    vllm_config.cache_config.num_gpu_blocks = NUM_BLOCKS
    kind = AsyncScheduler if engine["scheduler"] == "async" else Scheduler
    scheduler = kind(
        vllm_config=vllm_config,
        kv_cache_config=_kv_cache_config(),
        log_stats=True,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BLOCK,
    )
    runner = FakeRunner(vllm_config, seed=100 + index)
    pool = scheduler.kv_cache_manager.block_pool
    free_at_start = pool.get_num_free_blocks()
    for request in _requests(engine["prompts"], int(engine.get("max_tokens", 3)), index):
        scheduler.add_request(request)
    hit_sources = _record_hit_sources(scheduler.connector)
    finished, held_vs_pending = drive(scheduler, runner, 2 if engine["scheduler"] == "async" else 1)
    runner.connector.connector_worker.wait_for_writes()
    runner.connector.shutdown()
    return {
        "finished": finished,
        "loads": runner.loads,
        "failed_blocks": runner.failed_blocks,
        "free_blocks_restored": pool.get_num_free_blocks() == free_at_start,
        "held_vs_pending": held_vs_pending,
        "requires_kv_delivery": bool(scheduler.requires_kv_delivery),
        "hit_sources": hit_sources,
    }


def _chunk_of(store: Path, prompt: list[int], chunk: int) -> Path:
    """The stored chunk holding chunk ``chunk`` of ``prompt`` (found by its token ids)."""
    start, end = chunk * CHUNK_BLOCKS * BLOCK, (chunk + 1) * CHUNK_BLOCKS * BLOCK
    for path in sorted((store).glob("*/chunks/*/*.safetensors")):
        with Snapshot.open(path, verify=False) as snapshot:
            record = snapshot.sequences[0]
            first = int(record.id.split("@")[1].split(":")[0])
            if first * BLOCK == start and list(record.token_ids) == prompt[start:end]:
                return path
    raise FileNotFoundError(f"no stored chunk {chunk} of the prompt")


def damage(store: Path, prompts: list[list[int]], actions: list[dict[str, str]]) -> None:
    for action in actions:
        ((kind, target),) = action.items()
        prompt_index, chunk = (int(part) for part in target.split(":"))
        path = _chunk_of(store, prompts[prompt_index], chunk)
        if kind == "remove":
            path.unlink()
            continue
        data = bytearray(path.read_bytes())
        (header_size,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + header_size])
        begin, end = header["layers.0.key"]["data_offsets"]
        data[8 + header_size + (begin + end) // 2] ^= 0x5A
        path.write_bytes(bytes(data))


def stored_chunks(store: Path, prompts: list[list[int]]) -> list[dict[str, Any]]:
    """Every chunk in the store, compared bit-exact with the reference KV of its tokens."""
    references = [reference(prompt) for prompt in prompts]
    report = []
    for path in sorted(store.glob("*/chunks/*/*.safetensors")):
        with Snapshot.open(path) as snapshot:
            record = snapshot.sequences[0]
            first = int(record.id.split("@")[1].split(":")[0]) * BLOCK
            tokens = [int(token) for token in record.token_ids]
            kv = [
                torch.cat(
                    [
                        snapshot.sequence_kv(record.id, f"layers.{layer}.key"),
                        snapshot.sequence_kv(record.id, f"layers.{layer}.value"),
                    ],
                    dim=-1,
                )
                for layer in range(LAYERS)
            ]
        owner = next(
            (
                i
                for i, prompt in enumerate(prompts)
                if prompt[first : first + len(tokens)] == tokens
            ),
            None,
        )
        exact = owner is not None and all(
            torch.equal(
                kv[layer].view(torch.int16),
                references[owner][layer][first : first + len(tokens)].view(torch.int16),
            )
            for layer in range(LAYERS)
        )
        report.append({"path": str(path), "first_token": first, "exact": exact})
    return report


def main() -> None:
    job = json.loads(Path(sys.argv[1]).read_text())
    store = Path(job["store"])
    prompts_seen: list[list[int]] = []
    engines = []
    for index, engine in enumerate(job["engines"]):
        damage(store, engine["prompts"], engine.get("before", []))
        engines.append(run_engine(job, engine, index))
        prompts_seen += [p for p in engine["prompts"] if p not in prompts_seen]
    result = {"engines": engines, "chunks": stored_chunks(store, prompts_seen)}
    Path(job["output"]).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
