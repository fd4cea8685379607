"""The error rule of ``kvsnap.errors``, pinned.

Every error class is importable from ``kvsnap`` and has one place in the rule (the caller's
mistake, a bad file, a snapshot that does not fit, the environment failing), which its bases
must agree with. An unknown sequence id raises ``UnknownSequenceError`` from every API that
takes one, on real snapshots: a plain one, a parted one, across TP ranks, and in the CLI.
"""

from __future__ import annotations

import datetime
import inspect
import json
import multiprocessing
import os
import pickle
import re
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from typer.testing import CliRunner

import kvsnap
from kvsnap import analysis, distributed, errors
from kvsnap.cli.app import app
from kvsnap.errors import (
    BackendUnavailableError,
    BadSignatureError,
    CacheCapacityError,
    IncompatibleSnapshotError,
    KVSnapError,
    LayoutError,
    ModelLoadError,
    NotASnapshotError,
    RankFailedError,
    RestoreIncompleteError,
    SaveAbandonedError,
    SignatureError,
    SnapshotCorruptError,
    SnapshotIOError,
    TransferFailedError,
    UnknownSequenceError,
    UnsignedSnapshotError,
    UnsupportedVersionError,
)

#: Where each class stands in the rule of kvsnap.errors.
CALLERS_MISTAKE = {LayoutError, ModelLoadError, UnknownSequenceError}
BAD_FILE = {
    SnapshotCorruptError,
    RestoreIncompleteError,
    NotASnapshotError,
    UnsupportedVersionError,
    SignatureError,
    UnsignedSnapshotError,
    BadSignatureError,
}
DOES_NOT_FIT = {IncompatibleSnapshotError, CacheCapacityError, UnknownSequenceError}
ENVIRONMENT = {
    SnapshotIOError,
    BackendUnavailableError,
    TransferFailedError,
    RankFailedError,
    SaveAbandonedError,
}
CALLER_TYPES = (ValueError, TypeError, KeyError, IndexError)

HEADS, HEAD_DIM, BLOCK, BLOCKS, LAYERS = 4, 8, 16, 8, 2
#: Seconds a spawned rank may take before the test calls it hung.
RANK_TIMEOUT_S = 120


def _error_classes() -> set[type[BaseException]]:
    return {
        value
        for value in vars(errors).values()
        if inspect.isclass(value) and issubclass(value, BaseException)
    }


def test_every_error_class_is_importable_from_kvsnap() -> None:
    for cls in _error_classes():
        assert getattr(kvsnap, cls.__name__) is cls, cls
        assert cls.__name__ in kvsnap.__all__, cls
    exported = {getattr(kvsnap, name) for name in kvsnap.__all__ if name != "__version__"}
    assert {value for value in exported if inspect.isclass(value)} & _error_classes() == (
        _error_classes()
    )


def test_every_error_class_has_its_place_in_the_rule_and_its_bases_agree() -> None:
    classified = CALLERS_MISTAKE | BAD_FILE | DOES_NOT_FIT | ENVIRONMENT
    assert classified == _error_classes() - {KVSnapError}
    assert all(issubclass(cls, KVSnapError) for cls in classified)
    assert all(issubclass(cls, CALLER_TYPES) for cls in CALLERS_MISTAKE)
    assert not any(issubclass(cls, CALLER_TYPES) for cls in classified - CALLERS_MISTAKE)
    assert all(issubclass(cls, IncompatibleSnapshotError) for cls in DOES_NOT_FIT)
    file_roots = (SnapshotCorruptError, NotASnapshotError, UnsupportedVersionError, SignatureError)
    assert all(issubclass(cls, file_roots) for cls in BAD_FILE)
    fits_or_files = (*file_roots, IncompatibleSnapshotError)
    assert not any(issubclass(cls, fits_or_files) for cls in ENVIRONMENT)
    # The tree in the module's docstring names every class (the old alias aside).
    named = set(re.findall(r"^[ │├└─]+(\w+)", errors.__doc__, flags=re.MULTILINE))
    assert {cls.__name__ for cls in _error_classes()} - {"BackendUnavailable"} <= named


def test_backend_unavailable_keeps_its_old_name() -> None:
    from kvsnap import transfer

    assert errors.BackendUnavailable is BackendUnavailableError
    assert transfer.BackendUnavailable is transfer.BackendUnavailableError
    assert transfer.BackendUnavailableError is BackendUnavailableError
    assert issubclass(BackendUnavailableError, RuntimeError)


