"""SpeCache (specache1|2): the host tier of 16-bit K/V (host_tier), the per-pool runtime state (state), the torch
reference of the two lanes' attention (attention), their batched form kvq_torch runs (attention_batched) and the lanes
themselves (lanes)."""
