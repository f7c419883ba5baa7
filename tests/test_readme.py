"""The README is a product page a newcomer copies from: at most 250 lines, and every command in its
shell blocks (and in the docs' usage and deploy pages) is one the CLI accepts as written, flag by
flag; paths it names exist; its Python block compiles. Commands that need no network or second host
also run (`models`)."""

import itertools
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = ("README.md", "docs/usage.md", "deploy/README.md")


def blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.S)


def commands(page: str) -> list[list[str]]:
    """Each shell command of a page's bash blocks as argv: continuations joined, a `host$ ` prompt,
    `VAR=value` prefixes and trailing comments dropped."""
    found = []
    for block in blocks((ROOT / page).read_text(), "bash"):
        pending = ""
        for line in block.replace("\\\n", " ").splitlines():
            pending += ("\n" if pending else "") + re.sub(r"^\s*\w+\$\s+", "", line)
            try:
                argv = shlex.split(pending, comments=True)
            except ValueError:  # a quoted string goes on to the next line
                continue
            pending = ""
            argv = list(itertools.dropwhile(lambda word: re.fullmatch(r"[A-Z_]+=\S*", word), argv))  # env settings
            if argv:
                found.append(argv)
        assert not pending, f"{page}: an unclosed quotation in {pending!r}"
    return found


def as_cli(argv: list[str]) -> list[str] | None:
    """The `specsplit` arguments a command stands for (run.sh's mapping), or None: not ours."""
    if argv[0] == "./run.sh":
        if argv[1:2] == ["test"]:
            return None  # pytest's flags
        return ["bench", "--anchor", *argv[2:]] if argv[1:2] in ([], ["bench"]) else argv[1:]
    return argv[1:] if argv[0] == "specsplit" else None


def ours() -> list[tuple[str, list[str]]]:
    return [(page, cli) for page in PAGES for argv in commands(page) if (cli := as_cli(argv)) is not None]


def test_the_readme_is_a_page_not_a_notebook():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250, f"README.md is {len(lines)} lines: measurements belong in docs/benchmarks.md"
    assert lines[0] == "# specsplit"
    first_screens = "\n".join(lines[:60])
    assert "./run.sh bench" in first_screens and "./run.sh test" in first_screens


def test_the_pages_show_commands_of_every_kind():
    cli = {c[0] for _, c in ours()}
    assert {"bench", "up", "generate", "serve", "validate", "trace-report"} <= cli, cli


@pytest.mark.parametrize("page, argv", ours(), ids=lambda v: " ".join(v) if isinstance(v, list) else v)
def test_every_command_on_the_pages_parses_as_written(page, argv):
    from specsplit.cli import parser

    try:
        parser().parse_args(argv)
    except SystemExit as e:
        pytest.fail(f"{page}: `specsplit {' '.join(argv)}` is refused by the CLI (exit {e.code})")


def test_every_path_a_page_names_exists():
    missing = []
    for page in PAGES:
        text = (ROOT / page).read_text()
        for argv in commands(page):
            for arg in argv:
                if arg.startswith(("deploy/", "specsplit/", "docs/")) and not (ROOT / arg).exists():
                    missing.append(f"{page}: {arg}")
        for link in re.findall(r"\]\(((?:\.\./)?(?:docs|deploy|specsplit|protos)/[^)#]+)", text):
            if not (ROOT / Path(page).parent / link).resolve().exists():
                missing.append(f"{page}: link {link}")
    assert not missing, missing


def test_the_readme_python_compiles():
    for block in blocks((ROOT / "README.md").read_text(), "python"):
        compile(block, "README.md", "exec")


def test_models_runs_as_written(capsys):
    from specsplit.cli import main

    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "qwen2.5-coder-1.5b-instruct" in out
    # the shipped heads, by target: the default's and the 1.5B's; none for the 0.5B
    heads = [line.strip().split(":")[1].split("(")[0].strip() for line in out.splitlines() if "feature head:" in line]
    assert heads == ["shipped", "shipped", "none shipped"]
