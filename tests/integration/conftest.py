"""Fixtures shared by the integration tests."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import uvloop

Run = Callable[[Callable[[], Coroutine[Any, Any, None]]], None]


@pytest.fixture(params=["asyncio", "uvloop"])
def run(request: pytest.FixtureRequest) -> Run:
    """Runs a test body on a fresh loop of each kind (the workers use uvloop), 30 s at most."""

    def runner(body: Callable[[], Coroutine[Any, Any, None]]) -> None:
        if request.param == "uvloop":
            uvloop.run(asyncio.wait_for(body(), 30))
        else:
            asyncio.run(asyncio.wait_for(body(), 30))

    return runner
