"""Options shared by the test packages."""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--soak-seconds",
        type=float,
        default=None,
        help="how long tests/reliability/test_soak.py runs (default: $SPECCONTROL_SOAK_S or 60)",
    )
