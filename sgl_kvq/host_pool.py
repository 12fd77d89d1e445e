"""HiCache's host tier for the packed pool: the same packed pages (codes, scales, zeros and every format's extras,
PoolShape.base_shapes) in host memory, behind SGLang's host-pool interface (sglang/srt/mem_cache/pool_host/base.py:
HostKVCache), so a page evicted from the device comes back bit-exact and the host tier holds as many more tokens
per byte as the device base does.

Only complete pages reach HiCache (its radix nodes are page-aligned with page size G), and every complete page is
already quantized in the base when it completes (sgl_kvq/kv_store.py), so the base is all a page is: the overlay
frames (fp16 window, open page) belong to running requests and never go to the host.

Host layouts, per base buffer `name` [L, X, ...] on the device (X = P pages, or S = P * G slots, page p = slots
p*G .. p*G+G-1), with N host pages and rows = 1 or G rows of that buffer per page:
    layer_first  [L, N * rows, ...]     (SGLang's default: one contiguous block per layer)
    page_first   [N, page bytes] uint8  (one contiguous block per page: what storage backends read; each
                                         (buffer, layer) a byte range of the page, in the data page's order,
                                         aligned to its element size)
A recipe whose layers differ in width (kivimix) stores a buffer's layers layer_first as one block of every layer's
[N * rows, ...]. Transfers run per (buffer, layer), over [pages, rows, ...] views of the host and the device alike.
Indices are SGLang's token indices (host and device), page-aligned; a page's data page (get_data_page) is its bytes
of every buffer and layer, buffer-major.
"""

from __future__ import annotations

import math

import torch
from sglang.srt.mem_cache.pool_host.base import HostKVCache


LAYOUTS = ("layer_first", "page_first")


class KVQHostPoolError(RuntimeError):
    pass


