"""The layout's rules (docs/architecture.md#layout), kept by a test so that a change that breaks one
fails naming the file: no hand-written Python module of the product over 400 lines, no native
source over 500, the speculation core (`specsplit/speculation/`) importing only the standard library, torch
and itself, and no import cycle between the product's modules (lazy imports inside functions
count: a cycle is a cycle however late it closes)."""

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("specsplit", "gateway", "verify_service", "draft_service")
PYTHON_LINES, NATIVE_LINES = 400, 500


def _generated(path: Path) -> bool:
    return path.name.endswith(("_pb2.py", "_pb2_grpc.py"))  # python -m specsplit.api.protogen


def modules() -> dict[str, Path]:
    """The product's modules by dotted name (a package by its own name)."""
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if _generated(path):
                continue
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def imported(path: Path) -> set[str]:
    """Every absolute module name `path` imports, at any depth (`from a import b` names a and a.b)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def graph(found: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the product modules it imports (a name resolved to its longest known prefix)."""
    edges = {}
    for name, path in found.items():
        targets = set()
        for target in imported(path):
            prefixes = (target.rsplit(".", n)[0] for n in range(target.count(".") + 1))  # longest first
            known = next((prefix for prefix in prefixes if prefix in found), "")
            if known and known != name:
                targets.add(known)
        edges[name] = targets
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (networkx's)."""
    import networkx

    g = networkx.DiGraph([(a, b) for a, targets in edges.items() for b in targets])
    return sorted(sorted(c) for c in networkx.strongly_connected_components(g) if len(c) > 1)


def test_no_python_module_over_400_lines():
    long = {str(p.relative_to(ROOT)): n for p in modules().values()
            if (n := len(p.read_text().splitlines())) > PYTHON_LINES}
    assert not long, f"over {PYTHON_LINES} lines (split by what the parts do): {long}"


def test_no_native_source_over_500_lines():
    native = ROOT / "specsplit" / "model" / "native"
    sources = [p for p in sorted(native.iterdir()) if p.suffix in {".cpp", ".h"}]
    assert sources, f"no native sources found in {native}"
    long = {p.name: n for p in sources if (n := len(p.read_text().splitlines())) > NATIVE_LINES}
    assert not long, f"over {NATIVE_LINES} lines (split by what the parts do): {long}"


def test_the_speculation_core_imports_only_the_standard_library_torch_and_itself():
    core = ROOT / "specsplit" / "speculation"
    allowed = set(sys.stdlib_module_names) | {"torch"}
    wrong = {}
    for path in sorted(core.rglob("*.py")):
        for name in imported(path):
            top = name.split(".")[0]
            if top not in allowed and not name.startswith("specsplit.speculation") and top != "__future__":
                wrong.setdefault(path.name, set()).add(name)
    assert not wrong, f"specsplit/speculation/ must not import these (it is plain maths, no services): {wrong}"


def test_the_gateway_imports_no_torch():
    """The gateway computes nothing: its modules import no torch (the wire's and the runtime's
    tensor functions import it where they run), so it starts in a second and holds no torch."""
    import subprocess

    code = ("import sys, gateway.main, gateway.openai, specsplit.cli.serve, specsplit.model.headfile\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", f"importing the gateway loads torch: {out.stdout[:300]}"


def test_no_import_cycle_between_modules():
    found = modules()
    assert "gateway.rounds" in found and "specsplit.speculation.cursor" in found  # the walk sees the product
    loops = cycles(graph(found))
    assert not loops, f"import cycles (move what both need below them): {loops}"


def test_the_cycle_finder_finds_a_cycle_and_only_cycles():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []
    assert sorted(cycles({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"c"}})) == [["a", "b"], ["c", "d"]]


def layer(module: str) -> tuple[int, str]:
    """(its layer, its room within the layer): docs/architecture.md#modules."""
    parts = module.split(".")
    if parts[0] in ("verify_service", "draft_service", "gateway"):
        return 3, parts[0]
    sub = parts[1] if len(parts) > 1 else ""
    order = {"speculation": 0, "model": 1, "serving": 2, "launcher": 4, "bench": 5, "distill": 5, "cli": 6}
    return (order[sub], sub) if sub in order else (-1, sub)  # errors, extras, api: under everything


def test_each_layer_imports_only_those_before_it_and_no_service_another():
    edges = graph(modules())
    upward = sorted(f"{a} -> {b}" for a, targets in edges.items() for b in targets
                    if layer(b)[0] > layer(a)[0] or (layer(a)[0] == layer(b)[0] == 3 and layer(a)[1] != layer(b)[1]))
    assert not upward, ("imports against the layers speculation -> model -> serving -> services -> launcher -> "
                       f"bench, distill -> cli: {upward}")
