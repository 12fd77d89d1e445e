"""sgl_kvq/tools/launch.py's process groups: a server started through start_process_group does not outlive the process
that started it, whether that process exits or is sent SIGTERM (a killed benchmark or test run)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

# The parent starts a child that would run for 5 minutes, prints its pid, and exits when told (a line on its stdin)
# or waits to be killed.
PARENT = """
import sys, time
from sgl_kvq.tools.launch import start_process_group
child = start_process_group([sys.executable, "-c", "import time; time.sleep(300)"])
print(child.pid, flush=True)
if sys.argv[1] == "exit":
    sys.stdin.readline()
    sys.exit(0)
time.sleep(300)
"""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (reaped by init only later) counts as gone
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


def wait_gone(pid: int, seconds: float = 10) -> bool:
    deadline = time.time() + seconds
    while time.time() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("how", ["sigterm", "exit"])
def test_started_group_stops_with_its_parent(how):
    parent = subprocess.Popen([sys.executable, "-c", PARENT, how], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    child = int(parent.stdout.readline())
    try:
        assert alive(child)
        if how == "sigterm":
            parent.send_signal(signal.SIGTERM)
        else:
            parent.stdin.write("exit\n")
            parent.stdin.flush()
        assert parent.wait(timeout=30) == (-signal.SIGTERM if how == "sigterm" else 0)
        assert wait_gone(child), f"child {child} outlived its parent ({how})"
    finally:
        for pid in (child, parent.pid):
            try:
                os.killpg(pid, signal.SIGKILL) if pid == child else os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