class KVQTokenToKVPoolHost(HostKVCache):
    def __init__(self, device_pool, host_to_device_ratio: float, host_size: int, page_size: int, layout: str,
                 pin_memory: bool = False, device: str = "cpu", allocator_type: str = "default",
                 pool_label: str = "kv", host_token_capacity: int | None = None, **_unused):
        shape = device_pool.shape
        if page_size != shape.G:
            raise KVQHostPoolError(f"sgl_kvq: HiCache page size {page_size} != {shape.cfg.name}'s G={shape.G}")
        if layout not in LAYOUTS:
            raise KVQHostPoolError(f"sgl_kvq: --hicache-mem-layout {layout} is not available for {shape.cfg.name}; "
                                   f"use one of {', '.join(LAYOUTS)}")
        self.device_pool, self.shape = device_pool, shape
        self.layer_num = self.target_layer_num = shape.layers
        self.names = shape.base_names()
        # rows of each buffer per page: 1 for page-indexed buffers, G for slot-indexed ones
        self.rows = {n: (1 if dims[0] == shape.P else shape.G) for n, (dims, _) in shape.layer_shapes(0).items()}
        self.page_bytes = sum(self.rows[n] * math.prod(dims[1:]) * dtype.itemsize for layer in range(shape.layers)
                              for n, (dims, dtype) in shape.layer_shapes(layer).items())
        # What a storage backend's stored pages must match to be read (SGLang keys them on the model name tagged with
        # it): the config's fingerprint (rotation, parameters, ...) and the page's bytes (the model's geometry).
        self.storage_format_tag = f"sgl_kvq-{shape.cfg.fingerprint}-{self.page_bytes}"
        super().__init__(dtype=torch.uint8, device_capacity_tokens=device_pool.size,
                         size_per_token=self.get_size_per_token(), start_layer=device_pool.start_layer,
                         end_layer=device_pool.end_layer, host_to_device_ratio=host_to_device_ratio,
                         host_size=host_size, page_size=page_size, layout=layout, pin_memory=pin_memory,
                         device=device, allocator_type=allocator_type, pool_label=pool_label,
                         host_token_capacity=host_token_capacity)

    # ---- sizes ----
    def get_size_per_token(self) -> float:
        """Host bytes per token: a page's bytes over G (what the device base stores per token)."""
        return self.page_bytes / self.shape.G

    def get_ksize_per_token(self) -> float:
        return self.get_size_per_token() / 2

    def init_kv_buffer(self):
        """The host tensors (layer_first: one per buffer name, its every layer; page_first: the pages) and each
        (buffer, layer)'s [N, rows, ...] view of them."""
        self.layer_views = {}
        N, L = self.page_num, self.shape.layers
        if self.layout == "page_first":
            ranges, at = [], 0
            for name in self.names:
                for layer in range(L):
                    dims, dtype = self.shape.layer_shapes(layer)[name]
                    at = _round_up(at, dtype.itemsize)
                    n = self.rows[name] * math.prod(dims[1:]) * dtype.itemsize
                    ranges.append((name, at, n, dims, dtype))
                    at += n
            pages = torch.zeros((N, _round_up(at, 8)), dtype=torch.uint8, device=self.device,
                                pin_memory=self.pin_memory)
            for name, start, n, dims, dtype in ranges:
                view = pages[:, start:start + n].view(dtype).view(N, self.rows[name], *dims[1:])
                self.layer_views.setdefault(name, []).append(view)
            self.buffers = {"pages": pages}
            return [pages]
        self.buffers = {}
        for name in self.names:
            rows = self.rows[name]
            shapes = [self.shape.layer_shapes(layer)[name] for layer in range(L)]
            rests = [dims[1:] for dims, _ in shapes]
            t = torch.zeros(sum(N * rows * math.prod(r) for r in rests), dtype=shapes[0][1], device=self.device,
                            pin_memory=self.pin_memory)
            self.layer_views[name], at = [], 0
            for r in rests:
                n = N * rows * math.prod(r)
                self.layer_views[name].append(t[at:at + n].view(N, rows, *r))
                at += n
            self.buffers[name] = t.view(L, N * rows, *rests[0]) if self.shape.uniform else t
        return list(self.buffers.values())

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers.values())

    def get_hybrid_pool_buffer(self):
        return list(self.buffers.values())

    # ---- page views: [pages, rows, ...] per (buffer, layer), over host and device alike ----
    def _device_view(self, device_pool, name: str, layer: int) -> torch.Tensor:
        t = getattr(device_pool.store, name)[layer]
        return t.view(self.shape.P, self.rows[name], *t.shape[1:])

    def _pages(self, indices: torch.Tensor) -> torch.Tensor:
        idx = indices.long().cpu()
        G = self.shape.G
        if idx.numel() % G or bool((idx.view(-1, G) != idx.view(-1, G)[:, :1] + torch.arange(G)).any()) \
                or bool((idx.view(-1, G)[:, 0] % G).any()):
            raise KVQHostPoolError("sgl_kvq: HiCache transfers whole pages; got indices that are not page-aligned")
        return idx.view(-1, G)[:, 0] // G

    # ---- transfers ----
    def backup_from_device_all_layer(self, device_pool, host_indices, device_indices, io_backend=None) -> None:
        hp, dp = self._pages(host_indices), self._pages(device_indices)
        for name in self.names:
            for layer, host in enumerate(self.layer_views[name]):
                dv = self._device_view(device_pool, name, layer)
                host[hp] = dv[dp.to(dv.device)].to(self.device)

    def load_to_device_per_layer(self, device_pool, host_indices, device_indices, layer_id, io_backend=None, *,
                                 is_draft: bool = False) -> None:
        if is_draft:
            raise KVQHostPoolError("sgl_kvq: speculative draft layers are not supported")
        hp, dp = self._pages(host_indices), self._pages(device_indices)
        for name in self.names:
            dv = self._device_view(device_pool, name, layer_id)
            dv[dp.to(dv.device)] = self.layer_views[name][layer_id][hp].to(dv.device)
        # The pages' contents changed without a write at offset 0: bump their generation, so no request slot's
        # stale overlay frame (tagged with this page id before it was freed) can stand in for them.
        store = device_pool.store
        store.page_gen[dp.to(store.device)] += 1

    # ---- flat pages (storage backends) ----
    def get_data_page(self, index, flat: bool = True) -> torch.Tensor:
        p = int(index) // self.shape.G
        parts = [torch.cat([v[p].reshape(-1).view(torch.uint8) for v in self.layer_views[name]])
                 for name in self.names]
        return torch.cat(parts) if flat else parts

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(self.page_bytes, dtype=torch.uint8, device=self.device)

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        if data_page.numel() != self.page_bytes:
            raise KVQHostPoolError(f"sgl_kvq: a data page of {data_page.numel()} bytes, {self.page_bytes} expected")
        p, at = int(index) // self.shape.G, 0
        for name in self.names:
            for v in self.layer_views[name]:
                view = v[p]
                n = view.numel() * view.element_size()
                view.copy_(data_page[at:at + n].view(view.dtype).view(view.shape))
                at += n


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to
