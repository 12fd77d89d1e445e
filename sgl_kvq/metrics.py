"""kvq's Prometheus metrics: which number of the pool's stats each one shows, and the exporter that sets them.

Every metric reads one key of the stats the scheduler reports as /get_server_info's kv_pool
(KVQTokenToKVPool.stats plus the live counts and PD counters patches/observability.py adds), so the scrape and the
JSON cannot disagree. Names follow SGLang's scheduler metrics (`sglang:` prefix, SGLang's own labels: model_name,
engine_type, tp_rank, pp_rank, moe_ep_rank, dp_rank ...) with `kvq_` in front and the dtype as a `kv_cache_dtype`
label. Gauges use multiprocess_mode="mostrecent" as SGLang's do: the scheduler writes them in its own process and
the HTTP server's process reads them from PROMETHEUS_MULTIPROC_DIR. patches/metrics.py calls `update` where SGLang
publishes its own scheduler metrics; docs/metrics.md lists them with a scrape.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

GAUGE, COUNTER = "gauge", "counter"


def _key(*path: str) -> Callable[[dict], object]:
    def read(stats: dict):
        for name in path:
            if not isinstance(stats, dict) or stats.get(name) is None:
                return None
            stats = stats[name]
        return stats
    return read


def _frames_held(stats: dict):
    # static frames are allocated per request slot, never held from the pool: nothing to show
    return _key("live", "frames_held")(stats) if stats.get("frames_pooled") else None


def _pd_sent_bytes(stats: dict):
    sent = stats.get("pd_sent")
    return None if sent is None else {"kv": sent["kv_bytes"], "aux": sent["aux_bytes"]}


@dataclass(frozen=True)
class Metric:
    name: str
    kind: str
    documentation: str
    read: Callable[[dict], object]  # stats -> a number, {label value: number} when `label` is set, None: absent
    label: str | None = None  # the metric's own label, beside SGLang's labels and kv_cache_dtype


METRICS = (
    Metric("sglang:kvq_capacity_tokens", GAUGE, "KV tokens the kvq pool holds (SGLang's max_total_num_tokens).",
           _key("capacity_tokens")),
    Metric("sglang:kvq_bytes_per_token", GAUGE,
           "Device bytes of the kvq pool per token of capacity: the packed pages plus the per-request state "
           "(static overlay frames, SpeCache's top-k buffers).", _key("kv_bytes_per_token")),
    Metric("sglang:kvq_packed_bytes_per_token", GAUGE,
           "Bytes per token of the packed pages alone (codes, scales and zero points, the format's extras).",
           _key("base_bytes_per_token")),
    Metric("sglang:kvq_request_state_bytes", GAUGE,
           "Device bytes of the per-request state allocated beside the pages (static overlay frames, SpeCache's "
           "top-k buffers).", _key("request_state_bytes")),
    Metric("sglang:kvq_overlay_frames_live", GAUGE,
           "fp16 overlay frames holding a page of a live request (the open page and the fp16 window).",
           _key("live", "overlay_frames_live")),
    Metric("sglang:kvq_frames_held", GAUGE,
           "Pooled fp16 frames running requests hold from the pool's pages (KVQ_FRAMES=pooled only).", _frames_held),
    Metric("sglang:kvq_free_request_slots", GAUGE,
           "Free request slots (SGLang's req_to_token rows; a running request holds one with its frames).",
           _key("live", "free_req_slots")),
    Metric("sglang:kvq_pages_quantized_total", COUNTER,
           "Pages quantized into the packed base (once each, in the batch that writes its last token).",
           _key("pages_quantized")),
    Metric("sglang:kvq_decode_batches_total", COUNTER, "Decode batches by the decode path that served them.",
           _key("decode_batches"), label="path"),
    Metric("sglang:kvq_specache_prefetched_bytes_total", COUNTER,
           "Bytes of 16-bit top-k KV rows SpeCache fetched from its host tier.", _key("specache", "prefetched_bytes")),
    Metric("sglang:kvq_specache_guesses_total", COUNTER,
           "Decode steps where SpeCache had guessed the request's next token.",
           _key("specache", "spec_token_guesses")),
    Metric("sglang:kvq_specache_guess_hits_total", COUNTER, "SpeCache's guesses of the next token that were right.",
           _key("specache", "spec_token_hits")),
    Metric("sglang:kvq_specache_guess_hit_ratio", GAUGE,
           "Share of SpeCache's next-token guesses that were right, since the server started.",
           _key("specache", "spec_token_hit_rate")),
    Metric("sglang:kvq_pd_sent_bytes_total", COUNTER,
           "Bytes this prefill server's transfer engine wrote to decode servers: KV (pages and request state) and "
           "aux (SGLang's metadata).", _pd_sent_bytes, label="kind"),
    Metric("sglang:kvq_pd_sent_requests_total", COUNTER,
           "Requests whose last KV chunk this prefill server handed to its sender.", _key("pd_sent", "requests")),
    Metric("sglang:kvq_pd_sent_bytes_per_request", GAUGE,
           "Bytes sent per request (KV and aux), since the server started.", _key("pd_sent", "bytes_per_request")),
)


def metric_values(stats: dict) -> dict[str, dict[str | None, float]]:
    """Pool stats -> {metric name: {its own label's value (None: no label): value}}; metrics the stats lack (a
    format's or a role's: SpeCache, PD) are left out."""
    out = {}
    for metric in METRICS:
        value = metric.read(stats)
        if value is not None:
            out[metric.name] = {k: float(v) for k, v in value.items()} if metric.label else {None: float(value)}
    return out


class KVQMetrics:
    """One scheduler's kvq metrics. labels: SGLang's labels of this scheduler's metrics; gauge_cls / counter_cls:
    the prometheus_client classes SGLang's collector uses (or its substitutes, e.g. Ray's)."""

    def __init__(self, labels: dict, kv_cache_dtype: str, gauge_cls, counter_cls):
        self.labels = {**{k: str(v) for k, v in labels.items()}, "kv_cache_dtype": kv_cache_dtype}
        self._metrics = {}
        for metric in METRICS:
            names = [*self.labels, *([metric.label] if metric.label else [])]
            if metric.kind == GAUGE:
                self._metrics[metric.name] = gauge_cls(name=metric.name, documentation=metric.documentation,
                                                       labelnames=names, multiprocess_mode="mostrecent")
            else:
                self._metrics[metric.name] = counter_cls(name=metric.name, documentation=metric.documentation,
                                                         labelnames=names)
        # The pool's counters are totals since startup; a Prometheus counter only increments: what was added so far
        self._counted: dict[tuple[str, str | None], float] = {}

    def update(self, stats: dict) -> None:
        kinds = {metric.name: metric for metric in METRICS}
        for name, series in metric_values(stats).items():
            metric = kinds[name]
            for label_value, value in series.items():
                extra = {metric.label: label_value} if metric.label else {}
                child = self._metrics[name].labels(**self.labels, **extra)
                if metric.kind == GAUGE:
                    child.set(value)
                    continue
                added = self._counted.get((name, label_value), 0.0)
                if value > added:
                    child.inc(value - added)
                self._counted[(name, label_value)] = max(added, value)
