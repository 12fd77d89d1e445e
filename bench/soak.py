"""The soak: bounded concurrent multi-turn conversations against one running server for a fixed time, on a KV
budget small enough that the radix tree evicts and the scheduler retracts, with the traffic a public endpoint
gets mixed in: streaming clients that disconnect mid-answer, explicit /abort_request, malformed requests.

Afterwards: every completed turn is replayed one at a time on the idle server (uncontended) and its tokens
compared; the pool's live counts (patches/observability.py live_counts) after /flush_cache are compared with
their values at startup; the server processes' resident memory is sampled throughout. `sgl-kvq bench soak`
runs it per dtype and mode; tests/engine/test_soak.py runs a short one.
"""

from __future__ import annotations

import random
import re
import threading
import time
from dataclasses import dataclass, field

import requests

# Each conversation: a shared system prefix (radix hits across clients), then turns of 24-72 user tokens and
# 8-48 new tokens, until it is longer than MAX_CONVERSATION tokens; then a new conversation starts.
SYSTEM_TOKENS = 96
USER_TOKENS = (24, 72)
NEW_TOKENS = (8, 48)
MAX_CONVERSATION = 640

# What a client does on each step (weights). A turn is a non-streaming /generate whose tokens are recorded for the
# replay; the others exercise the paths that end a request early.
ACTIONS = {"turn": 60, "stream_disconnect": 12, "stream": 8, "abort": 8, "malformed": 12}

# Requests SGLang must refuse with a 4xx and survive. Each is (name, path, body); over-long prompts are built from
# the server's context length at run time.
def malformed_requests(context_len: int) -> list[tuple[str, str, object]]:
    long_ids = [11] * (context_len + 16)
    return [
        ("negative temperature", "/generate", {"text": "hi", "sampling_params": {"temperature": -1.0}}),
        ("top_p over 1", "/generate", {"text": "hi", "sampling_params": {"top_p": 2.0}}),
        ("negative max_new_tokens", "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": -5}}),
        ("top_k zero", "/generate", {"text": "hi", "sampling_params": {"top_k": 0}}),
        ("text of wrong type", "/generate", {"text": 12345, "sampling_params": {"max_new_tokens": 4}}),
        ("sampling_params of wrong type", "/generate", {"text": "hi", "sampling_params": "greedy"}),
        ("input_ids of wrong type", "/generate", {"input_ids": "not ids", "sampling_params": {"max_new_tokens": 4}}),
        ("empty input_ids", "/generate", {"input_ids": [], "sampling_params": {"max_new_tokens": 4}}),
        ("over-long prompt", "/generate", {"input_ids": long_ids, "sampling_params": {"max_new_tokens": 4}}),
        ("body not JSON", "/generate", "{not json"),
        ("chat: empty messages", "/v1/chat/completions", {"model": "m", "messages": []}),
        ("chat: negative max_tokens", "/v1/chat/completions",
         {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}),
        ("completion: over-long prompt", "/v1/completions", {"model": "m", "prompt": long_ids, "max_tokens": 4}),
    ]


