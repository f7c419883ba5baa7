"""Regenerates the gRPC stubs from protos/ (`python -m specsplit.api.protogen`); `--check` fails on drift."""

from __future__ import annotations

import filecmp
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTOS = ROOT / "protos"


def generate(out_dir: Path) -> list[Path]:
    import grpc_tools
    from grpc_tools import protoc

    sources = sorted(PROTOS.rglob("*.proto"))
    include = Path(grpc_tools.__file__).parent / "_proto"
    args = ["protoc", f"-I{PROTOS}", f"-I{include}", f"--python_out={out_dir}",
            f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}", *map(str, sources)]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    generated = []
    for source in sources:
        package_dir = out_dir / source.parent.relative_to(PROTOS)
        for parent in [package_dir, *package_dir.relative_to(out_dir).parents]:
            init = out_dir / parent / "__init__.py"
            if parent != Path(".") and not init.exists():
                init.write_text("")
        stem = source.stem
        generated += [package_dir / f"{stem}{suffix}" for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")]
    return generated


def _same(fresh: Path, committed: Path) -> bool:
    return committed.exists() and filecmp.cmp(fresh, committed, shallow=False)


def main() -> int:
    if "--check" not in sys.argv:
        generate(ROOT)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        stale = [f.relative_to(tmp) for f in fresh if not _same(f, ROOT / f.relative_to(tmp))]
    if stale:
        print("generated stubs are stale; run: python -m specsplit.api.protogen", *stale, sep="\n  ")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
