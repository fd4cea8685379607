"""pytest plugin: golden KV snapshots in tests (``assert_kv_matches``, ``kv_snapshot`` fixture).

Installed with kvsnap (entry point ``pytest11``), so pytest loads it in every session; it stays
inert unless a test uses it. Importing it imports neither torch nor the rest of kvsnap: the
comparison machinery (``kvsnap.testing.golden``) is imported on the first assertion.

A test compares a KV cache with a golden snapshot kept next to the test file::

    from kvsnap.testing import assert_kv_matches

    def test_prefill_kv(model):
        cache = model(input_ids, use_cache=True).past_key_values
        assert_kv_matches(cache, "prefill", atol=1e-3)

The golden file is ``__kvsnap__/prefill.safetensors`` in the test file's directory, an ordinary
kvsnap snapshot (``kvsnap inspect`` and ``kvsnap verify --against`` work on it).

* Golden file present: the KV is compared token by token; a mismatch fails the test with the
  report ``kvsnap verify --against`` prints (per tensor the largest difference and the first
  mismatching sequence, token and head).
* Golden file missing: it is written from the KV given, and the test **fails** saying so
  (pytest-regressions style): a golden file nobody has looked at proves nothing. Rerun to pass.
* ``pytest --kvsnap-update``: every golden file used is (re)written from the KV given when it is
  missing or differs, and the assertion passes. The terminal summary lists the files written.
* ``compression="lossless"`` (per assertion), ``pytest --kvsnap-compression lossless`` or the ini
  option ``kvsnap_compression = lossless``: golden files written are lossless encoded snapshots
  (smaller in the repository; decoded bit for bit before the comparison, which stays exact).
  Unset, a golden file is written as the existing one is stored, else plain. With
  ``--kvsnap-update``, a golden file stored otherwise than a compression asked for is rewritten.
"""

from __future__ import annotations

import re
from collections.abc import Generator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from kvsnap.testing.golden import GoldenResult

#: Directory, next to the test file, holding golden snapshots.
GOLDEN_DIRNAME = "__kvsnap__"
#: Suffix of golden snapshot files.
GOLDEN_SUFFIX = ".safetensors"

#: How golden files may be stored (``kvsnap.testing.golden.GOLDEN_COMPRESSIONS``, spelled out
#: here: importing the plugin imports nothing of kvsnap's).
COMPRESSIONS = ("none", "lossless")

_VALID_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-\[\]=+,]*$")
_written_key = pytest.StashKey[list[str]]()

# The test item running now, so that the free function assert_kv_matches can find its
# directory and options; restored (not cleared) after each item so nested in-process pytest
# sessions (pytester) do not lose the outer item.
_active_item: pytest.Item | None = None


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvsnap", "kvsnap golden KV snapshots")
    group.addoption(
        "--kvsnap-update",
        action="store_true",
        default=False,
        dest="kvsnap_update",
        help="(Re)write the golden KV snapshots that tests compare with, instead of failing.",
    )
    group.addoption(
        "--kvsnap-compression",
        choices=COMPRESSIONS,
        default=None,
        dest="kvsnap_compression",
        help="Store golden KV snapshots written in this run as none (plain) or lossless "
        "(smaller, compared exactly). Default: the ini option kvsnap_compression, else as the "
        "existing golden file is, else none.",
    )
    parser.addini(
        "kvsnap_compression",
        "How golden KV snapshots are stored when written: none or lossless.",
        default="",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_written_key] = []
    configured = config.getini("kvsnap_compression")
    if configured and configured not in COMPRESSIONS:
        raise pytest.UsageError(
            f"ini option kvsnap_compression = {configured!r}: one of {', '.join(COMPRESSIONS)}"
        )