def test_an_unknown_sequence_error_reads_as_a_sentence_and_survives_pickling() -> None:
    error = UnknownSequenceError("nope", [f"s{i}" for i in range(10)], file="x.safetensors")
    assert str(error).startswith("x.safetensors: no sequence 'nope' (it has: 's0', 's1'")
    assert str(error).endswith("(10 in all))")
    copy = pickle.loads(pickle.dumps(error))
    assert (type(copy), str(copy), copy.sequence_id, copy.known, copy.file) == (
        UnknownSequenceError,
        str(error),
        "nope",
        error.known,
        "x.safetensors",
    )


# ---------------------------------------------------------------------------------------------
# An unknown sequence id, everywhere


def _cache(seed: int, *, tp_rank: int = 0, tp_size: int = 1) -> list[torch.Tensor]:
    """A vLLM split cache, ``(blocks, 2, block_size, heads, head_dim)`` per layer: rank
    ``tp_rank``'s heads of a model with ``HEADS`` KV heads."""
    generator = torch.Generator().manual_seed(seed)
    full = [torch.randn(BLOCKS, 2, BLOCK, HEADS, HEAD_DIM, generator=generator) for _ in range(2)]
    local = HEADS // tp_size
    heads = slice(tp_rank * local, (tp_rank + 1) * local)
    return [layer[:, :, :, heads].contiguous() for layer in full]


def _sequences() -> list[kvsnap.SequenceBlocks]:
    return [
        kvsnap.SequenceBlocks("a", np.arange(20), np.array([3, 5])),
        kvsnap.SequenceBlocks("b", np.arange(100, 116), np.array([1])),
    ]


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("plain") / "snap.safetensors"
    kvsnap.capture(kvsnap.vllm_split_layout(_cache(0)), _sequences(), path)
    return path


@pytest.fixture(scope="module")
def parted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("parted") / "snap.safetensors"
    layouts = [
        kvsnap.vllm_split_layout(
            _cache(0, tp_rank=r, tp_size=2), num_kv_heads=HEADS, tp_rank=r, tp_size=2
        )
        for r in range(2)
    ]
    kvsnap.capture(layouts, _sequences(), path, per_rank_parts=True)
    return path


def _assert_unknown(caught: pytest.ExceptionInfo[UnknownSequenceError]) -> None:
    error = caught.value
    assert isinstance(error, KeyError) and isinstance(error, IncompatibleSnapshotError)
    assert error.sequence_id == "nope" and set(error.known) == {"a", "b"}
    assert "no sequence 'nope'" in str(error)


@pytest.mark.parametrize("which", ["plain", "parted"])
def test_reads_and_statistics_of_an_unknown_sequence_raise_one_type(
    which: str, request: pytest.FixtureRequest
) -> None:
    path = request.getfixturevalue(which)
    with kvsnap.Snapshot.open(path) as snapshot:
        assert snapshot.sequence("a").id == "a"
        for read in (
            lambda: snapshot.sequence("nope"),
            lambda: snapshot.sequence_kv("nope", "layers.0.key"),
            lambda: snapshot.token_norms("nope"),
            lambda: analysis.token_norms(snapshot, "nope"),
        ):
            with pytest.raises(UnknownSequenceError) as caught:
                read()
            _assert_unknown(caught)


@pytest.mark.parametrize("which", ["plain", "parted"])
def test_restores_of_an_unknown_sequence_raise_one_type_and_write_nothing(
    which: str, request: pytest.FixtureRequest
) -> None:
    path = request.getfixturevalue(which)
    target = [torch.zeros(BLOCKS, 2, BLOCK, HEADS, HEAD_DIM) for _ in range(2)]
    layout = kvsnap.vllm_split_layout(target)
    pipeline = kvsnap.Pipeline(layout)
    with kvsnap.Snapshot.open(path) as snapshot:
        for restore in (
            lambda: snapshot.restore(layout, {"a": [0, 1], "nope": [2]}),
            lambda: pipeline.restore(snapshot, {"nope": [2]}),
            lambda: pipeline.restore(path, {"nope": [2]}),
        ):
            with pytest.raises(UnknownSequenceError) as caught:
                restore()
            _assert_unknown(caught)
    assert all(not layer.any() for layer in target)


def test_transformers_restores_of_an_unknown_sequence_raise_one_type(plain: Path) -> None:
    from kvsnap.engines import transformers as kt

    with pytest.raises(UnknownSequenceError) as caught:
        kt.restore_dynamic_cache(plain, sequence_id="nope")
    _assert_unknown(caught)


