"""A pinned host array pulled onto the device by a kernel: every byte, every dtype and size the
restore's tables take (under Triton's interpreter on host memory here; on CUDA, marked ``gpu``,
out of pinned memory while the copy engine is busy with a large copy on another stream)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvsnap.transfer import host_pull

# Word counts around the program size: none, one, a partial program, several programs.
WORDS = [0, 1, host_pull.BLOCK_WORDS - 1, host_pull.BLOCK_WORDS, 3 * host_pull.BLOCK_WORDS + 5]


def _random_bytes(num_words: int, seed: int) -> torch.Tensor:
    data = np.random.default_rng(seed).integers(0, 256, size=8 * num_words, dtype=np.uint8)
    return torch.from_numpy(data).clone()


@pytest.mark.parametrize("num_words", WORDS)
def test_every_byte_arrives_in_the_host_arrays_dtype_and_shape(monkeypatch, num_words):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    raw = _random_bytes(num_words, num_words)
    sources = [raw]
    if num_words:  # torch cannot view an empty byte tensor as wider words
        sources += [raw.view(torch.int64), raw.view(torch.float32).reshape(-1, 2)]
    for source in sources:
        pulled = host_pull.pull_to_device(source, torch.device("cpu"))
        assert pulled.dtype == source.dtype and pulled.shape == source.shape
        assert pulled.data_ptr() != source.data_ptr() or source.numel() == 0
        assert torch.equal(pulled.view(torch.uint8).reshape(-1), raw)


def test_a_tensor_that_is_not_whole_words_or_not_contiguous_is_refused():
    with pytest.raises(ValueError, match="8-byte words"):
        host_pull.pull_to_device(torch.zeros(12, dtype=torch.uint8), torch.device("cpu"))
    with pytest.raises(ValueError, match="8-byte words"):
        host_pull.pull_to_device(torch.zeros(8, 4, dtype=torch.int64).t(), torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.parametrize("num_words", WORDS)
def test_on_cuda_pinned_bytes_arrive_while_a_large_copy_is_queued(num_words):
    raw = _random_bytes(num_words, num_words).pin_memory()
    bulk_host = torch.empty(256 << 20, dtype=torch.uint8).pin_memory()
    bulk = torch.empty_like(bulk_host, device="cuda")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        bulk.copy_(bulk_host, non_blocking=True)
    pulled = host_pull.pull_to_device(raw, torch.device("cuda"))
    torch.cuda.synchronize()
    assert torch.equal(pulled.cpu(), raw)
