"""Install hygiene: what pyproject.toml declares is what the code needs, with floors that the
generated stubs accept and no exact pin that would replace a user's own torch."""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import re
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("specsplit", "gateway", "draft_service", "verify_service")
GENERATED = ("specsplit/api/common/v1", "specsplit/api/draft/v1", "specsplit/api/verify/v1", "specsplit/api/gateway/v1")


def project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def requirements(specs: list[str]) -> dict[str, Requirement]:
    return {canonical(r.name): r for r in map(Requirement, specs)}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def floor(requirement: Requirement) -> Version:
    floors = [Version(s.version) for s in requirement.specifier if s.operator in (">=", "==")]
    assert floors, f"{requirement} has no floor"
    return max(floors)


def test_runtime_dependencies_have_floors_and_no_exact_pins():
    runtime = requirements(project()["dependencies"])
    for name, requirement in runtime.items():
        operators = {s.operator for s in requirement.specifier}
        assert ">=" in operators, f"{requirement}: give it a floor"
        assert "==" not in operators, f"{requirement}: an exact pin replaces what the user has installed"
    assert floor(runtime["torch"]) < Version("2.13")  # a floor below this machine's wheel, not a pin


def test_floors_satisfy_the_generated_stubs():
    """The stubs refuse older runtimes at import (protobuf's ValidateProtobufRuntimeVersion, grpc's
    GRPC_GENERATED_VERSION): the floors must be at least what they ask for, and the generator pinned
    to the version that made them, so `protogen --check` compares like with like."""
    runtime = requirements(project()["dependencies"])
    dev = requirements(project()["optional-dependencies"]["dev"])
    protobuf_needed, grpc_needed = set(), set()
    for folder in GENERATED:
        for path in (ROOT / folder).glob("*_pb2.py"):
            major, minor, patch = re.search(r"Domain\.PUBLIC,\s*(\d+),\s*(\d+),\s*(\d+),", path.read_text()).groups()
            protobuf_needed.add(Version(f"{major}.{minor}.{patch}"))
        for path in (ROOT / folder).glob("*_pb2_grpc.py"):
            found = re.search(r"GRPC_GENERATED_VERSION = '([^']+)'", path.read_text())
            if found:
                grpc_needed.add(Version(found.group(1)))
    assert protobuf_needed and grpc_needed
    assert floor(runtime["protobuf"]) >= max(protobuf_needed)
    for name in ("grpcio", "grpcio-health-checking", "grpcio-reflection"):
        assert floor(runtime[name]) >= max(grpc_needed), name
    tools = [s for s in dev["grpcio-tools"].specifier]
    assert [s.operator for s in tools] == ["=="] and {Version(tools[0].version)} == grpc_needed


def _imports(path: Path) -> tuple[set[str], set[str]]:
    """Top-level names of absolute imports: (at module level, inside functions)."""
    tree = ast.parse(path.read_text())
    module_level, lazy = set(), set()
    body = set(map(id, tree.body))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module]
        else:
            continue
        (module_level if id(node) in body else lazy).update(n.split(".")[0] for n in names)
    return module_level, lazy


def test_every_third_party_import_is_declared():
    """Module-level imports need a runtime dependency; imports inside functions may come from an
    extra (they run only for the command that needs it)."""
    meta = project()
    runtime = set(requirements(meta["dependencies"]))
    extras = {name: set(requirements(specs)) for name, specs in meta["optional-dependencies"].items()}
    distributions = importlib.metadata.packages_distributions()
    ours = set(PACKAGES)
    problems = []
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if any(str(path.relative_to(ROOT)).startswith(g) for g in GENERATED):
                continue
            module_level, lazy = _imports(path)
            for name in module_level | lazy:
                if name in ours or name in sys.stdlib_module_names or name == "__future__":
                    continue
                dists = {canonical(d) for d in distributions.get(name, [])}
                assert dists, f"{path}: imports {name!r}, which no installed distribution provides"
                if dists & runtime:
                    continue
                extra = [e for e, reqs in extras.items() if dists & reqs]
                if name in module_level or not extra:
                    problems.append(f"{path.relative_to(ROOT)}: {name} ({sorted(dists)}) is "
                                    f"{'only in extra ' + str(extra) if extra else 'not declared'}")
    assert not problems, "\n".join(problems)


def test_conversion_without_its_extra_says_what_to_install(monkeypatch, tmp_path, capsys):
    from specsplit import cli, extras

    real = importlib.util.find_spec
    monkeypatch.setattr(extras.importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    monkeypatch.setenv("SPECSPLIT_CACHE", str(tmp_path))
    assert cli.main(["fetch-model"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install 'specsplit[convert]'" in err[0] and "'gguf'" in err[0], err
    assert not (tmp_path / "models").exists()


@pytest.mark.parametrize("module", ["colorsys", "not_a_module_specsplit_knows"])
def test_require(module, monkeypatch):
    from specsplit.errors import UsageError
    from specsplit.extras import require

    if module == "colorsys":  # installed (the standard library's), and not imported by anything here
        monkeypatch.delitem(sys.modules, module, raising=False)
        require(module, "x", "anything")
        assert module in sys.modules  # require imports what it found
    else:
        with pytest.raises(UsageError, match=r"pip install 'specsplit\[plot\]'"):
            require(module, "plot", "drawing")
