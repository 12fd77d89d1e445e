"""A prefill server and a decode server over SGLang's mooncake transfer, and the routing a PD router does.

SGLang's PD router (sglang-router, `--pd-disaggregation`) sends each request to both servers with the prefill
server's bootstrap host and port and a random bootstrap room; the prefill server computes the prompt and sends its
KV to the decode server through the transfer engine, the decode server continues from it and answers. `route()` does
the same with two HTTP posts. `mooncake_tcp` is SGLang's mooncake backend with the TCP transport forced
(MC_FORCE_TCP=1): the only one that runs without RDMA hardware, loopback included.
"""

from __future__ import annotations

import random
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

from bench.launch import (ServerProcess, free_port, group_listens_on, post_json, start_process_group,
                                  stop_process_group)

INSTALL_HINT = ("mooncake's transfer engine is missing: apt-get install -y libibverbs1 && pip install "
                "mooncake-transfer-engine-non-cuda==0.3.13.post1 msgpack (`make setup` installs both)")


def mooncake_available() -> str | None:
    """None when mooncake's transfer engine imports, else why not with how to install it."""
    try:
        from mooncake.engine import TransferEngine  # noqa: F401
    except (ImportError, OSError) as e:
        return f"{INSTALL_HINT} ({type(e).__name__}: {e})"
    return None


def pd_argv(args: list[str], mode: str, bootstrap_port: int) -> list[str]:
    """launch_server ARGS for one side of a PD pair. A decode server without a GPU keeps no retraction backup unless
    ARGS choose one: SGLang infers `host_pool` for its own pool, a HiCache host pool that pins memory with
    cudaHostRegister ("Torch not compiled with CUDA enabled"); kvq dtypes default to none anyway
    (patches/resolution.py)."""
    from bench.launch import has_gpu

    argv = list(args) + ["--disaggregation-mode", mode, "--disaggregation-transfer-backend", "mooncake_tcp"]
    if mode == "prefill":
        argv += ["--disaggregation-bootstrap-port", str(bootstrap_port)]
    elif not has_gpu() and not any(a.startswith("--disaggregation-decode-retraction-backup") for a in args):
        argv += ["--disaggregation-decode-retraction-backup", "none"]
    return argv


class PDPair:
    """Both servers (`sgl-kvq serve ARGS` each, on 127.0.0.1), started together. Use as a context manager."""

    def __init__(self, args: list[str], log_dir: str | Path | None = None, startup_timeout: float = 900,
                 env: dict[str, dict[str, str]] | None = None):
        """env: variables for one side ({"prefill": {...}, "decode": {...}}) beside this process's environment."""
        self.bootstrap_port = free_port()
        logs = {m: (Path(log_dir) / f"{m}.log" if log_dir else None) for m in ("prefill", "decode")}
        env = env or {}
        self.prefill = ServerProcess(pd_argv(args, "prefill", self.bootstrap_port), logs["prefill"], startup_timeout,
                                     env.get("prefill"))
        self.decode = ServerProcess(pd_argv(args, "decode", self.bootstrap_port), logs["decode"], startup_timeout,
                                    env.get("decode"))
        self._stack = ExitStack()

    def __enter__(self) -> "PDPair":
        # Both start at once: on a 2-core machine most of a start is waiting (tokenizer, warmup), not computing.
        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(s.__enter__) for s in (self.prefill, self.decode)]
        errors = [f.exception() for f in futures]
        for server, f in zip((self.prefill, self.decode), futures):
            if f.exception() is None:
                self._stack.push(server.__exit__)
        if any(errors):
            self._stack.close()
            raise next(e for e in errors if e)
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def generate(self, payload: dict, timeout: float = 1800) -> dict:
        return route(self.prefill, self.decode, self.bootstrap_port, payload, timeout)


def route(prefill: ServerProcess, decode: ServerProcess, bootstrap_port: int, payload: dict,
          timeout: float = 1800) -> dict:
    """POST /generate to both servers with the same bootstrap room, as SGLang's PD router does; -> the decode
    server's answer (the prefill server's carries the first token only)."""
    req = dict(payload, bootstrap_host="127.0.0.1", bootstrap_port=bootstrap_port,
               bootstrap_room=random.randrange(2**63))
    failure: list[BaseException] = []

    def to_prefill():
        try:
            prefill.post("/generate", req, timeout=timeout)
        except BaseException as e:  # noqa: BLE001 - reported below with the decode side's answer
            failure.append(e)

    t = threading.Thread(target=to_prefill)
    t.start()
    try:
        out = decode.post("/generate", req, timeout=timeout)
    finally:
        t.join()
    if failure:
        raise RuntimeError(f"the prefill server failed the request: {failure[0]}") from failure[0]
    return out


def router_available() -> bool:
    try:
        import sglang_router  # noqa: F401
    except ImportError:
        return False
    return True


class Router:
    """SGLang's PD router (sglang-router, `--pd-disaggregation`) in front of a PDPair, on 127.0.0.1. Use as a context
    manager; post() like ServerProcess.post. `args`: more launch_router flags (e.g. --disable-retries)."""

    def __init__(self, pair: PDPair, log_path: str | Path | None = None, startup_timeout: float = 300,
                 args: list[str] = ()):
        self.pair, self.log_path, self.startup_timeout, self.args = pair, log_path, startup_timeout, list(args)
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "Router":
        log = open(self.log_path, "w") if self.log_path else subprocess.DEVNULL
        self.proc = start_process_group(
            [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation", "--prefill",
             self.pair.prefill.base, str(self.pair.bootstrap_port), "--decode", self.pair.decode.base,
             "--host", "127.0.0.1", "--port", str(self.port), *self.args], stdout=log, stderr=subprocess.STDOUT)
        # /health answers as soon as the router listens, before it has activated its workers (a /generate then
        # gets 503 "No prefill workers available", seen in its log); /readiness waits for them.
        deadline = time.time() + self.startup_timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sglang-router exited with {self.proc.returncode} (log: {self.log_path})")
            try:
                with urllib.request.urlopen(self.base + "/readiness", timeout=10):
                    if group_listens_on(self.proc.pid, self.port):
                        return self
                    self.__exit__()
                    raise RuntimeError(f"another process answers on the router's port {self.port}: start it again")
            except OSError:
                time.sleep(1.0)
        self.__exit__()
        raise TimeoutError(f"sglang-router not healthy after {self.startup_timeout}s (log: {self.log_path})")

    def __exit__(self, *exc) -> None:
        stop_process_group(self.proc, grace=30)

    def post(self, path: str, payload: dict, timeout: float = 1800) -> dict:
        return post_json(self.base + path, payload, timeout)
