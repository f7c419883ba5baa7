"""The launcher's services die with it, even when it is killed with SIGKILL (no cleanup code runs)."""

from __future__ import annotations

import os
import signal
import subprocess

from conftest import spawn_up, wait_for


def _services(run_dir) -> list[str]:
    return subprocess.run(["pgrep", "-f", "--", f"--address-file {run_dir}"], capture_output=True,
                          text=True).stdout.split()


def test_services_exit_when_the_launcher_is_killed(models, tmp_path):
    up, _ = spawn_up(tmp_path, ["--target-model", str(models["target"]), "--self-head", "none", "--drafter",
                                "ngram", "--dtype", "float32"])
    try:
        assert len(_services(tmp_path)) == 3
        os.kill(up.pid, signal.SIGKILL)
        up.wait(10)
        wait_for(lambda: not _services(tmp_path), "the services exiting after their launcher was killed", 30)
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
