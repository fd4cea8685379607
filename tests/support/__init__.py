"""Helpers and child-process scripts the tests share, imported as ``tests.support.NAME`` (the
repository root is on ``sys.path`` under pytest) or run by path: a test in ``tests/LAYER/`` finds
them at ``Path(__file__).resolve().parents[1] / "support"``."""
