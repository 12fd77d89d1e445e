"""Quality evaluations of the KV formats (attention fidelity on real Q/K/V)."""
