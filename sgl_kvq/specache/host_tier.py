"""SpeCache's host tier: the 16-bit K/V of every token the pool holds, per layer, in host RAM.

    hk[layer], hv[layer]   [S, H, D] model dtype (16-bit for a bf16/fp16 model), S = the pool's token slots

indexed by pool token slot exactly like the packed base (sgl_kvq/layout.py). So a radix page shared by many
requests has one host copy; a freed slot's rows are overwritten when SGLang reuses the slot (there is nothing to
free and nothing grows); the size is fixed, and checked against the host's RAM at startup.

Written wherever the pool writes (every extend token, every real decode token; never the speculative lane's).
Read by the top-k prefetch (single-head rows, `prefetch`) and by an extend's cached prefix (whole rows, `rows`).
CPU: plain index ops, synchronous. CUDA: pinned memory reached from kernels through UVA (kernels/host_rows.py);
writes run on a device-to-host side stream, prefetches on a copy stream that records one event per layer, and
`wait(layer)` makes the compute stream wait for that layer's copy only.
"""

from __future__ import annotations

import time

import torch

from sgl_kvq.config import KVQConfigError


def scatter_rows_ref(k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, hk: torch.Tensor,
                     hv: torch.Tensor) -> None:
    """Torch reference of kernels/host_rows.scatter_rows: hk[slots[t]] = k[t] (all heads)."""
    s = slots.to(hk.device).long()
    hk[s] = k.to(hk.device, hk.dtype)
    hv[s] = v.to(hv.device, hv.dtype)


def gather_head_rows_ref(hk: torch.Tensor, hv: torch.Tensor, slots: torch.Tensor, heads: torch.Tensor,
                         out_k: torch.Tensor, out_v: torch.Tensor, out_rows: torch.Tensor) -> None:
    """Torch reference of kernels/host_rows.gather_head_rows: out_k[out_rows[n]] = hk[slots[n], heads[n]], a zero
    row where slots[n] < 0."""
    s, h = slots.to(hk.device).long(), heads.to(hk.device).long()
    ok = (s >= 0)[:, None]
    s = s.clamp(min=0)
    rows = out_rows.to(out_k.device).long()
    out_k[rows] = (hk[s, h] * ok).to(out_k.device, out_k.dtype)
    out_v[rows] = (hv[s, h] * ok).to(out_v.device, out_v.dtype)


def host_bytes_per_token(layers: int, heads: int, head_dim: int, dtype: torch.dtype) -> int:
    return 2 * layers * heads * head_dim * torch.empty((), dtype=dtype).element_size()


def available_host_bytes() -> int:
    """MemAvailable from /proc/meminfo (what the kernel can hand out without swapping)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("sgl_kvq: /proc/meminfo has no MemAvailable")


def check_host_budget(name: str, tokens: int, bytes_per_token: int, fraction: float,
                      available: int | None = None) -> None:
    """Refuse, before allocating, a host tier larger than `fraction` of the host's available RAM."""
    available = available_host_bytes() if available is None else available
    need, allowed = tokens * bytes_per_token, int(available * fraction)
    if need > allowed:
        fit = allowed // bytes_per_token
        raise KVQConfigError(
            f"sgl_kvq: {name} keeps the 16-bit K/V of all {tokens} pool tokens in host RAM: {need / 2**30:.2f} GiB "
            f"needed, {allowed / 2**30:.2f} GiB allowed ({fraction:.0%} of {available / 2**30:.2f} GiB available). "
            f"Serve at most {fit} tokens (--max-total-tokens {fit}), or raise KVQ_HOST_MEM_FRACTION")


class HostTier:
    def __init__(self, layers: int, slots: int, heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        shape = (layers, slots, heads, head_dim)
        self.hk = torch.zeros(shape, dtype=dtype, pin_memory=self.cuda)
        self.hv = torch.zeros(shape, dtype=dtype, pin_memory=self.cuda)
        self.copy_seconds = 0.0  # time spent in prefetch copies (CUDA: from events, collected as they complete)
        if self.cuda:
            self.d2h = torch.cuda.Stream(self.device)
            self.h2d = torch.cuda.Stream(self.device)
            self.ready = [torch.cuda.Event() for _ in range(layers)]
            self.copy_start = [torch.cuda.Event(enable_timing=True) for _ in range(layers)]
            self.copy_end = [torch.cuda.Event(enable_timing=True) for _ in range(layers)]
            self.timing = [False] * layers  # copy_start/end of the layer hold a copy not yet counted

    def nbytes(self) -> int:
        return 2 * self.hk.numel() * self.hk.element_size()

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """The rows a batch writes into the pool at token slots `slots` [T]; k, v [T, H, D]."""
        if not self.cuda:
            scatter_rows_ref(k, v, slots, self.hk[layer], self.hv[layer])
            return
        from sgl_kvq.kernels.host_rows import scatter_rows

        self.d2h.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.d2h):
            scatter_rows(k, v, slots, self.hk[layer], self.hv[layer])
        for t in (k, v, slots):
            t.record_stream(self.d2h)

    def rows(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Whole rows [N, H, D] of token slots `slots` [N], on the compute device (an extend's cached prefix)."""
        if not self.cuda:
            s = slots.long()
            return self.hk[layer][s], self.hv[layer][s]
        from sgl_kvq.kernels.host_rows import gather_head_rows

        H, D = self.hk.shape[2], self.hk.shape[3]
        n = slots.numel()
        out_k = torch.empty(n * H, D, dtype=self.hk.dtype, device=self.device)
        out_v = torch.empty_like(out_k)
        torch.cuda.current_stream(self.device).wait_stream(self.d2h)  # rows this step just wrote
        heads = torch.arange(H, device=self.device).repeat(n)
        gather_head_rows(self.hk[layer], self.hv[layer], slots.repeat_interleave(H), heads, out_k, out_v)
        return out_k.view(n, H, D), out_v.view(n, H, D)

    def prefetch(self, layer: int, slots: torch.Tensor, heads: torch.Tensor, out_k: torch.Tensor,
                 out_v: torch.Tensor, out_rows: torch.Tensor) -> None:
        """out_k[out_rows[n]] = hk[layer, slots[n], heads[n]] (0 where slots[n] < 0): the next step's top-k rows
        of `layer`. On CUDA it runs on the copy stream and is awaited by wait(layer)."""
        if not self.cuda:
            t0 = time.perf_counter()
            gather_head_rows_ref(self.hk[layer], self.hv[layer], slots, heads, out_k, out_v, out_rows)
            self.copy_seconds += time.perf_counter() - t0
            return
        from sgl_kvq.kernels.host_rows import gather_head_rows

        self.h2d.wait_stream(torch.cuda.current_stream(self.device))  # the top-k indices, and the last readers
        self.h2d.wait_stream(self.d2h)  # rows written by earlier steps
        if self.timing[layer] and self.copy_end[layer].query():  # count the previous copy (no sync)
            self.copy_seconds += self.copy_start[layer].elapsed_time(self.copy_end[layer]) / 1e3
        self.timing[layer] = True
        with torch.cuda.stream(self.h2d):
            self.copy_start[layer].record()
            gather_head_rows(self.hk[layer], self.hv[layer], slots, heads, out_k, out_v, out_rows)
            self.copy_end[layer].record()
            self.ready[layer].record()

    def fence(self) -> None:
        """Make the compute stream wait for every prefetch still copying (CPU: they are done)."""
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self.h2d)

    def wait(self, layer: int) -> None:
        """Make the compute stream wait for `layer`'s last prefetch (CPU: it is already done)."""
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(self.ready[layer])
