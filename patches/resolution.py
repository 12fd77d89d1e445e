"""Server-argument resolution for kvq dtypes: validate everything before a model loads, then pick the page size
(= G), the attention backend and the CUDA-graph setting the quantized pool needs."""

from __future__ import annotations

import logging

from sgl_kvq import env
from sgl_kvq.config import KVQConfigError, looks_like_kvq_dtype, parse_kv_cache_dtype
from sgl_kvq.model_check import check_hf_config
from sgl_kvq.strategies import strategy_of

logger = logging.getLogger("sgl_kvq")

_SOURCE = "sgl_kvq"


def kvq_backend_for(device: str | None, cfg) -> str:
    # kvq_triton reads packed pages in fused Triton kernels on CUDA (SpeCache's two lanes included); kvq_torch is
    # the reference, the CPU path and the path of a format with no kernel (Format.kernel None).
    from sgl_kvq.patches.backends import triton_backend_available

    triton = device in (None, "cuda") and triton_backend_available() and cfg.format.kernel is not None
    return "kvq_triton" if triton else "kvq_torch"


def check_backend_reads(cfg, chosen_backends: list[tuple[str, str | None]]) -> None:
    """A format served only through the torch backend has no Triton kernel: kvq_triton refuses it now."""
    for what, chosen in chosen_backends:
        if chosen == "kvq_triton" and cfg.format.kernel is None:
            raise KVQConfigError(f"sgl_kvq: {cfg.name} has no Triton kernel; --{what} kvq_triton cannot serve it, "
                                 "use kvq_torch")


def _check_triton_shapes(cfg, head_dim: int) -> None:
    # The kernels tile pages and heads for tl.dot: both must be powers of two >= 16 (kernels/checks.py).
    for what, n in (("G (KVQ_GROUP_SIZE)", cfg.group_size), ("head_dim", head_dim)):
        if n < 16 or n & (n - 1):
            raise KVQConfigError(f"sgl_kvq: kvq_triton needs {what} to be a power of two >= 16, got {n}; use "
                                 "--attention-backend kvq_torch")


