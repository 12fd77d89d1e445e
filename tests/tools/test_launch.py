"""bench/launch.py's process groups: a server started through start_process_group does not outlive the process
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
from bench.launch import start_process_group
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


# A stand-in for `sgl-kvq serve`: it binds --port only after a while, as SGLang does after loading the model, and
# answers every GET with its pid.
FAKE_SERVER = """
import http.server, json, os, sys, time
port = int(sys.argv[sys.argv.index("--port") + 1])
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"pid": os.getpid()}).encode()
        self.send_response(200)
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
time.sleep(1.0)
http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


def test_server_process_does_not_take_another_servers_answer_for_its_own(tmp_path):
    """Two servers that picked the same port: the one that binds it first answers the other's health check, which
    must not be taken for its own server's (seen in CI: one test then read another test's radix cache)."""
    import http.server
    import threading

    from bench.launch import ServerProcess, free_port, group_listens_on

    class Stranger(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b'{"pid": "stranger"}')

        def log_message(self, *args):
            pass

    stranger = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Stranger)
    taken = stranger.server_address[1]
    threading.Thread(target=stranger.serve_forever, daemon=True).start()
    ports = iter([taken])

    class FakeServer(ServerProcess):
        command = [sys.executable, "-c", FAKE_SERVER]

        def _pick_port(self):
            self.port = next(ports, None) or free_port()
            self.base = f"http://127.0.0.1:{self.port}"

    try:
        with FakeServer([], log_path=tmp_path / "server.log", startup_timeout=60) as server:
            assert server.port != taken
            assert server.get("/health_generate") == {"pid": server.proc.pid}
            assert group_listens_on(server.proc.pid, server.port)
            assert not group_listens_on(server.proc.pid, taken)
    finally:
        stranger.shutdown()


def test_log_path_takes_a_dtype_entry_that_names_a_recipe_file(tmp_path):
    """A dtype entry may carry a recipe file's path (kivimix:KVQ_RECIPE=/x/r.json): its log is one file in the
    folder, which the server can open."""
    from bench.launch import run_file

    p = run_file(tmp_path, "server", "tight", "kivimix:KVQ_RECIPE=/tmp/q/r.json:KVQ_ROTATE=none", "default")
    assert p.parent == tmp_path
    assert p.name == "server-tight-kivimix:KVQ_RECIPE=_tmp_q_r.json:KVQ_ROTATE=none-default.log"
    p.write_text("ok")
    assert run_file(tmp_path, "kivi2").name == "kivi2.log"
