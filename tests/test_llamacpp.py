"""`bench --anchor-llama-cpp DIR`'s llama-lookup anchor: a build's tool run per prompt, its summary
read, summed per task type and set beside our drafters' rates. CI has no llama.cpp build, so DIR
here holds a script that prints llama-lookup's summary lines as llama.cpp's build does (the lines
below are copied from a real run) and checks what it was asked."""

from __future__ import annotations

import stat
from types import SimpleNamespace

import pytest

from specsplit.bench import llamacpp
from specsplit.errors import UsageError

REAL_LOG = """\
0.01.573.159 I encoded   27 tokens in    0.175 seconds, speed:  359.751 t/s
0.01.573.206 I decoded   36 tokens in    0.471 seconds, speed:   76.510 t/s
0.01.573.278 I n_draft      = 3
0.01.573.314 I n_predict    = 36
0.01.573.350 I n_drafted    = 3
0.01.573.458 I n_accept     = 0
0.01.573.494 I accept       = 0.000%
"""


def test_llama_lookups_summary_is_read_as_it_prints_it():
    run = llamacpp.parse_lookup(REAL_LOG)
    assert (run.tokens, run.drafted, run.accepted) == (36, 3, 0)
    assert run.seconds == pytest.approx(0.175 + 0.471)
    with pytest.raises(RuntimeError, match="no summary"):
        llamacpp.parse_lookup("main: error: failed to load model\n")


def _fake_build(tmp_path, body: str):
    tool = tmp_path / "bin" / "llama-lookup"
    tool.parent.mkdir(parents=True)
    tool.write_text("#!/bin/sh\n" + body)
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    return str(tmp_path)


def test_lookups_are_summed_per_task_type_and_set_beside_each_drafter(tmp_path, capsys):
    # Greedy, no repacking, the budget asked: else it fails. Each prompt's text is echoed in the
    # token count (its length), so the sums show every prompt ran once with its own text.
    build = _fake_build(tmp_path, """
case "$*" in *"--temp 0 --no-repack"*) ;; *) exit 3 ;; esac
while [ $# -gt 0 ]; do case "$1" in -p) p="$2"; shift ;; -n) n="$2"; shift ;; esac; shift; done
[ "$n" = 64 ] || exit 4
echo "I encoded   5 tokens in    0.500 seconds, speed:  10.0 t/s" >&2
echo "I decoded   ${#p} tokens in    0.500 seconds, speed:  1.0 t/s" >&2
echo "I n_drafted    = 4" >&2
echo "I n_accept     = 1" >&2
""")
    prompts = [SimpleNamespace(prompt="ab", task_type="code"), SimpleNamespace(prompt="abcd", task_type="code"),
               SimpleNamespace(prompt="abcdef", task_type="open")]
    totals = llamacpp.lookup_by_task(build, tmp_path / "model.gguf", prompts, lambda text: f"<{text}>", 64)
    assert {k: (t.tokens, t.seconds, t.drafted, t.accepted) for k, t in totals.items()} == {
        "code": (4 + 6, 2.0, 8, 2), "open": (8, 1.0, 4, 1), "ALL": (18, 3.0, 12, 3)}
    rows = [{"drafter": "hybrid+tree8", "task_type": "code", "tok_s_on": 10.0},
            {"drafter": "hybrid+tree8", "task_type": "ALL", "tok_s_on": 12.0}]
    llamacpp.print_lookup(totals, rows)
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in out[2:]] == ["code", "open", "ALL"]
    code, open_, everything = (next(line for line in out if line.startswith(t)) for t in ("code", "open", "ALL"))
    assert code.split() == ["code", "5.0", "2/8", "10.0", "2.00x"]
    assert open_.split() == ["open", "8.0", "1/4", "-", "-"]  # no row of ours for it
    assert everything.split() == ["ALL", "6.0", "3/12", "12.0", "2.00x"]


def test_a_build_without_the_tool_or_a_failing_tool_says_so(tmp_path):
    with pytest.raises(UsageError, match="no bin/llama-lookup"):
        llamacpp.lookup(str(tmp_path), tmp_path / "model.gguf", "hi", 8)
    build = _fake_build(tmp_path, 'echo "main: error: unable to load model" >&2\nexit 1\n')
    with pytest.raises(RuntimeError, match="llama-lookup failed .1.: main: error: unable to load model"):
        llamacpp.lookup(build, tmp_path / "model.gguf", "hi", 8)


