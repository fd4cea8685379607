"""Write the committed samples of SGLang HiCache's file storage under fixtures/foreign/.

Usage, with SGLang 0.5.23 installed without its dependencies into a folder of its own (it is a
CUDA serving stack; only its storage and host-pool modules run here)::

    pip install --no-deps --target SITE sglang==0.5.23 orjson psutil pybase64 starlette \\
        msgspec pyzmq IPython traitlets dill apache-tvm-ffi sentencepiece \\
        compressed_tensors loguru gguf
    PYTHONPATH=.:SITE .venv/bin/python scripts/make_sglang_fixtures.py [OUT]

(default ``OUT``: ``fixtures/foreign/sglang-hicache``). The KV is the built-in tiny Llama's
(``kvsnap.engines.default_model``, bfloat16) prefill of a 48-token prompt, which kvsnap also
captures (``OUT/reference.safetensors``). For each host layout (``layer_first``,
``page_first``, ``page_first_direct``) and TP size (1, 2) it builds SGLang's own
``MHATokenToKVPoolHost`` on the CPU per rank, over device buffers holding that rank's heads at
shuffled token slots, and stores the prompt's pages through SGLang's own ``HiCacheFile``
(``batch_set`` of ``get_data_page``, as ``HiCacheController._generic_page_set`` does), keyed
by SGLang's own page hashes (``get_hash_str``, its C++ extension, compiled on first use). The
only thing replaced is the device-to-host copy (``backup_from_device_all_layer``, CUDA kernels
in SGLang): a torch copy into the very host views SGLang's kernels write for that layout.
``OUT/mla`` does the same with SGLang's ``MLATokenToKVPoolHost`` (2 layers, latent 32 + 16,
random bfloat16 latents, which kvsnap captures as ``OUT/mla/reference.safetensors``): an MLA
deployment at TP 2, whose rank 0 stores one file per page for every rank.

Two environment shims, neither on the storage path: SGLang's model-config package imports
``torchvision`` (a CUDA build on PyPI, unloadable beside CPU torch), which an empty stand-in
module answers; transformers is told it is absent.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import shutil
import sys
import types
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PAGE_SIZE = 16
PROMPT_TOKENS = 48
MODEL_NAME = "kvsnap/tiny-llama"
LAYOUTS = ("layer_first", "page_first", "page_first_direct")
MLA_MODEL_NAME = "kvsnap/tiny-mla"
MLA_LAYERS = 2
MLA_LORA_RANK = 32
MLA_ROPE_DIM = 16


class _AbsentModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _AbsentModule(f"{self.__name__}.{name}")


class _TorchvisionStandIn(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``import torchvision`` gets an empty module; transformers' availability probe, none."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != "torchvision" and not name.startswith("torchvision."):
            return None
        frame = sys._getframe(1)
        while frame is not None:
            if frame.f_code.co_filename.endswith("transformers/utils/import_utils.py"):
                return None
            frame = frame.f_back  # type: ignore[assignment]
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec: Any) -> types.ModuleType:
        module = _AbsentModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def host_pool(info: Any, layout: str) -> Any:
    """SGLang's MHA host pool over ``info``'s device buffers, its device copy done in torch."""
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    class CPUCopyHostPool(MHATokenToKVPoolHost):  # type: ignore[misc]
        def backup_from_device_all_layer(
            self, device_pool: Any, host_indices: Any, device_indices: Any, io_backend: Any
        ) -> None:
            # What transfer_kv_all_layer{,_lf_pf,_direct_lf_pf} do on the GPU: each token's
            # row of every layer's device K and V into its host slot, in this layout.
            for layer in range(self.layer_num):
                for part, device in enumerate((self.device_k_buffers, self.device_v_buffers)):
                    rows = device[layer][device_indices]
                    if self.layout == "layer_first":
                        self.kv_buffer[part, layer, host_indices] = rows
                    elif self.layout == "page_first":
                        self.kv_buffer[part, host_indices, layer] = rows
                    else:
                        pages, slots = host_indices // self.page_size, host_indices % self.page_size
                        self.kv_buffer[part, pages, layer, slots] = rows

    return CPUCopyHostPool(
        info,
        2.0,
        0,
        PAGE_SIZE,
        layout,
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=int(info.buffers.k[0].shape[0]),
        start_layer=0,
        end_layer=len(info.buffers.k),
    )


def mla_host_pool(latents: list[Any], layout: str) -> Any:
    """SGLang's MLA host pool over device latents ``(tokens, 1, latent)`` per layer, its device
    copy (``transfer_kv_all_layer_mla*`` on the GPU) done in torch."""
    import torch
    from sglang.srt.mem_cache.device_pool_info import MLABufferInfo
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    class CPUCopyMLAHostPool(MLATokenToKVPoolHost):  # type: ignore[misc]
        def backup_from_device_all_layer(
            self, device_pool: Any, host_indices: Any, device_indices: Any, io_backend: Any
        ) -> None:
            for layer, device in enumerate(latents):
                rows = device[device_indices]
                if self.layout == "layer_first":
                    self.kv_buffer[layer, host_indices] = rows
                elif self.layout == "page_first":
                    self.kv_buffer[host_indices, layer] = rows
                else:
                    pages, slots = host_indices // self.page_size, host_indices % self.page_size
                    self.kv_buffer[pages, layer, slots] = rows

    layers = len(latents)
    info = MLABufferInfo(
        buffers=tuple(latents),
        data_ptrs=torch.tensor([t.data_ptr() for t in latents]),
        layer_indices=tuple(range(layers)),
        device_layer_num=layers,
        page_size=PAGE_SIZE,
        kv_lora_rank=MLA_LORA_RANK,
        qk_rope_head_dim=MLA_ROPE_DIM,
        kv_cache_dim=MLA_LORA_RANK + MLA_ROPE_DIM,
        dtype=latents[0].dtype,
        device=torch.device("cpu"),
    )
    return CPUCopyMLAHostPool(
        info,
        2.0,
        0,
        PAGE_SIZE,
        layout,
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=int(latents[0].shape[0]),
        start_layer=0,
        end_layer=layers,
        target_layer_num=layers,
    )


def _storage(out: Path, rank: int, tp: int, layout: str, *, mla: bool, model: str) -> Any:
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig

    config = HiCacheStorageConfig(
        tp_rank=rank,
        tp_size=tp,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=mla,
        enable_storage_metrics=False,
        is_page_first_layout=layout != "layer_first",
        model_name=model,
    )
    return HiCacheFile(config, file_path=str(out))


def _set_pages(pool: Any, backend: Any, hashes: list[str], host_indices: Any) -> None:
    from sglang.srt.managers.cache_controller import HiCacheController

    controller = types.SimpleNamespace(
        storage_host_pool=pool, page_size=PAGE_SIZE, storage_backend=backend
    )
    assert HiCacheController._generic_page_set(controller, hashes, host_indices)


def store_mla(out: Path, latents: list[Any], tokens: list[int], layout: str, tp: int) -> None:
    """An MLA deployment at TP ``tp`` storing the prompt's pages: rank 0 writes, for all."""
    import torch
    from sglang.srt.mem_cache.utils import get_hash_str

    capacity = 4 * len(tokens)
    slots = torch.randperm(capacity, generator=torch.Generator().manual_seed(7))[: len(tokens)]
    device = []
    for latent in latents:
        buffer = torch.zeros(capacity, 1, latent.shape[1], dtype=latent.dtype)
        buffer[slots, 0] = latent
        device.append(buffer)
    pool = mla_host_pool(device, layout)
    host_indices = pool.alloc(len(tokens))
    pool.backup_from_device_all_layer(None, host_indices, slots, "kernel")
    backend = _storage(out, 0, tp, layout, mla=True, model=MLA_MODEL_NAME)
    _set_pages(pool, backend, get_hash_str(tokens, None, page_size=PAGE_SIZE), host_indices)


