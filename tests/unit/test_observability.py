"""patches/observability.py: what live counts report about requests a prefill/decode-disaggregated server parks in
its own queues (they hold pages and request slots while SGLang's running batch and waiting queue are empty)."""

from __future__ import annotations

from types import SimpleNamespace

from sgl_kvq.patches.observability import _pd_queued


def test_a_server_without_disaggregation_has_no_pd_count():
    assert _pd_queued(SimpleNamespace()) is None
    assert _pd_queued(SimpleNamespace(disagg_prefill_bootstrap_queue=None, disagg_prefill_inflight_queue=None,
                                      disagg_decode_prealloc_queue=None, disagg_decode_transfer_queue=None)) is None


def test_pd_queues_count_every_parked_request():
    prefill = SimpleNamespace(disagg_prefill_bootstrap_queue=SimpleNamespace(queue=["a", "b"]),
                              disagg_prefill_inflight_queue=["c"])
    assert _pd_queued(prefill) == 3
    decode = SimpleNamespace(disagg_decode_prealloc_queue=SimpleNamespace(queue=["a"], retracted_queue=["r"]),
                             disagg_decode_transfer_queue=SimpleNamespace(queue=["b", "c"]))
    assert _pd_queued(decode) == 4
    idle = SimpleNamespace(disagg_decode_prealloc_queue=SimpleNamespace(queue=[], retracted_queue=[]),
                           disagg_decode_transfer_queue=SimpleNamespace(queue=[]))
    assert _pd_queued(idle) == 0
