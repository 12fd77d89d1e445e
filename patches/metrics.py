"""kvq's metrics on SGLang's Prometheus endpoint (--enable-metrics, /metrics), published with SGLang's own.

SGLang's scheduler publishes its metrics from three places (the prefill report, the decode report every
--decode-log-interval batches, the idle refresh), each only where this scheduler exports metrics (--enable-metrics;
attention TP rank 0 unless --enable-metrics-for-all-schedulers), and each runs
SchedulerMetricsReporter._log_hicache_stats right before SchedulerMetricsCollector.log_stats: the AFTER hook there
has the scheduler and its collector. Without --enable-metrics nothing calls it, so the metrics cost nothing. A pool
that is not kvq's (bf16) adds no metrics.
"""

from __future__ import annotations

# This scheduler process's KVQMetrics, keyed by SGLang's collector: made on the first publish, since a
# prometheus_client metric can be registered only once per process
_exporters: dict[int, object] = {}


def publish_kvq_metrics(result, reporter, *args, **kwargs):
    # imported here: load() imports this module in every SGLang process, only the scheduler's calls it, and
    # prometheus_client must be imported after SGLang set PROMETHEUS_MULTIPROC_DIR
    from sgl_kvq.patches.observability import kv_pool_stats
    from sgl_kvq.pool import KVQTokenToKVPool

    collector, scheduler = reporter.metrics_collector, reporter.scheduler
    pool = scheduler.token_to_kv_pool_allocator.get_kvcache()
    if collector is None or not isinstance(pool, KVQTokenToKVPool):
        return result
    exporter = _exporters.get(id(collector))
    if exporter is None:
        exporter = _exporters[id(collector)] = make_exporter(collector, pool.cfg.name)
    exporter.update(kv_pool_stats(scheduler))
    return result


def make_exporter(collector, kv_cache_dtype: str):
    """kvq's metrics with the collector's labels and metric classes (SGLang's stat-logger substitution, e.g. Ray's
    wrappers, replaces prometheus_client's Gauge / Counter there)."""
    import prometheus_client

    from sgl_kvq.metrics import KVQMetrics

    return KVQMetrics(collector.labels, kv_cache_dtype, collector._gauge_cls or prometheus_client.Gauge,
                      collector._counter_cls or prometheus_client.Counter)