def test_the_cli_reports_an_unknown_sequence_as_a_usage_error(plain: Path, tmp_path: Path) -> None:
    plot = tmp_path / "norms.png"
    result = CliRunner().invoke(
        app, ["inspect", str(plain), "--plot", str(plot), "--sequence", "nope"]
    )
    assert result.exit_code == 2, result.output
    assert f"{plain}: no sequence 'nope' (it has: 'a', 'b')" in " ".join(result.output.split())
    assert not plot.exists()


def _restore_on_rank(rank: int, world: int, job: dict[str, Any]) -> None:
    """One rank of a distributed restore of ``job["block_ids"][rank]``; writes what it raised."""
    dist.init_process_group(
        "gloo",
        init_method=f"file://{job['rendezvous']}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        layout = kvsnap.vllm_split_layout(
            [torch.zeros_like(layer) for layer in _cache(0, tp_rank=rank, tp_size=world)],
            num_kv_heads=HEADS,
            tp_rank=rank,
            tp_size=world,
        )
        try:
            distributed.restore(job["path"], layout, job["block_ids"][rank])
            outcome: dict[str, Any] = {"type": None}
        except Exception as error:
            outcome = {
                "type": type(error).__name__,
                "sequence_id": getattr(error, "sequence_id", None),
            }
        Path(job["out"], f"rank{rank}.json").write_text(json.dumps(outcome))
    finally:
        dist.destroy_process_group()


def _restore_across_ranks(tmp_path: Path, path: Path, block_ids: list[dict]) -> list[dict]:
    out = tmp_path / f"ranks-{os.urandom(4).hex()}"
    out.mkdir()
    job = {
        "path": str(path),
        "out": str(out),
        "rendezvous": str(out / "rdv"),
        "block_ids": block_ids,
    }
    context = multiprocessing.get_context("spawn")
    ranks = [context.Process(target=_restore_on_rank, args=(r, 2, job)) for r in range(2)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(RANK_TIMEOUT_S)
        if process.is_alive():
            process.kill()
            raise AssertionError("a rank hung")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_a_distributed_restore_of_an_unknown_sequence_raises_it_on_every_rank(
    parted: Path, tmp_path: Path
) -> None:
    asked = {"nope": [0]}
    outcomes = _restore_across_ranks(tmp_path, parted, [asked, asked])
    assert outcomes == [{"type": "UnknownSequenceError", "sequence_id": "nope"}] * 2
    # Ranks asked for different sequences (which the API forbids) failed differently: that is
    # no longer the caller's one mistake but a rank failure, on every rank alike.
    outcomes = _restore_across_ranks(tmp_path, parted, [asked, {"a": [0, 1]}])
    assert [outcome["type"] for outcome in outcomes] == ["RankFailedError"] * 2


# ---------------------------------------------------------------------------------------------
# Other caller mistakes


def test_layouts_of_ranks_that_disagree_are_a_layout_error() -> None:
    four_heads = kvsnap.vllm_split_layout(_cache(0, tp_rank=0, tp_size=2), tp_size=2)
    other = [torch.zeros(BLOCKS, 2, BLOCK, HEADS // 2, HEAD_DIM * 2) for _ in range(2)]
    other_geometry = kvsnap.vllm_split_layout(other, tp_rank=1, tp_size=2)
    with pytest.raises(LayoutError, match="TP ranks disagree on the KV geometry"):
        kvsnap.Pipeline([four_heads, other_geometry])


def test_kvsnap_distributed_before_torch_distributed_is_a_value_error(plain: Path) -> None:
    if dist.is_initialized():
        pytest.skip("this process already joined a process group")
    layout = kvsnap.vllm_split_layout([torch.zeros(BLOCKS, 2, BLOCK, HEADS, HEAD_DIM)] * 2)
    with pytest.raises(ValueError, match="initialised first"):
        distributed.restore(plain, layout, {"a": [0, 1]})


def test_capturing_live_requests_of_an_asynchronous_manager_is_a_value_error(
    tmp_path: Path,
) -> None:
    from kvsnap.engines import transformers as kt

    # Only what the refusal looks at: a running manager batching asynchronously.
    manager = types.SimpleNamespace(
        batch_processor=types.SimpleNamespace(use_async_batching=True), is_running=lambda: True
    )
    with pytest.raises(ValueError, match="use_async_batching=False"):
        kt.capture_manager_requests(manager, ["r"], tmp_path / "x.safetensors", model=None)