def store(out: Path, keys: list[Any], values: list[Any], tokens: list[int], layout: str, tp: int):
    """One TP-``tp`` deployment's ranks storing the prompt's pages into ``out``."""
    import torch
    from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo
    from sglang.srt.mem_cache.utils import get_hash_str

    heads = keys[0].shape[1] // tp
    capacity = 4 * len(tokens)
    slots = torch.randperm(capacity, generator=torch.Generator().manual_seed(tp))[: len(tokens)]
    hashes = get_hash_str(tokens, None, page_size=PAGE_SIZE)
    for rank in range(tp):
        part = slice(rank * heads, (rank + 1) * heads)
        device_k, device_v = [], []
        for key, value in zip(keys, values, strict=True):
            k = torch.zeros(capacity, heads, key.shape[2], dtype=key.dtype)
            v = torch.zeros_like(k)
            k[slots], v[slots] = key[:, part], value[:, part]
            device_k.append(k)
            device_v.append(v)
        pointers = [torch.tensor([t.data_ptr() for t in ts]) for ts in (device_k, device_v)]
        buffers = KVBuffers(
            k=tuple(device_k),
            v=tuple(device_v),
            k_data_ptrs=pointers[0],
            v_data_ptrs=pointers[1],
            layout=KVBufferLayout.NHD,
        )
        info = MHABufferInfo(
            buffers=buffers,
            page_size=PAGE_SIZE,
            head_num=heads,
            head_dim=keys[0].shape[2],
            v_head_dim=keys[0].shape[2],
            dtype=keys[0].dtype,
            device=torch.device("cpu"),
        )
        pool = host_pool(info, layout)
        host_indices = pool.alloc(len(tokens))
        pool.backup_from_device_all_layer(None, host_indices, slots, "kernel")
        backend = _storage(out, rank, tp, layout, mla=False, model=MODEL_NAME)
        _set_pages(pool, backend, hashes, host_indices)


