"""Async tests run on uvloop, the loop the services use (the hook in tests/conftest.py)."""
from __future__ import annotations

import asyncio

import uvloop


async def test_async_tests_run_on_uvloop():
    assert isinstance(asyncio.get_running_loop(), uvloop.Loop)
