"""Starting SGLang the same way on a laptop and on a GPU box: Engine kwargs, launch_server argv, a server process.

Without a GPU the CPU engine settings (sgl_kvq/cpu_engine.py) are added; with one, nothing is added. A kvq dtype
picks its own attention backend and page size (patches/resolution.py); a bf16 baseline gets the same page size so
both report prefix hits in the same whole pages. With more than one rank (--tp-size, --dp-size) on the CPU engine
the OpenMP thread binding SGLang needs is chosen here unless the user set SGLANG_CPU_OMP_THREADS_BIND (then it is
checked: cpu_engine.apply_threads_bind).
"""

from __future__ import annotations

import atexit
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from sgl_kvq.config import is_kvq_dtype, parse_kv_cache_dtype


def run_file(folder, *parts: str, suffix: str = ".log") -> Path:
    """folder / "<parts joined by -><suffix>", every character a file name cannot hold as "_": a run's log or
    output named by its dtype entry, which may name a recipe file (kivimix:KVQ_RECIPE=/path/r.json)."""
    return Path(folder) / (re.sub(r"[^A-Za-z0-9._=:,+-]", "_", "-".join(parts)) + suffix)


def has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def baseline_page_size() -> int:
    """The page size a bf16 run uses to be comparable with kvq runs (the kvq group size G)."""
    return parse_kv_cache_dtype("kivi2").group_size


def engine_kwargs(model_path, kv_cache_dtype: str = "auto", **overrides) -> dict:
    kw: dict = {"model_path": str(model_path), "log_level": "warning"}
    if is_kvq_dtype(kv_cache_dtype):
        kw["kv_cache_dtype"] = kv_cache_dtype
    else:
        kw["page_size"] = baseline_page_size()
        if kv_cache_dtype not in (None, "auto"):
            kw["kv_cache_dtype"] = kv_cache_dtype
    if not has_gpu():
        from sgl_kvq.cpu_engine import cpu_engine_env, engine_kwargs as cpu_kwargs

        cpu_engine_env()
        _bind_cpu_ranks({**kw, **overrides})
        cpu = cpu_kwargs(model_path)
        if is_kvq_dtype(kv_cache_dtype):
            cpu.pop("attention_backend")  # the kvq dtype picks kvq_torch
        cpu.update(kw)
        kw = cpu
    kw.update(overrides)
    return kw


def server_argv(args: list[str]) -> list[str]:
    """launch_server ARGS plus what the CPU engine needs when there is no GPU (unless ARGS already say)."""
    args = list(args)
    if has_gpu():
        return args
    from sgl_kvq.cpu_engine import cpu_engine_env

    cpu_engine_env()
    _bind_cpu_ranks({field: _arg_value(args, *flags) for field, flags in _RANK_FLAGS.items()})
    given = {a.split("=")[0] for a in args if a.startswith("--")}
    if "--device" not in given:
        args += ["--device", "cpu"]
    dtype = _arg_value(args, "--kv-cache-dtype")
    if "--attention-backend" not in given and not is_kvq_dtype(dtype):
        args += ["--attention-backend", "torch_native"]
    return args


# launch_server flags (with SGLang's aliases) that decide how many scheduler processes run and their gpu_ids.
_RANK_FLAGS = {
    "tp_size": ("--tp-size", "--tensor-parallel-size"),
    "dp_size": ("--dp-size", "--data-parallel-size"),
    "pp_size": ("--pp-size", "--pipeline-parallel-size"),
    "base_gpu_id": ("--base-gpu-id",),
    "gpu_id_step": ("--gpu-id-step",),
}


def _bind_cpu_ranks(kw: dict) -> None:
    """SGLANG_CPU_OMP_THREADS_BIND for the ranks these arguments start (cpu_engine.apply_threads_bind)."""
    from sgl_kvq.cpu_engine import apply_threads_bind, rank_ids

    try:
        ids = rank_ids(**{k: int(kw[k]) for k in _RANK_FLAGS if kw.get(k) is not None})
    except ValueError:
        return  # not a number: SGLang's own argument check reports it
    apply_threads_bind(ids)