def write_mla(out: Path, tokens: list[int]) -> None:
    """Random latents (no CPU model keeps MLA latents), kvsnap's capture of them as the
    reference, and the three layouts' files."""
    import torch

    import kvsnap

    generator = torch.Generator().manual_seed(41)
    width = MLA_LORA_RANK + MLA_ROPE_DIM
    latents = [
        torch.randn(len(tokens), width, generator=generator).to(torch.bfloat16)
        for _ in range(MLA_LAYERS)
    ]
    out.mkdir(parents=True)
    pages = len(tokens) // PAGE_SIZE
    paged = [latent.reshape(pages, PAGE_SIZE, width).clone() for latent in latents]
    sequence = kvsnap.SequenceBlocks("prompt", torch.tensor(tokens).numpy(), range(pages))
    kvsnap.capture(
        kvsnap.mla_layout(paged), [sequence], out / "reference.safetensors", reproducible=True
    )
    config = {
        "model_type": "deepseek_v3",
        "num_hidden_layers": MLA_LAYERS,
        "kv_lora_rank": MLA_LORA_RANK,
        "qk_rope_head_dim": MLA_ROPE_DIM,
        "torch_dtype": "bfloat16",
    }
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for layout in LAYOUTS:
        store_mla(out / layout, latents, tokens, layout, tp=2)


def main(out: Path) -> None:
    sys.meta_path.insert(0, _TorchvisionStandIn())
    import numpy as np
    import sglang
    import torch

    from kvsnap.engines import transformers as kt
    from kvsnap.engines.default_model import load_model

    model = load_model(dtype=torch.bfloat16)
    tokens = [256, *np.random.default_rng(40).integers(0, 256, PROMPT_TOKENS - 1).tolist()]
    [(cache, ids)] = kt.prefill_token_ids(model, [tokens])
    # (1, heads, tokens, dim) per layer -> (tokens, heads, dim), what a token-major pool holds.
    keys = [layer.keys[0].transpose(0, 1).contiguous() for layer in cache.layers]
    values = [layer.values[0].transpose(0, 1).contiguous() for layer in cache.layers]
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    kt.capture_dynamic_cache(
        cache, [ids], out / "reference.safetensors", model=model, reproducible=True
    )
    config = model.model.config.to_dict()
    config["torch_dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (out / "prompt.json").write_text(json.dumps(ids) + "\n")
    for layout in LAYOUTS:
        for tp in (1, 2):
            store(out / layout / f"tp{tp}", keys, values, ids, layout, tp)
    write_mla(out / "mla", ids)
    versions = {"sglang": sglang.__version__, "torch": torch.__version__}
    (out / "versions.json").write_text(json.dumps(versions) + "\n")


if __name__ == "__main__":
    main(
        Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "fixtures" / "foreign" / "sglang-hicache"
    )