def draw(rng: random.Random, vocab: int, n: int) -> list[int]:
    """n token ids from the upper vocabulary: no special tokens (the low ids), and ignore_eos covers the rest."""
    return [rng.randrange(min(1000, vocab // 4), vocab) for _ in range(n)]


@dataclass
class Tally:
    """What the clients saw. Shared by the client threads (append/+= under the lock)."""
    # completed turns: input_ids, max_new_tokens, ignore_eos, output_ids
    turns: list[dict] = field(default_factory=list)
    counts: dict = field(default_factory=lambda: {k: 0 for k in (
        "turns", "streams", "stream_disconnects", "aborts_sent", "aborted", "malformed", "malformed_4xx",
        "server_errors", "client_errors")})
    errors: list[str] = field(default_factory=list)  # 5xx / unexpected answers, first lines
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, key: str, n: int = 1) -> None:
        with self.lock:
            self.counts[key] += n

    def error(self, key: str, what: str) -> None:
        with self.lock:
            self.counts[key] += 1
            if len(self.errors) < 50:
                self.errors.append(what[:300])


def generate(base: str, input_ids: list[int], max_new_tokens: int, timeout: float = 900, ignore_eos: bool = True,
             **extra) -> requests.Response:
    return requests.post(base + "/generate", timeout=timeout, json={
        "input_ids": input_ids, **extra,
        "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": ignore_eos}})


class Client:
    """One simulated user: multi-turn conversations, greedy, from its own seed."""

    def __init__(self, base: str, vocab: int, system: list[int], context_len: int, seed: int, tally: Tally,
                 max_conversation: int = MAX_CONVERSATION, new_tokens: tuple[int, int] = NEW_TOKENS,
                 ignore_eos: bool = True):
        self.base, self.vocab, self.system, self.tally = base, vocab, system, tally
        self.max_conversation, self.new_tokens, self.ignore_eos = max_conversation, new_tokens, ignore_eos
        self.rng = random.Random(seed)
        self.seed = seed
        self.bad_requests = malformed_requests(context_len)
        self.conversation = list(system)
        self.n = 0

    def _user_turn(self) -> tuple[list[int], int]:
        if len(self.conversation) > self.max_conversation:
            self.conversation = list(self.system)
        user = draw(self.rng, self.vocab, self.rng.randint(*USER_TOKENS))
        return self.conversation + user, self.rng.randint(*self.new_tokens)

    def step(self) -> None:
        action = self.rng.choices(list(ACTIONS), weights=list(ACTIONS.values()))[0]
        getattr(self, action)()

    def turn(self) -> None:
        ids, new = self._user_turn()
        r = generate(self.base, ids, new, ignore_eos=self.ignore_eos)
        if r.status_code != 200:
            return self.tally.error("server_errors" if r.status_code >= 500 else "client_errors",
                                    f"turn: {r.status_code} {r.text[:200]}")
        out = r.json()
        reason, n = out["meta_info"]["finish_reason"]["type"], len(out["output_ids"])
        if not (reason == "length" and n == new or reason == "stop" and not self.ignore_eos and n <= new):
            return self.tally.error("server_errors", f"turn finished {out['meta_info']['finish_reason']} after "
                                                     f"{len(out['output_ids'])} of {new} tokens")
        self.conversation = ids + out["output_ids"]
        with self.tally.lock:
            self.tally.turns.append({"input_ids": ids, "max_new_tokens": new, "ignore_eos": self.ignore_eos,
                                     "output_ids": out["output_ids"]})
            self.tally.counts["turns"] += 1

    def _stream(self, chunks: int | None) -> None:
        ids, new = self._user_turn()
        with requests.post(self.base + "/generate", stream=True, timeout=900, json={
                "input_ids": ids, "stream": True,
                "sampling_params": {"temperature": 0, "max_new_tokens": new + 32,
                                    "ignore_eos": self.ignore_eos}}) as r:
            if r.status_code != 200:
                return self.tally.error("server_errors" if r.status_code >= 500 else "client_errors",
                                        f"stream: {r.status_code}")
            seen = 0
            for line in r.iter_lines():
                if line.startswith(b"data:") and line.strip() != b"data: [DONE]":
                    seen += 1
                    if chunks is not None and seen >= chunks:
                        break  # closing the response drops the connection mid-answer
        self.tally.add("streams" if chunks is None else "stream_disconnects")

    def stream(self) -> None:
        self._stream(None)

    def stream_disconnect(self) -> None:
        self._stream(self.rng.randint(1, 4))

    def abort(self) -> None:
        ids, new = self._user_turn()
        rid = f"soak-{self.seed}-{self.n}"
        self.n += 1
        box: dict = {}
        t = threading.Thread(target=lambda: box.update(r=generate(self.base, ids, new + 64, rid=rid,
                                                                      ignore_eos=self.ignore_eos)))
        t.start()
        time.sleep(self.rng.uniform(0.05, 1.0))
        a = requests.post(self.base + "/abort_request", json={"rid": rid}, timeout=60)
        self.tally.add("aborts_sent")
        if a.status_code != 200:
            self.tally.error("server_errors", f"abort_request: {a.status_code} {a.text[:200]}")
        t.join()
        r = box.get("r")
        if r is None or r.status_code >= 500:
            return self.tally.error("server_errors", f"aborted request: {None if r is None else r.status_code}")
        if r.status_code == 200 and r.json()["meta_info"]["finish_reason"]["type"] == "abort":
            self.tally.add("aborted")

    def malformed_request(self, name: str, path: str, body) -> requests.Response:
        if isinstance(body, str):
            return requests.post(self.base + path, data=body, headers={"Content-Type": "application/json"},
                                 timeout=120)
        return requests.post(self.base + path, json=body, timeout=120)

    def malformed(self, which: int | None = None) -> None:
        name, path, body = self.bad_requests[self.rng.randrange(len(self.bad_requests)) if which is None else which]
        r = self.malformed_request(name, path, body)
        self.tally.add("malformed")
        if 400 <= r.status_code < 500:
            self.tally.add("malformed_4xx")
        else:
            self.tally.error("server_errors" if r.status_code >= 500 else "client_errors",
                             f"malformed '{name}': {r.status_code} {r.text[:200]}")


def process_role(cmdline: list[str]) -> str:
    """A server child process's role from its title: SGLang titles its children (sglang::scheduler_TP0,
    sglang::detokenizer); an untitled child (multiprocessing's resource tracker) is "other"."""
    first = cmdline[0] if cmdline else ""
    return first.removeprefix("sglang::") if first.startswith("sglang::") else "other"


def rss_by_process(pid: int) -> dict[str, int]:
    """Resident memory of a server process and each of its children, by role: the launcher, which runs the HTTP
    server and the tokenizer manager, is "tokenizer_manager"; its children are named by process_role."""
    import psutil

    try:
        proc = psutil.Process(pid)
        procs = [proc, *proc.children(recursive=True)]
    except psutil.NoSuchProcess:
        return {}
    out: dict[str, int] = {}
    for p in procs:
        try:
            role = "tokenizer_manager" if p.pid == pid else process_role(p.cmdline())
            out[role] = out.get(role, 0) + p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return out


def rss_bytes(pid: int) -> int:
    """Resident memory of a server process and all its children (tokenizer, scheduler, detokenizer)."""
    return sum(rss_by_process(pid).values())


def live(server) -> dict:
    return server.kv_pool_stats()["live"]


def flush_when_idle(server, timeout: float = 300) -> dict:
    """/flush_cache once no request runs or waits, in SGLang's queues or a PD server's (/flush_cache refuses while
    any does), then the live counts."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        r = requests.post(server.base + "/flush_cache", timeout=60)
        if r.status_code == 200:
            counts = live(server)
            if counts["running_requests"] == 0 and counts["waiting_requests"] == 0 \
                    and not counts.get("pd_queued_requests"):
                return counts
        time.sleep(1.0)
    raise TimeoutError(f"/flush_cache still refused after {timeout} s: {live(server)}")


def metrics(base: str) -> dict:
    """SGLang's cumulative eviction and retraction counters (--enable-metrics)."""
    text = requests.get(base + "/metrics", timeout=60).text
    out = {}
    for key, name in (("evicted_tokens", "sglang:evicted_tokens_total"),
                      ("retracted_requests", "sglang:num_retracted_requests_total")):
        out[key] = int(sum(float(v) for v in re.findall(rf"^{re.escape(name)}{{[^}}]*}} ([0-9.eE+-]+)$", text,
                                                        flags=re.M)))
    return out


def kv_full_retractions(text: str) -> int:
    """Requests retracted because the pool was full (not SGLANG_TEST_RETRACT's forced ones), from the server log."""
    return sum(int(n) for n in re.findall(r"KV cache pool is full\. Retract requests\. #retracted_reqs: (\d+)", text))


def server_log_errors(text: str) -> list[str]:
    """Exceptions and errors in a server log: tracebacks and ERROR lines."""
    return [ln.strip()[:300] for ln in text.splitlines() if "Traceback" in ln or re.search(r"\bERROR\b", ln)]


def run_load(server, tokenizer_vocab: int, context_len: int, clients: int, seconds: float, max_total_tokens: int,
             seed: int = 0, rss_every: float = 2.0, new_tokens: tuple[int, int] = NEW_TOKENS,
             max_conversation: int = MAX_CONVERSATION,
             ignore_eos: bool = True) -> tuple[Tally, list[tuple[float, int]], dict[str, list[tuple[float, int]]]]:
    """`clients` threads stepping until `seconds` pass (a step started before then completes); the first client
    sends every malformed request once first, so each is seen under load. -> the tally, the RSS curve
    [(seconds since start, bytes)] of all the server's processes and one such curve per process role."""
    rng = random.Random(seed)
    system = draw(rng, tokenizer_vocab, SYSTEM_TOKENS)
    tally = Tally()
    t0 = time.time()
    stop = threading.Event()
    curve: list[tuple[float, int]] = []
    by_role: dict[str, list[tuple[float, int]]] = {}

    def take_sample():
        t, roles = round(time.time() - t0, 1), rss_by_process(server.proc.pid)
        curve.append((t, sum(roles.values())))
        for role, b in roles.items():
            by_role.setdefault(role, []).append((t, b))

    def sample():
        while not stop.is_set():
            take_sample()
            stop.wait(rss_every)

    def loop(c: Client, first: bool):
        steps = [lambda i=i: c.malformed(i) for i in range(len(c.bad_requests))] if first else []
        while time.time() - t0 < seconds:
            try:
                steps.pop(0)() if steps else c.step()
            except requests.RequestException as e:  # the server went away or hung past the timeouts
                tally.error("server_errors", f"{type(e).__name__}: {e}")
                if server.proc.poll() is not None:
                    return
            except Exception as e:  # an answer the client could not read: the soak's finding, not a crash of it
                tally.error("client_errors", f"{type(e).__name__}: {e}")

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    # a conversation is restarted once longer than half the budget: two requests always fit together
    longest = min(max_conversation, max_total_tokens // 2 - USER_TOKENS[1] - new_tokens[1])
    threads = [threading.Thread(target=loop, args=(Client(server.base, tokenizer_vocab, system, context_len,
                                                          seed * 1000 + i, tally, longest, new_tokens,
                                                          ignore_eos), i == 0))
               for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    sampler.join()
    take_sample()
    return tally, curve, by_role


def replay(base: str, turns: list[dict]) -> dict:
    """Every completed turn again, one at a time (nothing else runs): {turns, identical, differing, agreement}
    where agreement is the mean fraction of each turn's tokens before its first difference."""
    same, fractions, differing = 0, [], []
    for i, t in enumerate(turns):
        r = generate(base, t["input_ids"], t["max_new_tokens"], ignore_eos=t.get("ignore_eos", True))
        r.raise_for_status()
        out = r.json()["output_ids"]
        n = next((i for i, (a, b) in enumerate(zip(out, t["output_ids"])) if a != b), min(len(out),
                                                                                        len(t["output_ids"])))
        same += out == t["output_ids"]
        fractions.append(n / max(len(t["output_ids"]), 1))
        if out != t["output_ids"]:
            differing.append({"turn": i, "prompt_tokens": len(t["input_ids"]), "first_difference": n,
                              "new_tokens": len(t["output_ids"])})
    return {"turns": len(turns), "identical": same, "differing": differing,
            "agreement": round(sum(fractions) / len(fractions), 4) if fractions else None}


def rss_growth(curve: list[tuple[float, int]], warmup_fraction: float = 0.25) -> dict:
    """Resident memory after warm-up: the first sample past `warmup_fraction` of the run vs the last, and the
    least-squares slope over every sample past it (MiB per hour): an end-minus-start difference cannot tell a slow
    leak from allocator caches settling, a slope over three quarters of a long run can."""
    if len(curve) < 2:
        return {"after_warmup_mib": None, "end_mib": None, "growth_mib": None, "slope_mib_per_hour": None}
    end_t = curve[-1][0]
    after = [(t, b) for t, b in curve if t >= warmup_fraction * end_t]
    start, peak = after[0][1], max(b for _, b in after)
    mib = 2 ** 20
    return {"after_warmup_mib": round(start / mib, 1), "end_mib": round(curve[-1][1] / mib, 1),
            "peak_after_warmup_mib": round(peak / mib, 1), "growth_mib": round((curve[-1][1] - start) / mib, 1),
            "slope_mib_per_hour": rss_slope_mib_per_hour(after)}


def rss_slope_mib_per_hour(samples: list[tuple[float, int]]) -> float | None:
    """Least-squares slope of (seconds, bytes) samples, in MiB per hour; None for fewer than two distinct times."""
    n = len(samples)
    mean_t = sum(t for t, _ in samples) / n
    mean_b = sum(b for _, b in samples) / n
    var_t = sum((t - mean_t) ** 2 for t, _ in samples)
    if n < 2 or var_t == 0:
        return None
    slope = sum((t - mean_t) * (b - mean_b) for t, b in samples) / var_t  # bytes per second
    return round(slope * 3600 / 2 ** 20, 1)