def configured_compression(config: pytest.Config) -> str | None:
    """The session's compression of golden files written: ``--kvsnap-compression``, else the
    ini option ``kvsnap_compression``, else ``None`` (as the existing golden file is)."""
    chosen = config.getoption("kvsnap_compression", default=None)
    return chosen or config.getini("kvsnap_compression") or None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(
    item: pytest.Item, nextitem: pytest.Item | None
) -> Generator[None, Any, Any]:
    global _active_item
    previous = _active_item
    _active_item = item
    try:
        return (yield)
    finally:
        _active_item = previous


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    written = config.stash.get(_written_key, [])
    if written:
        terminalreporter.write_sep("-", "kvsnap golden snapshots written")
        for line in written:
            terminalreporter.write_line(line)


def golden_path(test_path: Path, name: str) -> Path:
    """The golden file for ``name`` of tests in ``test_path``: ``__kvsnap__/<name>.safetensors``.

    ``name`` must be a plain file name (letters, digits, ``._-[]=+,``; no path separators), so a
    golden file can never land outside the ``__kvsnap__`` directory.
    """
    if not _VALID_NAME.match(name) or ".." in name:
        raise ValueError(
            f"golden snapshot name {name!r} must be a plain file name "
            "(letters, digits and ._-[]=+, ; no path separators)"
        )
    directory = test_path.parent if test_path.suffix == ".py" else test_path
    return directory / GOLDEN_DIRNAME / f"{name}{GOLDEN_SUFFIX}"


def _check(
    item: pytest.Item,
    actual: object,
    name: str,
    *,
    atol: float,
    rtol: float,
    block_size: int | None,
    token_ids: Any,
    compression: str | None,
) -> None:
    """Compare ``actual`` with golden ``name`` of ``item``'s test file; fail the test if needed."""
    __tracebackhide__ = True
    from kvsnap.testing.golden import check_golden  # torch is imported only here, on first use

    path = golden_path(Path(str(item.path)), name)
    update = bool(item.config.getoption("kvsnap_update", default=False))
    result: GoldenResult = check_golden(
        actual,
        path,
        update=update,
        atol=atol,
        rtol=rtol,
        block_size=block_size,
        token_ids=token_ids,
        compression=compression or configured_compression(item.config),
    )
    if result.written:
        item.config.stash.setdefault(_written_key, []).append(
            f"{result.status}: {path} ({item.nodeid})"
        )
    if result.status == "missing":
        pytest.fail(
            f"golden KV snapshot {path} did not exist; it has been written from this run. "
            "Check it, commit it and rerun (or run pytest --kvsnap-update to write golden "
            "snapshots without failing).",
            pytrace=False,
        )
    if result.status == "mismatch":
        raise AssertionError(
            f"KV does not match the golden snapshot {path} (atol={atol}, rtol={rtol}):\n"
            f"{result.report}\n"
            "If the change is intended, rerun with pytest --kvsnap-update."
        )


