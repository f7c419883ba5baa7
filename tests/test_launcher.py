"""The launcher's services die with it, even when it is killed with SIGKILL (no cleanup code runs)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time


def _services(run_dir) -> list[str]:
    return subprocess.run(["pgrep", "-f", "--", f"--address-file {run_dir}"], capture_output=True,
                          text=True).stdout.split()


def test_services_exit_when_the_launcher_is_killed(models, tmp_path):
    up = subprocess.Popen([sys.executable, "-m", "specsplit.cli", "up", "--run-dir", str(tmp_path),
                           "--target-model", str(models["target"]), "--self-head", "none", "--drafter", "ngram",
                           "--dtype", "float32"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = up.stdout.readline()
        assert line.startswith("gateway: "), (line, up.stderr.read() if up.poll() is not None else "")
        assert len(_services(tmp_path)) == 3
        os.kill(up.pid, signal.SIGKILL)
        up.wait(10)
        deadline = time.monotonic() + 30
        while _services(tmp_path) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _services(tmp_path) == []
    finally:
        if up.poll() is None:
            up.kill()
        for pid in _services(tmp_path):
            os.kill(int(pid), signal.SIGKILL)


def test_services_spin_briefly_unless_the_user_chose_otherwise():
    from specsplit.cli.serve import SERVICE_SPINCOUNT, quiet_spin

    env: dict[str, str] = {}
    quiet_spin(env)
    assert env == {"GOMP_SPINCOUNT": SERVICE_SPINCOUNT}
    for chosen in ({"GOMP_SPINCOUNT": "300000"}, {"OMP_WAIT_POLICY": "ACTIVE"}):
        env = dict(chosen)
        quiet_spin(env)
        assert env == chosen
