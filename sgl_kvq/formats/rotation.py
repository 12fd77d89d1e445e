"""KVQ_ROTATE's default per dtype: which widths store their values in the Hadamard basis unless KVQ_ROTATE says
otherwise (sgl_kvq/attention_rotation.py is what the rotation does).

Chosen on the choosing halves of both models (CPU, 2026-12-02), reported on the other halves. The rule, one for every
format: the KVQ_ROTATE value whose larger cached-turn perplexity increase over the two models' choosing essays
(`sgl-kvq eval ppl`, 24 turns of 192 tokens) is the smallest, provided that, where the choosing half of the needles ran
(kivi2, kivi3, kivi4 on both models), it answers at most one fewer than `none` on each model, and that it keeps a
KL-kit pass (kivi4). SpeCache's perplexity is bf16's by construction (its extends read the prefix in 16 bits), so it
follows its base's rule where its choosing needles (SmolLM2's; not run on Gemma 3) do not drop. `hadamard` (q and K
rotated too) stays a knob because it makes every format's increase several times larger on Gemma 3.

The measurements: docs/knobs.md (KVQ_ROTATE) and docs/results.md, "Hadamard rotation in the engine"
(bench/results/quality/ppl24-rotation-{,methods-}choose-{smollm2,gemma3}.json,
niah-rotation-choose-{smollm2,gemma3}.json, niah-rotation-choose-specache-smollm2.json,
bench/results/conformance-kl-rotation-{none,values}-smollm2.json).
"""

from __future__ import annotations

# family -> the widths whose values are rotated by default (Format.values_rotated)
VALUES_ROTATED: dict[str, tuple[int, ...]] = {"kivi": (1, 2, 4), "gear": (2,), "logquant": (2,), "specache": (1, 2)}
