"""Per-batch metadata over the quantized store: where a batch's tokens go and what each request attends to.

    host.py     begin_batch, plan_contexts: one batch of any shape, built on the host (eager only; the reference)
    device.py   build_decode: the same for a decode batch, on the device with fixed shapes (kvq_triton, CUDA graphs)
    forward.py  build_forward_plan, read_plan: a forward batch's steps from the host builders (both backends)

The types they produce are in sgl_kvq/plan.py.
"""
