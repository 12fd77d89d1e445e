"""SGLang attention backends over the quantized pool: kvq_torch (reference, any device) and kvq_triton."""