def assert_kv_matches(
    cache_or_tensors: object,
    name: str,
    *,
    atol: float = 0.0,
    rtol: float = 0.0,
    block_size: int | None = None,
    token_ids: Any = None,
    compression: str | None = None,
) -> None:
    r"""Assert that a KV cache matches the golden snapshot ``name`` kept next to the running test.

    Runs inside a pytest test with the kvsnap plugin active (the default once kvsnap is
    installed): the golden file is ``__kvsnap__/<name>.safetensors`` next to the test file. A
    missing golden file is written and fails the test, saying so, unless ``--kvsnap-update``
    was given (which also rewrites golden files that differ).

    Args:
        cache_or_tensors: A transformers ``DynamicCache`` (each batch row one sequence), a
            kvsnap ``Snapshot`` (or the path of one), or one sequence as a mapping
            ``{"layers.{i}.key": (tokens, heads, head_dim), "layers.{i}.value": ...}`` (MLA:
            ``"layers.{i}.latent": (tokens, latent_dim)``).
        name: The golden snapshot's name: letters, digits and ``._-[]=+,``.
        atol: Absolute tolerance: elements mismatch when ``|actual - golden| > atol + rtol *
            |golden|``, or exactly one is NaN. Default ``0.0``: bit-identical.
        rtol: Relative tolerance. Default ``0.0``.
        block_size: Tokens per block of a golden file written now. Default ``None``: the
            existing golden's, else the snapshot's, else 16.
        token_ids: One row of token ids per sequence, recorded and compared too. Default
            ``None``: distinct placeholder ids per sequence.
        compression: How a golden file written now is stored: ``"none"`` (an ordinary
            snapshot) or ``"lossless"`` (smaller, decoded bit for bit before the comparison).
            Default ``None``: ``--kvsnap-compression``, else the ini option
            ``kvsnap_compression``, else as the existing golden file is, else ``"none"``.

    Raises:
        AssertionError: The KV differs from the golden snapshot; the message is the report
            ``kvsnap verify --against`` prints.
        ValueError: Called outside a pytest test, a name that could leave the golden
            directory, or a compression other than ``"none"`` or ``"lossless"``.

    Example:
        A test module using it, run twice by pytest: the first run writes the golden file
        and fails, saying so; from then on the same KV passes.

        >>> import pathlib, subprocess, sys
        >>> _ = pathlib.Path("test_kv.py").write_text(
        ...     "import torch\n"
        ...     "from kvsnap.testing import assert_kv_matches\n"
        ...     "def test_kv():\n"
        ...     "    kv = {f'layers.0.{part}': torch.ones(5, 2, 8) for part in ('key', 'value')}\n"
        ...     "    assert_kv_matches(kv, 'ones')\n"
        ... )
        >>> pytest = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_kv.py"]
        >>> subprocess.run(pytest, capture_output=True).returncode
        1
        >>> sorted(path.name for path in pathlib.Path("__kvsnap__").iterdir())
        ['ones.safetensors']
        >>> subprocess.run(pytest, capture_output=True).returncode
        0
    """
    __tracebackhide__ = True
    item = _active_item
    if item is None:
        raise ValueError(
            "assert_kv_matches must run inside a pytest test with the kvsnap plugin loaded; "
            "outside pytest use kvsnap.testing.golden.check_golden(..., path, update=...)"
        )
    _check(
        item,
        cache_or_tensors,
        name,
        atol=atol,
        rtol=rtol,
        block_size=block_size,
        token_ids=token_ids,
        compression=compression,
    )


class KVSnapshotChecker:
    """What the ``kv_snapshot`` fixture gives a test: golden-snapshot assertions bound to it."""

    def __init__(self, item: pytest.Item) -> None:
        self._item = item

    @property
    def update(self) -> bool:
        """Whether this session rewrites golden snapshots (``--kvsnap-update``)."""
        return bool(self._item.config.getoption("kvsnap_update", default=False))

    @property
    def compression(self) -> str | None:
        """How this session stores golden files written (``--kvsnap-compression``, else the
        ini option ``kvsnap_compression``); ``None``: as the existing golden file is."""
        return configured_compression(self._item.config)

    @property
    def default_name(self) -> str:
        """The test's own name with characters unsafe in file names replaced by ``_``."""
        return re.sub(r"[^A-Za-z0-9._\-\[\]=+,]", "_", self._item.name)

    def path(self, name: str | None = None) -> Path:
        """The golden snapshot file for ``name`` (default: ``default_name``)."""
        return golden_path(Path(str(self._item.path)), name or self.default_name)

    def assert_matches(
        self,
        cache_or_tensors: object,
        name: str | None = None,
        *,
        atol: float = 0.0,
        rtol: float = 0.0,
        block_size: int | None = None,
        token_ids: Any = None,
        compression: str | None = None,
    ) -> None:
        """``assert_kv_matches`` for this test; ``name`` defaults to ``default_name``."""
        __tracebackhide__ = True
        _check(
            self._item,
            cache_or_tensors,
            name or self.default_name,
            atol=atol,
            rtol=rtol,
            block_size=block_size,
            token_ids=token_ids,
            compression=compression,
        )

    __call__ = assert_matches


@pytest.fixture
def kv_snapshot(request: pytest.FixtureRequest) -> KVSnapshotChecker:
    """Golden KV snapshot assertions for this test: ``kv_snapshot(cache[, "name"])``."""
    return KVSnapshotChecker(request.node)