def _arg_value(args: list[str], *flags: str):
    for i, a in enumerate(args):
        for flag in flags:
            if a == flag and i + 1 < len(args):
                return args[i + 1]
            if a.startswith(flag + "="):
                return a.split("=", 1)[1]
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def group_listens_on(pid: int, port: int) -> bool:
    """Whether process `pid` or one of its descendants listens on TCP `port`: an answer on a port picked by
    free_port may come from another process that picked the same port and bound it first."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return False
    for proc in procs:
        try:
            conns = proc.net_connections(kind="tcp")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in conns):
            return True
    return False


# Process groups this process started and has not stopped. They are stopped when it exits, and when it is sent
# SIGTERM (Python's default there runs no cleanup): a server group outlives its client otherwise, and an idle
# SGLang scheduler polls a core (seen: one at 80% of a core for half an hour after its soak client was killed).
_LIVE_GROUPS: set[int] = set()
_CLEANUP_INSTALLED = False


def _stop_live_groups() -> None:
    for pgid in list(_LIVE_GROUPS):
        try:
            os.killpg(pgid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass
    _LIVE_GROUPS.clear()


def _stop_live_groups_and_die(signum, frame) -> None:
    _stop_live_groups()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def start_process_group(argv: list[str], **popen_kwargs) -> subprocess.Popen:
    """Popen `argv` as the leader of a new process group (stop_process_group stops it and its children), stopped
    too if this process exits or is sent SIGTERM first."""
    global _CLEANUP_INSTALLED
    if not _CLEANUP_INSTALLED:
        atexit.register(_stop_live_groups)
        _CLEANUP_INSTALLED = True
    # signal handlers can only be set from the main thread (PD starts its two servers from worker threads) and a
    # handler the program set itself is kept
    if threading.current_thread() is threading.main_thread() \
            and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _stop_live_groups_and_die)
    proc = subprocess.Popen(argv, start_new_session=True, **popen_kwargs)
    _LIVE_GROUPS.add(proc.pid)
    return proc


def stop_process_group(proc: subprocess.Popen | None, grace: float) -> None:
    """SIGTERM a process started by start_process_group and its children; SIGKILL after `grace` seconds."""
    if proc and proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if proc:
        _LIVE_GROUPS.discard(proc.pid)


def post_json(url: str, payload: dict, timeout: float = 1800):
    req = urllib.request.Request(url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


class _PortTaken(Exception):
    pass


class ServerProcess:
    """`sgl-kvq serve ARGS` in a child process on 127.0.0.1, with a tiny HTTP client. Use as a context manager."""

    command = [sys.executable, "-m", "bench.cli", "serve"]

    def __init__(self, args: list[str], log_path: str | os.PathLike | None = None, startup_timeout: float = 600,
                 env: dict[str, str] | None = None):
        """env: variables set for this server beside this process's environment (e.g. a KVQ_* knob)."""
        self.args = list(args)
        self.env = env
        self.log_path = Path(log_path) if log_path else None
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen | None = None
        self._pick_port()

    def _pick_port(self) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "ServerProcess":
        # The port is free when picked but only bound after startup (minutes on a loaded machine): another process
        # may take it first. Then the HTTP server stops without exiting (seen in its log), and the other process
        # answers the health check meanwhile (seen in CI: two test workers' servers picked one port, and one test
        # read the other's radix cache). Either way: start again elsewhere.
        for attempt in range(3):
            try:
                return self._start()
            except _PortTaken:
                self.__exit__(None, None, None)
                self._pick_port()
        raise RuntimeError(f"server could not bind an HTTP port in 3 attempts{self._log_tail()}")

    def _start(self) -> "ServerProcess":
        log = open(self.log_path, "w") if self.log_path else subprocess.DEVNULL
        argv = self.args + ["--host", "127.0.0.1", "--port", str(self.port)]
        self.proc = start_process_group([*self.command, *argv], stdout=log, stderr=subprocess.STDOUT,
                                        env={**os.environ, **self.env} if self.env else None)
        deadline = time.time() + self.startup_timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} during startup{self._log_tail()}")
            try:
                if self.get("/health_generate", timeout=30) is not None:
                    if group_listens_on(self.proc.pid, self.port):
                        return self
                    raise _PortTaken()
            except OSError:
                if self._port_taken():
                    raise _PortTaken() from None
                time.sleep(1.0)
        self.__exit__(None, None, None)
        raise TimeoutError(f"server not healthy after {self.startup_timeout}s{self._log_tail()}")

    def _port_taken(self) -> bool:
        return bool(self.log_path and self.log_path.exists() and
                    f"address ('127.0.0.1', {self.port}): address already in use" in self.log_path.read_text(
                        errors="replace"))

    def _log_tail(self) -> str:
        if self.log_path and self.log_path.exists():
            return ":\n" + "\n".join(self.log_path.read_text(errors="replace").splitlines()[-30:])
        return ""

    def __exit__(self, *exc) -> None:
        stop_process_group(self.proc, grace=60)

    def get(self, path: str, timeout: float = 60):
        with urllib.request.urlopen(self.base + path, timeout=timeout) as r:
            body = r.read()
            return json.loads(body) if body.strip().startswith((b"{", b"[")) else body.decode()

    def post(self, path: str, payload: dict, timeout: float = 1800):
        return post_json(self.base + path, payload, timeout)

    def kv_pool_stats(self) -> dict:
        return self.get("/get_server_info")["internal_states"][0]["kv_pool"]
