"""Fixtures of the io tests (helpers live in io_helpers.py)."""

from __future__ import annotations

import pytest
from io_helpers import ALL_NAMES

import qformats as qf


@pytest.fixture(params=ALL_NAMES)
def fmt(request):
    return qf.get_format(request.param)