def _check_pinned_budget(cfg, model_config, view, requested: int | None) -> None:
    """With KVQ_KV_CACHE_GB the budget is known before the model loads: an explicit --max-running-requests it cannot
    hold fails now rather than after the weights are loaded (a profiled budget is checked when it is profiled)."""
    budget = env.kv_cache_budget_bytes()
    if budget is None or requested is None:
        return
    from sgl_kvq.capacity import split_budget
    from sgl_kvq.patches.sizing import pool_shape

    from sgl_kvq.frames import pooled_frames

    dp = max(getattr(view, "attn_dp_size", 1) or 1, 1)
    shape = pool_shape(model_config, cfg, layers=model_config.num_hidden_layers, attn_tp_size=view.tp_size // dp)
    pooled = pooled_frames(shape, model_config.dtype, getattr(view, "disaggregation_mode", "null"))
    split_budget(budget, shape, model_config.dtype, host_is_device=view.device == "cpu", frames_pooled=pooled,
                 requested=max(1, requested // dp))


def validate(server_args, view, cfg) -> None:
    """Raise KVQConfigError for every combination the quantized pool cannot serve."""
    page = server_args.page_size  # the user's own value (None when not given)
    if page is not None and page != cfg.group_size:
        raise KVQConfigError(f"sgl_kvq: --page-size {page} conflicts with {cfg.name}'s quantization group "
                             f"G={cfg.group_size} (a page is one key group); drop --page-size or set "
                             f"KVQ_GROUP_SIZE={page}")
    backend = server_args.attention_backend
    from sgl_kvq.patches.cli_args import BACKENDS

    for what in ("attention_backend", "prefill_attention_backend", "decode_attention_backend"):
        chosen = getattr(server_args, what, None)
        if chosen is not None and chosen not in BACKENDS:
            raise KVQConfigError(f"sgl_kvq: --{what.replace('_', '-')} {chosen} cannot read {cfg.name} KV; use "
                                 f"{' or '.join(BACKENDS)} (or leave it unset)")
    check_backend_reads(cfg, [(what.replace("_", "-"), getattr(server_args, what, None)) for what in
                              ("attention_backend", "prefill_attention_backend", "decode_attention_backend")])
    unsupported = {
        "speculative_algorithm": "speculative decoding",
        "enable_mixed_chunk": "--enable-mixed-chunk",
        "enable_lora": "LoRA",
    }
    for field, what in unsupported.items():
        if getattr(view, field, None):
            raise KVQConfigError(f"sgl_kvq: {what} is not supported with --kv-cache-dtype {cfg.name} yet")
    strategy = strategy_of(cfg)
    refusal = strategy.refusal("hicache", cfg.name)
    if getattr(view, "enable_hierarchical_cache", None) and refusal:
        raise KVQConfigError(f"sgl_kvq: {refusal}")
    from sgl_kvq.host_pool import LAYOUTS

    layout = getattr(view, "hicache_mem_layout", None)
    if getattr(view, "enable_hierarchical_cache", None) and layout not in (None, *LAYOUTS):
        raise KVQConfigError(f"sgl_kvq: --hicache-mem-layout {layout} is not available for {cfg.name}'s packed host "
                             f"pool; use {' or '.join(LAYOUTS)}")
    mode = getattr(view, "disaggregation_mode", None) or "null"
    refusal = strategy.refusal("disaggregation", cfg.name)
    if mode != "null" and refusal:
        raise KVQConfigError(f"sgl_kvq: {refusal}")
    if mode == "decode" and getattr(view, "disaggregation_decode_enable_radix_cache", None):
        # The prefill side then sends only the pages past the decode side's cached prefix; the frames of window
        # pages inside that prefix are not handled (and not tested).
        raise KVQConfigError(f"sgl_kvq: --disaggregation-decode-enable-radix-cache is not supported with {cfg.name} "
                             "yet; drop it (the prefill server keeps its radix cache)")
    backup = getattr(view, "disaggregation_decode_retraction_backup", None)
    if mode == "decode" and backup not in (None, "none"):
        # Both backups copy plain K/V rows (get_cpu_copy, or a bf16 HiCache host pool), which the packed pool
        # refuses; a retracted request is aborted (503) for the client to retry instead.
        raise KVQConfigError(f"sgl_kvq: --disaggregation-decode-retraction-backup {backup} cannot hold {cfg.name} "
                             "pages; use --disaggregation-decode-retraction-backup none (the default with kvq "
                             "dtypes)")
    if (getattr(view, "pp_size", 1) or 1) > 1:
        raise KVQConfigError(f"sgl_kvq: pipeline parallelism is not supported with {cfg.name} yet")
    if backend == "kvq_triton" and view.device == "cpu":
        logger.warning("sgl_kvq: kvq_triton on CPU runs Triton's interpreter (TRITON_INTERPRET=1): slow")
    from sglang.srt.arg_groups.overrides import model_config_of

    model_config = model_config_of(server_args)
    check_hf_config(model_config.hf_config, cfg, hybrid_swa=model_config.is_hybrid_swa,
                    model_path=model_config.model_path)
    _check_pinned_budget(cfg, model_config, view, server_args.max_running_requests)
    if (backend or kvq_backend_for(view.device, cfg)) == "kvq_triton":
        _check_triton_shapes(cfg, model_config.head_dim)


def resolve(server_args, previous) -> None:
    from sglang.srt.arg_groups.overrides import declare_resolution, resolving_view

    view = resolving_view(server_args)
    if not looks_like_kvq_dtype(view.kv_cache_dtype):
        return previous(server_args)
    cfg = parse_kv_cache_dtype(view.kv_cache_dtype)
    validate(server_args, view, cfg)
    # max_running_requests is left to the pool sizing (patches/sizing.py): it follows from the KV budget.
    decided = {"page_size": cfg.group_size}
    if (view.disaggregation_mode or "null") == "decode" and view.disaggregation_decode_retraction_backup is None:
        decided["disaggregation_decode_retraction_backup"] = "none"  # see validate()
    if server_args.attention_backend is None:
        decided["attention_backend"] = kvq_backend_for(view.device, cfg)
    declare_resolution(server_args, _SOURCE, **decided)
    logger.info("sgl_kvq: %s with %s", cfg, decided)
    previous(server_args)
    # kvq_triton builds decode metadata on the device with fixed shapes (sgl_kvq/metadata/device.py), so decode
    # runs under SGLang's CUDA graphs; its extend plan and all of kvq_torch are host-built: those run eagerly.
    backend = resolving_view(server_args).attention_backend
    if backend in ("kvq_torch", "kvq_triton"):
        from sglang.srt.model_executor.cuda_graph_config import Backend, Phase, with_phase

        graphs = resolving_view(server_args).cuda_graph_config
        # SpeCache's lanes hook SGLang's eager decode forward (patches/eager_decode.py): its decode runs eagerly.
        eager_decode = backend == "kvq_torch" or strategy_of(cfg).eager_decode
        for phase in (Phase.DECODE, Phase.PREFILL) if eager_decode else (Phase.PREFILL,):
            graphs = with_phase(graphs, phase, backend=Backend.DISABLED)
        declare_resolution(server_args, _SOURCE, cuda_graph_config=graphs)
