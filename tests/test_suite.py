"""The suite's own rules: its waits are bounded and say what never happened (a service that hangs at
start fails its test naming it, pytest-timeout bounds every test as a backstop, one that dies raises
its own error), and its helpers live in one place (conftest), not in test files importing each other."""

import ast
import asyncio
from pathlib import Path

import pytest
from conftest import service_address, until


async def test_a_service_that_hangs_at_start_fails_the_wait_naming_it(tmp_path):
    hung = asyncio.create_task(asyncio.sleep(3600))  # neither writes its address nor ends
    try:
        with pytest.raises(AssertionError, match=r"the verify service writing its address to verify.address: "
                                                 r"not within 0.2 s"):
            await service_address(tmp_path / "verify.address", hung, "verify", timeout_s=0.2)
    finally:
        hung.cancel()


async def test_a_service_that_dies_at_start_raises_its_own_error(tmp_path):
    async def broken():
        raise OSError("address already in use")

    dead = asyncio.create_task(broken())
    with pytest.raises(OSError, match="address already in use"):
        await service_address(tmp_path / "draft.address", dead, "draft", timeout_s=30)


async def test_until_returns_what_the_check_found():
    seen = []

    async def later():
        await asyncio.sleep(0)
        seen.append("ready")

    task = asyncio.create_task(later())
    assert await until(lambda: seen, "something to be seen", 30) == ["ready"]
    await task


def test_every_test_has_a_timeout(pytestconfig):
    assert pytestconfig.pluginmanager.hasplugin("timeout")
    assert float(pytestconfig.getini("timeout")) > 0


def test_no_test_file_imports_another():
    tests = Path(__file__).parent
    offenders = []
    for path in sorted(tests.glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.name}: {n}" for n in names if n.startswith(("test_", "tests."))]
    assert not offenders, "helpers belong in conftest.py: " + ", ".join(offenders)
