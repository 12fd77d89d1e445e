"""Reading a Prometheus text scrape with prometheus_client's parser: kvq's families (tests/unit/test_metrics.py,
tests/engine/test_e2e_pd.py)."""

from __future__ import annotations

import time

from prometheus_client.parser import text_string_to_metric_families


def kvq_families(text: str) -> dict:
    """{family name: [(labels, value)]} of kvq's families ("sglang:kvq_*") with samples (a family never set shows
    only its HELP and TYPE lines in one process' registry); a counter's family name drops `_total`."""
    out = {}
    for family in text_string_to_metric_families(text):
        samples = [(s.labels, s.value) for s in family.samples if not s.name.endswith("_created")]
        if family.name.startswith("sglang:kvq_") and samples:
            out[family.name] = samples
    return out


def sglang_values(text: str, name: str) -> list[float]:
    return [s.value for family in text_string_to_metric_families(text) if family.name == name for s in family.samples]


def by_label(samples: list, label: str) -> dict:
    return {labels[label]: value for labels, value in samples}


def only(samples: list) -> float:
    assert len(samples) == 1, samples
    return samples[0][1]


def scrape_when(server, caught_up, timeout: float = 60) -> tuple[dict, str]:
    """Scrape the server's /metrics until caught_up(kvq families, kv_pool stats) holds (SGLang publishes its
    scheduler metrics, and kvq's, after batches and on its idle refresh) or `timeout` seconds pass ->
    (the kv_pool stats, the scrape's text)."""
    deadline = time.time() + timeout
    while True:
        stats, text = server.kv_pool_stats(), server.get("/metrics")
        if caught_up(kvq_families(text), stats) or time.time() > deadline:
            return stats, text
        time.sleep(1)
