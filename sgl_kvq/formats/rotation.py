"""KVQ_ROTATE's default per dtype: which widths store their values in the Hadamard basis unless KVQ_ROTATE says
otherwise (sgl_kvq/attention_rotation.py is what the rotation does).

Chosen on the choosing halves of both models (CPU, 2026-12-02), reported on the other halves (docs/results.md,
"Hadamard rotation in the engine"). The rule, one for every format: the KVQ_ROTATE value whose larger
cached-turn perplexity increase over the two models' choosing essays (`sgl-kvq eval ppl`, 24 turns of 192 tokens)
is the smallest, provided that, where the choosing half of the needles ran (kivi2, kivi3, kivi4 on both models), it
answers at most one fewer than `none` on each model, and that it keeps a KL-kit pass (kivi4). SpeCache's perplexity
is bf16's by construction (its extends read the prefix in 16 bits), so it follows its base's rule where its
choosing needles (SmolLM2's; not run on Gemma 3) do not drop.

Perplexity increase against bf16, SmolLM2 / Gemma 3, none -> values (-> hadamard, q and K rotated too)
(bench/results/quality/ppl24-rotation-{,methods-}choose-{smollm2,gemma3}.json):

    kivi4      +0.07% / +0.87%  ->  +0.15% / +0.33%   (+0.78% / -0.05%)
    kivi3      +2.92% / +0.42%  ->  +2.10% / +0.93%   (+2.42% / +1.64%)  (none kept: two needles fewer on Gemma 3)
    kivi2      +38.1% / +30.3%  ->  +35.7% / +14.2%   (+29.8% / +117%)
    kivi1      +217%  / +116%   ->  +199%  / +71%     (+198%  / +493%)
    gear2      +23.2% / +8.7%   ->  +18.2% / +9.1%    (+15.1% / +100%)
    logquant2  +19.8% / +29.7%  ->  +21.1% / +14.5%   (+12.1% / +118%)
    gearl2     +39.4% / +17.8%  ->  +41.3% / +11.2%   (none kept: its larger increase rises)
    zipcache2  +8.0%  / +4.1%   ->  +8.6%  / +4.0%    (none kept)

Choosing needles, none -> values, on SmolLM2 (bf16 16/18; niah-rotation-choose{,-specache}-smollm2.json): kivi4
16 -> 15, kivi3 14 -> 14, kivi2 7 -> 8, specache1 15 -> 16, specache2 16 -> 16; on Gemma 3 (bf16 15/18;
niah-rotation-choose-gemma3.json): kivi4 15 -> 15, kivi3 17 -> 15, kivi2 15 -> 16. The KL kit on SmolLM2 (prefix /
decode hit, threshold 0.002; conformance-kl-rotation-{none,values}-smollm2.json): kivi4 0.00152 / 0.00169 ->
0.00157 / 0.0019, a pass either way. Rotating q and K too helps every 2-bit format on
SmolLM2 (kivi2 13/18 needles) and makes every one's perplexity increase several times larger on Gemma 3 (offline
too: Gemma's kivi4 attention error 0.098 -> 0.138, against 0.089 with the values alone; why its keys, which Gemma
normalizes with k_norm before RoPE, lose is not measured): it stays a knob.
"""

from __future__ import annotations

# family -> the widths whose values are rotated by default (Format.values_rotated)
VALUES_ROTATED: dict[str, tuple[int, ...]] = {"kivi": (1, 2, 4), "gear": (2,), "logquant": (2,), "specache": (1, 2)}
# when those defaults changed what an engine run of them computes (Format.defaults_changed): results measured before
# ran these dtypes unrotated
VALUES_ROTATED_SINCE = "2026-12-02T06:15:00+00:00"
