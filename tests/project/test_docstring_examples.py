"""The front door's docstrings are in the house style, and their examples run as written.

Every public callable below has a summary line, ``Args:`` naming each parameter (saying its
default where it has one), ``Returns:``, ``Raises:`` and an ``Example:`` that doctest runs here
on the CPU, in a fresh directory where the ``kvsnap.capture`` example ran first: the
``prefix.safetensors`` it writes is what the other examples read. No Sphinx role is left in
them, since nothing renders one.
"""

from __future__ import annotations

import doctest
import inspect
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

import kvsnap
import kvsnap.distributed
from kvsnap.engines import transformers as kt
from kvsnap.testing import assert_kv_matches

#: The front door: every callable whose docstring this file holds to the house style.
PUBLIC: dict[str, Callable[..., Any]] = {
    "kvsnap.capture": kvsnap.capture,
    "kvsnap.Snapshot": kvsnap.Snapshot,
    "kvsnap.Snapshot.open": kvsnap.Snapshot.open,
    "kvsnap.Snapshot.sequence": kvsnap.Snapshot.sequence,
    "kvsnap.Snapshot.shared_blocks": kvsnap.Snapshot.shared_blocks,
    "kvsnap.Snapshot.verify": kvsnap.Snapshot.verify,
    "kvsnap.Snapshot.signature_problems": kvsnap.Snapshot.signature_problems,
    "kvsnap.Snapshot.signing_key_ids": kvsnap.Snapshot.signing_key_ids,
    "kvsnap.Snapshot.check_compatible": kvsnap.Snapshot.check_compatible,
    "kvsnap.Snapshot.read_tensor": kvsnap.Snapshot.read_tensor,
    "kvsnap.Snapshot.sequence_kv": kvsnap.Snapshot.sequence_kv,
    "kvsnap.Snapshot.compare": kvsnap.Snapshot.compare,
    "kvsnap.Snapshot.restore": kvsnap.Snapshot.restore,
    "kvsnap.Snapshot.valid_tokens_per_block": kvsnap.Snapshot.valid_tokens_per_block,
    "kvsnap.Snapshot.tensor_stats": kvsnap.Snapshot.tensor_stats,
    "kvsnap.Snapshot.stats": kvsnap.Snapshot.stats,
    "kvsnap.Snapshot.token_norms": kvsnap.Snapshot.token_norms,
    "kvsnap.Snapshot.close": kvsnap.Snapshot.close,
    "kvsnap.Pipeline": kvsnap.Pipeline,
    "kvsnap.Pipeline.capture": kvsnap.Pipeline.capture,
    "kvsnap.Pipeline.restore": kvsnap.Pipeline.restore,
    "kvsnap.Pipeline.restore_blocks": kvsnap.Pipeline.restore_blocks,
    "kvsnap.Pipeline.restore_chunks": kvsnap.Pipeline.restore_chunks,
    "kvsnap.distributed.capture": kvsnap.distributed.capture,
    "kvsnap.distributed.restore": kvsnap.distributed.restore,
    "kvsnap.vllm_split_layout": kvsnap.vllm_split_layout,
    "kvsnap.vllm_legacy_layout": kvsnap.vllm_legacy_layout,
    "kvsnap.packed_layout": kvsnap.packed_layout,
    "kvsnap.mla_layout": kvsnap.mla_layout,
    "kvsnap.cross_layer_layout": kvsnap.cross_layer_layout,
    "kvsnap.flat_paged_layout": kvsnap.flat_paged_layout,
    "kvsnap.contiguous_layout": kvsnap.contiguous_layout,
    "kvsnap.testing.assert_kv_matches": assert_kv_matches,
    "kvsnap.engines.transformers.capture_dynamic_cache": kt.capture_dynamic_cache,
    "kvsnap.engines.transformers.capture_dynamic_caches": kt.capture_dynamic_caches,
    "kvsnap.engines.transformers.restore_dynamic_cache": kt.restore_dynamic_cache,
    "kvsnap.engines.transformers.capture_paged_cache": kt.capture_paged_cache,
    "kvsnap.engines.transformers.capture_paged_prefix": kt.capture_paged_prefix,
    "kvsnap.engines.transformers.capture_manager_requests": kt.capture_manager_requests,
    "kvsnap.engines.transformers.restore_paged_cache": kt.restore_paged_cache,
    "kvsnap.engines.transformers.KVDumpHook": kt.KVDumpHook,
    "kvsnap.engines.transformers.dump_at_step": kt.dump_at_step,
    "kvsnap.engines.transformers.prefill": kt.prefill,
    "kvsnap.engines.transformers.prefill_token_ids": kt.prefill_token_ids,
    "kvsnap.engines.transformers.continue_generation": kt.continue_generation,
    "kvsnap.engines.transformers.generate_from_restored": kt.generate_from_restored,
    "kvsnap.engines.transformers.check_snapshot_fits": kt.check_snapshot_fits,
    "kvsnap.engines.transformers.geometry_for_model": kt.geometry_for_model,
}
#: Classes whose constructor is not for callers (``Snapshot.open`` makes a ``Snapshot``).
NOT_CONSTRUCTED = {"kvsnap.Snapshot"}
#: Callables that raise nothing of their own (they work on what ``Snapshot.open`` read).
RAISE_NOTHING = {
    "kvsnap.Snapshot",
    "kvsnap.Snapshot.close",
    "kvsnap.Snapshot.shared_blocks",
    "kvsnap.Snapshot.signature_problems",
    "kvsnap.Snapshot.signing_key_ids",
    "kvsnap.Snapshot.valid_tokens_per_block",
}
SECTIONS = ("Args:", "Returns:", "Raises:", "Example:")
SPHINX_ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|exc|obj|py:\w+):`")


def _run_example(name: str) -> None:
    """Run the example of ``PUBLIC[name]`` in the current directory; fail with doctest's report."""
    [test] = doctest.DocTestFinder(recurse=False).find(PUBLIC[name], name, globs={})
    assert test.examples, f"{name} has no example"
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    report: list[str] = []
    try:
        runner.run(test, out=report.append)
    finally:
        test.globs.clear()
        if dist.is_initialized():  # an example of kvsnap.distributed that failed midway
            dist.destroy_process_group()
    assert runner.failures == 0, "".join(report)


def _sections(doc: str) -> dict[str, list[str]]:
    """The lines of each top-level section (``Args:``, ...) of a cleaned docstring."""
    found: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in doc.splitlines():
        if re.fullmatch(r"[A-Z][a-z]+:", line):
            current = found.setdefault(line, [])
        elif current is not None and (line.startswith(" ") or not line):
            current.append(line)
        else:
            current = None
    return found


def _documented_parameters(args: list[str]) -> dict[str, str]:
    """Each parameter ``Args:`` names, with the text of its entry."""
    entries: dict[str, str] = {}
    name = None
    for line in args:
        match = re.match(r"    (\*{0,2}\w+)(?: \([^)]*\))?: ?(.*)", line)
        if match:
            name = match.group(1).lstrip("*")
            entries[name] = match.group(2)
        elif name is not None:
            entries[name] += " " + line.strip()
    return entries


def _parameters(name: str, obj: Callable[..., Any]) -> list[inspect.Parameter]:
    if name in NOT_CONSTRUCTED:
        return []
    parameters = list(inspect.signature(obj).parameters.values())
    return [p for p in parameters if p.name not in ("self", "cls")]


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_the_docstring_is_in_the_house_style(name: str) -> None:
    obj = PUBLIC[name]
    doc = inspect.cleandoc(obj.__doc__ or "")
    summary = doc.splitlines()[0] if doc else ""
    assert summary.endswith(".") and len(summary) <= 100, f"{name}: summary {summary!r}"
    assert not SPHINX_ROLE.search(doc), f"{name}: {SPHINX_ROLE.search(doc)[0]} renders nowhere"
    sections = _sections(doc)
    parameters = _parameters(name, obj)
    returns_nothing = inspect.isclass(obj) or inspect.signature(obj).return_annotation in (
        None,
        "None",
    )
    needed = [s for s in SECTIONS if s != "Returns:" or not returns_nothing]
    needed = [s for s in needed if s != "Args:" or parameters]
    needed = [s for s in needed if s != "Raises:" or name not in RAISE_NOTHING]
    assert [s for s in needed if s not in sections] == [], f"{name}: sections {list(sections)}"
    documented = _documented_parameters(sections.get("Args:", []))
    assert [p.name for p in parameters if p.name not in documented] == [], name
    assert [name for name in documented if name not in {p.name for p in parameters}] == []
    for parameter in parameters:
        if parameter.default is not inspect.Parameter.empty:
            entry = documented[parameter.name]
            assert "default" in entry.lower(), f"{name}: {parameter.name} says no default"
    assert ">>>" in "\n".join(sections["Example:"]), f"{name}: the example runs nothing"


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_the_example_runs_as_written(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    if name != "kvsnap.capture":
        _run_example("kvsnap.capture")  # writes the prefix.safetensors the others read
        assert (tmp_path / "prefix.safetensors").is_file()
    _run_example(name)
