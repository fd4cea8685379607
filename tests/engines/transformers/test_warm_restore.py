"""Warm restores keep what does not depend on the call (issue 26 item 5).

A ``DynamicCache`` restore allocates a new buffer per call: its layout is laid over the new
buffer from a template, and its page table is the one of the last buffer of that shape, moved
to the new address. The claims under test: nothing is rebuilt on the second call, and every
restore, into whatever address, is bit-exact.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kvsnap.engines import transformers as kt
from kvsnap.engines.default_model import build_default_model
from kvsnap.engines.transformers import dynamic
from kvsnap.errors import LayoutError
from kvsnap.layout import contiguous_layout
from kvsnap.layout.cache import LayoutTemplate
from kvsnap.pipeline import shared_tables
from kvsnap.transfer.page_table import PageTable
from kvsnap.transfer.plan import Direction
from tests.support.dynamic_caches import same_kv

BLOCK = 16


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return build_default_model()


def _prefilled(model: torch.nn.Module, tokens: int, seed: int) -> tuple[object, list[int]]:
    ids = torch.randint(
        0, model.config.vocab_size, (tokens,), generator=torch.Generator().manual_seed(seed)
    )
    return kt.prefill_token_ids(model, [ids.tolist()])[0]


def _buffer(layers: int = 3, heads: int = 2, blocks: int = 4, dim: int = 8) -> torch.Tensor:
    return torch.empty((2, layers, 1, heads, blocks * BLOCK, dim), dtype=torch.float16)


def _layout_of(buffer: torch.Tensor):
    return contiguous_layout(list(buffer[0]), list(buffer[1]), block_size=BLOCK)


def _rows(buffer: torch.Tensor) -> list[torch.Tensor]:
    pairs = zip(buffer[0, :, 0].unbind(0), buffer[1, :, 0].unbind(0), strict=True)
    return [row for pair in pairs for row in pair]


def _copies(table: PageTable, staging: int = 1 << 20) -> list[tuple[np.ndarray, ...]]:
    names = table.geometry.tensor_names()
    tensors = np.repeat(np.arange(len(names)), 3)
    blocks = np.tile(np.array([0, 2, 3]), len(names))
    addresses = staging + np.arange(len(tensors)) * table.page_size_bytes
    return [
        (copy.src_bases, copy.dst_bases, copy.src_offsets, copy.dst_offsets, copy.slot_pages)
        for copy in table.copies(Direction.HOST_TO_DEVICE, tensors, blocks, addresses)
    ]


def test_a_template_lays_the_checked_layout_over_a_new_buffer() -> None:
    first, second = _buffer(), _buffer()
    template = LayoutTemplate(_layout_of(first))
    moved, built = template.over(_rows(second)), _layout_of(second)
    assert [t.data_ptr for t in moved.tensors] == [t.data_ptr for t in built.tensors]
    assert [(t.num_blocks, t.block_stride_bytes) for t in moved.tensors] == [
        (t.num_blocks, t.block_stride_bytes) for t in built.tensors
    ]
    assert [(r.tensor_index, r.name, r.mapping) for r in moved.refs] == [
        (r.tensor_index, r.name, r.mapping) for r in built.refs
    ]
    assert moved.ref("layers.2.value").tensor_index == built.ref("layers.2.value").tensor_index
    assert moved.geometry == built.geometry and moved.encoding == built.encoding


def test_a_template_refuses_tensors_laid_out_otherwise() -> None:
    template = LayoutTemplate(_layout_of(_buffer()))
    rows = _rows(_buffer())
    with pytest.raises(LayoutError, match="tensors"):
        template.over(rows[:-1])
    swapped = [rows[1], rows[0], *rows[2:]]  # K and V of layer 0: same shape, other offsets
    with pytest.raises(LayoutError, match="tensor 0"):
        template.over(swapped)
    with pytest.raises(LayoutError, match="tensor 0"):
        template.over([rows[0].clone(), *rows[1:]])  # a storage of its own: too small
    with pytest.raises(LayoutError, match="tensor 0"):
        template.over(_rows(_buffer(blocks=5)))
    # check_all=False checks the first tensor, and trusts the caller for the rest.
    with pytest.raises(LayoutError, match="tensor 0"):
        template.over(swapped, check_all=False)
    repeated = [rows[0], rows[0], *rows[2:]]
    with pytest.raises(LayoutError, match="tensor 1"):
        template.over(repeated)
    assert template.over(repeated, check_all=False).tensors[1].data_ptr == rows[0].data_ptr()


def test_a_rebased_page_table_is_the_table_of_the_moved_caches() -> None:
    first, second = _buffer(), _buffer()
    delta = second.data_ptr() - first.data_ptr()
    rebased = PageTable([_layout_of(first)]).rebased(delta)
    expected = _copies(PageTable([_layout_of(second)]))
    got = _copies(rebased)
    assert len(got) == len(expected) > 0
    for mine, theirs in zip(got, expected, strict=True):
        for a, b in zip(mine, theirs, strict=True):
            np.testing.assert_array_equal(a, b)


def test_the_shared_page_table_is_built_once_per_shape_and_rebased(monkeypatch) -> None:
    built: list[int] = []
    real = PageTable.__init__

    def counted(self, layouts):
        built.append(len(layouts))
        real(self, layouts)

    monkeypatch.setattr(PageTable, "__init__", counted)
    buffers = [_buffer(layers=5) for _ in range(3)]
    tables = [
        shared_tables.shared_page_table([_layout_of(b)], Direction.HOST_TO_DEVICE) for b in buffers
    ]
    assert built == [1], "one table for three buffers of one shape"
    # Keys and values in separate allocations: not the first buffer's layout moved as a whole.
    keys, values = _buffer(layers=5)[0], _buffer(layers=5)[1]
    shared_tables.shared_page_table(
        [contiguous_layout(list(keys), list(values), block_size=BLOCK)], Direction.HOST_TO_DEVICE
    )
    assert built == [1, 1]
    for buffer, table in zip(buffers, tables, strict=True):
        # As if built for this buffer: the same copies at this buffer's addresses.
        unshared = _copies(PageTable([_layout_of(buffer)]))
        for mine, theirs in zip(_copies(table), unshared, strict=True):
            for a, b in zip(mine, theirs, strict=True):
                np.testing.assert_array_equal(a, b)


def test_a_layout_at_a_freed_layouts_id_never_gets_the_old_layouts_table() -> None:
    # Keys are kept per set of layout objects by id, and Python hands a freed object's id to
    # the next one: a layout of another shape found under its id must get its own table.
    old_buffer = _buffer(layers=2, blocks=2)
    old = _layout_of(old_buffer)
    shared_tables.shared_page_table([old], Direction.HOST_TO_DEVICE)
    stale = shared_tables._LAYOUT_KEYS[(id(old),)]
    buffer = _buffer(layers=4, blocks=4)
    layout = _layout_of(buffer)
    shared_tables._LAYOUT_KEYS[(id(layout),)] = stale  # as if ``layout`` took ``old``'s id
    table = shared_tables.shared_page_table([layout], Direction.HOST_TO_DEVICE)
    assert table is not None and table.geometry == layout.geometry
    for mine, theirs in zip(_copies(table), _copies(PageTable([layout])), strict=True):
        for a, b in zip(mine, theirs, strict=True):
            np.testing.assert_array_equal(a, b)


def test_warm_dynamic_restores_rebuild_nothing_and_stay_exact(model, tmp_path, monkeypatch):
    cache, ids = _prefilled(model, 3 * BLOCK + 5, seed=1)
    path = tmp_path / "p.safetensors"
    kt.capture_dynamic_cache(cache, [ids], path, model=model)
    layouts: list[int] = []
    tables: list[int] = []
    real_layout, real_table = dynamic.contiguous_layout, PageTable.__init__

    def layout_counted(*args, **kwargs):
        layouts.append(1)
        return real_layout(*args, **kwargs)

    def table_counted(self, layouts_):
        tables.append(1)
        real_table(self, layouts_)

    monkeypatch.setattr(dynamic, "contiguous_layout", layout_counted)
    monkeypatch.setattr(PageTable, "__init__", table_counted)
    monkeypatch.setattr(dynamic, "_TEMPLATES", type(dynamic._TEMPLATES)())
    kept = [kt.restore_dynamic_cache(path, model=model)[0] for _ in range(4)]
    assert len(layouts) == 1 and len(tables) <= 1
    addresses = {kt.dynamic_cache_states(restored)[0][0].data_ptr() for restored in kept}
    assert len(addresses) == 4, "each restore is a cache of its own"
    assert all(same_kv(cache, restored) for restored in kept)
    assert [c.get_seq_length() for c in kept] == [len(ids)] * 4


def test_a_dynamic_restore_of_another_length_gets_its_own_layout(model, tmp_path: Path) -> None:
    paths = []
    caches = []
    for tokens, seed in ((2 * BLOCK, 2), (5 * BLOCK + 1, 3), (2 * BLOCK, 4)):
        cache, ids = _prefilled(model, tokens, seed)
        path = tmp_path / f"p{seed}.safetensors"
        kt.capture_dynamic_cache(cache, [ids], path, model=model)
        paths.append(path)
        caches.append(cache)
    for _ in range(2):
        restored = [kt.restore_dynamic_cache(path, model=model)[0] for path in paths]
        assert all(same_kv(a, b) for a, b in zip(caches, restored, strict=True))


def test_a_restored_cache_is_the_cache_transformers_builds_from_thesame_kv(model, tmp_path):
    # Layers are handed their KV without transformers' update: the state must be the same.
    cache, ids = _prefilled(model, BLOCK + 3, seed=5)
    path = tmp_path / "p.safetensors"
    kt.capture_dynamic_cache(cache, [ids], path, model=model)
    first, _ = kt.restore_dynamic_cache(path, model=model)
    second, _ = kt.restore_dynamic_cache(path, model=model)
    reference = kt.new_dynamic_cache(model)
    for index, (keys, values) in enumerate(kt.dynamic_cache_states(first)):
        reference.update(keys.clone(), values.clone(), index)
    assert vars(first).keys() == vars(reference).keys()
    for name, value in vars(reference).items():
        if name != "layers":
            assert vars(first)[name] == value, name
    assert len(first.layers) == len(reference.layers)
    for mine, theirs, other in zip(first.layers, reference.layers, second.layers, strict=True):
        assert type(mine) is type(theirs) and mine is not other
        assert vars(mine).keys() == vars(theirs).keys()
        for name, value in vars(theirs).items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(vars(mine)[name], value), name
            else:
                assert vars(mine)[name] == value, name
    # The caches are each their own: growing one leaves the other and the next restore alone.
    keys, values = kt.dynamic_cache_states(first)[0]
    first.update(keys[:, :, :2].clone(), values[:, :, :2].clone(), 0)
    assert first.layers[0].keys.shape[-2] == len(ids) + 2
    assert second.get_seq_length() == len(ids)
    assert kt.restore_dynamic_cache(path, model=model)[0].get_seq_length() == len(ids)
