"""SpeCache's two decode lanes: how a decode step of a specache pool turns B requests into 2B rows.

Each decode step of a specache pool runs the model on 2B rows instead of B: rows [0, B) are the batch's real
tokens at their positions, rows [B, 2B) each request's speculative token (row 1's greedy guess from the step
before) one position later. The attention backend (sgl_kvq/backends/specache_backend.py) writes only rows [0, B)
to the pool, so the speculative rows' KV never enters it; the logits of rows [B, 2B) become next step's
speculative tokens and only rows [0, B) reach SGLang's sampler. A request's first decode step is preceded by one
read-only forward of its real token (the paper's pre-decoding) that makes its first guess and first top-k.

Why not SGLang's speculative-decoding path (TARGET_VERIFY with two tokens per request): that path allocates pool
slots for draft tokens, runs acceptance against them and commits accepted drafts' KV, none of which SpeCache
wants (its speculative token is never accepted: it only steers the prefetch), and it is bound to draft workers,
tree masks and page_size=1 allocation. Doubling the rows of a plain decode keeps SGLang's scheduling, radix cache,
retraction and sampling untouched: every non-attention layer is per-token, and the backend owns attention.

SGLang reaches this through the AROUND hook on its eager decode forward (patches/eager_decode.py, through
SpeCacheStrategy.eager_decode_step), which hands over the forward batch and a callable that runs the model on it;
nothing here imports SGLang.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from sgl_kvq.specache.state import Lanes, SpeCacheState


def _req_slots(fb) -> list[int]:
    cpu = getattr(fb, "req_pool_indices_cpu", None)
    return (cpu if cpu is not None else fb.req_pool_indices).tolist()


def run_lanes(forward: Callable[[], object], fb, sc: SpeCacheState):
    """Run one decode step of forward batch `fb` as SpeCache's lanes; `forward()` runs the model on fb's current
    rows and returns SGLang's LogitsProcessorOutput. fb's rows are restored afterwards, and the output holds the
    real rows only."""
    ids, pos, loc = fb.input_ids, fb.positions, fb.out_cache_loc
    req = fb.req_pool_indices.long()
    B = ids.shape[0]
    slots = _req_slots(fb)
    try:
        new = [i for i, r in enumerate(slots) if sc.needs_predecode[r]]
        if new:  # pre-decode: the real token, read-only, low-bit only: first guess and first top-k
            rows = torch.tensor(new, dtype=torch.int64, device=ids.device)
            fb.input_ids, fb.positions, fb.out_cache_loc = ids[rows], pos[rows], loc.new_zeros(len(new))
            sc.lanes = Lanes("predecode", len(new), rows)
            out = forward()
            sc.spec_token[req[rows]] = out.next_token_logits.argmax(-1)
            sc.predecode_rows += len(new)
            for i in new:
                sc.needs_predecode[slots[i]] = False
        sc.count_guesses(req, ids)
        spec = sc.spec_token[req]
        fb.input_ids = torch.cat([ids, spec.to(ids.dtype)])
        fb.positions = torch.cat([pos, pos + 1])
        fb.out_cache_loc = torch.cat([loc, loc.new_zeros(B)])  # row 1 writes nothing; slot 0 is the dummy slot
        sc.lanes = Lanes("two_lane", B)
        out = forward()
        logits = out.next_token_logits
        sc.spec_input[req] = spec
        sc.spec_token[req] = logits[B:].argmax(-1)
        out.next_token_logits = logits[:B]
        if getattr(out, "hidden_states", None) is not None and out.hidden_states.shape[0] == 2 * B:
            out.hidden_states = out.hidden_states[:B]
        sc.decode_steps += 1
        return out
    finally:
        fb.input_ids, fb.positions, fb.out_cache_loc = ids, pos, loc
        sc.lanes = None
