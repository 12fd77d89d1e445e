"""KIVI (kivi1, kivi2, kivi3, kivi4): the packed base alone, which every other format builds on (formats/base.py
holds its behaviour as the defaults). Keys per channel over a page, values per token and channel group, the open
page and the recent window R in fp16 frames."""

from __future__ import annotations

from sgl_kvq.formats.base import Format


# Widths whose extends attend page by page (KVQ_PREFILL=paged) by default. The rule: paged where it passes a kit
# test full fails, or lowers both KL tests without raising cached-turn perplexity; kivi4 and kivi3 meet it on
# SmolLM2 and no other format does (docs/knobs.md, KVQ_PREFILL; docs/conformance.md, "Which prefill each dtype
# defaults to"; bench/results/quality/ppl-prefill-smollm2.json,
# bench/results/conformance-kl-prefill-paged-smollm2.json).
PAGED_PREFILL_BITS = (3, 4)


class Kivi(Format):
    family = "kivi"
    bits = (1, 2, 3, 4)

    def default_knobs(self, bits: int) -> dict:
        paged = {"prefill": "paged"} if bits in PAGED_PREFILL_BITS else {}
        return {**super().default_knobs(bits), **paged}


FORMAT = Kivi()
