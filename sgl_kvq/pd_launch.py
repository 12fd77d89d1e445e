"""A prefill server and a decode server over SGLang's mooncake transfer, and the routing a PD router does.

SGLang's PD router (sglang-router, `--pd-disaggregation`) sends each request to both servers with the prefill
server's bootstrap host and port and a random bootstrap room; the prefill server computes the prompt and sends its
KV to the decode server through the transfer engine, the decode server continues from it and answers. `route()` does
the same with two HTTP posts. `mooncake_tcp` is SGLang's mooncake backend with the TCP transport forced
(MC_FORCE_TCP=1): the only one that runs without RDMA hardware, loopback included.
"""

from __future__ import annotations

import random
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

from sgl_kvq.launch import ServerProcess, free_port

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
    """launch_server ARGS for one side of a PD pair."""
    argv = list(args) + ["--disaggregation-mode", mode, "--disaggregation-transfer-backend", "mooncake_tcp"]
    if mode == "prefill":
        argv += ["--disaggregation-bootstrap-port", str(bootstrap_port)]
    return argv


class PDPair:
    """Both servers (`sgl-kvq serve ARGS` each, on 127.0.0.1), started together. Use as a context manager."""

    def __init__(self, args: list[str], log_dir: str | Path | None = None, startup_timeout: float = 900):
        self.bootstrap_port = free_port()
        logs = {m: (Path(log_dir) / f"{m}.log" if log_dir else None) for m in ("prefill", "decode")}
        self.prefill = ServerProcess(pd_argv(args, "prefill", self.bootstrap_port), logs["prefill"], startup_timeout)
        self.decode = ServerProcess(pd_argv(args, "decode", self.bootstrap_port), logs["decode"], startup_timeout)
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