FAKE_SERVER = '''#!{python}
"""A llama-server stand-in: /health, and /v1/chat/completions answering as many tokens as the
prompt has characters (drafting 4 and accepting 1 when started with speculation); it appends its
arguments and every request body to LOG."""
import json, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
args = sys.argv[1:]
log = open({log!r}, "a")
log.write(json.dumps({{"args": args}}) + "\\n"); log.flush()
speculates = "-md" in args or "--spec-type" in args

class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass
    def _answer(self, body):
        data = json.dumps(body).encode()
        self.send_response(200); self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data))); self.end_headers(); self.wfile.write(data)
    def do_GET(self):
        self._answer({{"status": "ok"}})
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        log.write(json.dumps({{"body": body}}) + "\\n"); log.flush()
        text = body["messages"][0]["content"]
        self._answer({{"usage": {{"completion_tokens": min(len(text), body["max_tokens"])}},
                      "timings": {{"draft_n": 4 if speculates else 0, "draft_n_accepted": 1 if speculates else 0,
                                  "prompt_ms": 10.0 * len(text)}}}})

HTTPServer(("127.0.0.1", int(args[args.index("--port") + 1])), Handler).serve_forever()
'''


def _fake_server(tmp_path):
    import sys

    log = tmp_path / "server.log"
    tool = tmp_path / "bin" / "llama-server"
    tool.parent.mkdir(parents=True, exist_ok=True)
    tool.write_text(FAKE_SERVER.format(python=sys.executable, log=str(log)))
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    return str(tmp_path), log


@pytest.mark.parametrize("with_draft", [False, True])
def test_llama_server_runs_plain_and_with_its_speculation_over_its_openai_api(tmp_path, capsys, with_draft):
    import json

    from specsplit.bench import llamaserver

    build, log = _fake_server(tmp_path)
    target, draft = tmp_path / "model.gguf", tmp_path / "draft.gguf"
    target.write_bytes(b"GGUF")
    draft.write_bytes(b"GGUF")
    prompts = [SimpleNamespace(prompt="ab", task_type="code"), SimpleNamespace(prompt="abcd", task_type="code"),
               SimpleNamespace(prompt="abcdef", task_type="open")]
    served = llamaserver.run(build, target, draft if with_draft else None, prompts, 5)
    spec = "draft" if with_draft else "ngram-mod"
    assert list(served) == ["plain", spec]
    for mode in served.values():  # each prompt once, its own tokens (capped at the budget)
        assert {k: t.tokens for k, t in mode.items()} == {"code": 2 + 4, "open": 5, "ALL": 11}
    assert (served[spec]["ALL"].drafted, served[spec]["ALL"].accepted) == (12, 3)
    assert served["plain"]["ALL"].drafted == 0
    entries = [json.loads(line) for line in log.read_text().splitlines()]
    starts = [e["args"] for e in entries if "args" in e]
    assert len(starts) == 2 and "-md" not in starts[0] and "--spec-type" not in starts[0]
    assert (starts[1][starts[1].index("-md") + 1] == str(draft)) if with_draft else "ngram-mod" in starts[1]
    bodies = [e["body"] for e in entries if "body" in e]
    assert len(bodies) == 2 * (1 + len(prompts))  # a warm-up, then every prompt, per mode
    assert all(b["temperature"] == 0 and b["cache_prompt"] is False for b in bodies)
    assert served["plain"]["ALL"].prompt_ms == [20.0, 40.0, 60.0]  # the server's own prompt timing, per prompt
    rows = [{"drafter": "hybrid", "task_type": t, "tok_s_on": 20.0, "tok_s_off": 10.0, "prefill_ms_off": 20.0}
            for t in ("code", "ALL")]
    llamaserver.print_table(served, rows)
    out = capsys.readouterr().out
    assert "llama-server 40.0 ms, ours 20.0 ms (0.50x its time)" in out
    traffic_rows = [{k: v for k, v in r.items() if k != "prefill_ms_off"} for r in rows]  # bench --traffic's
    llamaserver.print_table(served, traffic_rows)
    out = capsys.readouterr().out
    assert "code" in out and "prompt processing, median" not in out
    assert [line.split()[0] for line in out.splitlines()[2:4]] == ["code", "open"]
    assert f"llama-server {spec}: 3/12 drafted tokens accepted" in out


def test_a_llama_server_that_dies_at_start_says_why(tmp_path):
    from specsplit.bench import llamaserver

    tool = tmp_path / "bin" / "llama-server"
    tool.parent.mkdir(parents=True)
    tool.write_text("#!/bin/sh\necho 'error: failed to load model' >&2\nexit 1\n")
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    with pytest.raises(RuntimeError, match="llama-server exited .1.: error: failed to load model"):
        llamaserver.run(str(tmp_path), tmp_path / "model.gguf", None, [SimpleNamespace(prompt="hi", task_type="x")], 4)
    with pytest.raises(UsageError, match="no bin/llama-server"):
        llamaserver.run(str(tmp_path / "none"), tmp_path / "model.gguf", None, [], 4)
