"""KIVI (kivi1, kivi2, kivi3, kivi4): the packed base alone, which every other format builds on (formats/base.py
holds its behaviour as the defaults). Keys per channel over a page, values per token and channel group, the open
page and the recent window R in fp16 frames."""

from __future__ import annotations

from sgl_kvq.formats.base import Format


# Widths whose extends attend page by page (KVQ_PREFILL=paged) by default, chosen on SmolLM2's committed essays
# (cached-turn perplexity, bf16 23.93) and SGLang's KL kit (threshold 0.002): kivi4 24.04 full, 24.11 paged, and
# the KL kit's prefix / decode hit 0.00242 / 0.00236 full (a fail), 0.00123 / 0.00146 paged (a pass); kivi3 24.57
# full, 24.52 paged, KL 0.0117 / 0.0088 full, 0.0023 / 0.0084 paged; kivi2 30.81 full, 32.65 paged.
# (bench/results/quality/ppl-prefill-smollm2.json, conformance-kl-prefill-paged-smollm2.json; the paged prefill
# served 3-7% fewer output tokens/s under SGLang's shared-prefix load, serving-prefill-one-step-*-smollm2.json.)
# The rule: paged where it passes a kit test full fails, or lowers both KL tests without raising that perplexity;
# no other format meets it (docs/conformance.md, "Which prefill each dtype defaults to").
PAGED_PREFILL_BITS = (3, 4)
PAGED_PREFILL_SINCE = "2026-11-29T14:39:00+00:00"


class Kivi(Format):
    family = "kivi"
    bits = (1, 2, 3, 4)

    def default_knobs(self, bits: int) -> dict:
        paged = {"prefill": "paged"} if bits in PAGED_PREFILL_BITS else {}
        return {**super().default_knobs(bits), **paged}

    def defaults_changed(self, bits: int) -> str | None:
        changed = [t for t in (super().defaults_changed(bits), PAGED_PREFILL_SINCE if bits in PAGED_PREFILL_BITS
                               else None) if t is not None]
        return max(changed) if changed else None


FORMAT = Kivi()
