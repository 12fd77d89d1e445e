"""Every SGLang 0.5.23 symbol sgl_kvq hooks or imports, checked when the plugin loads so a version change fails
loudly instead of silently serving bf16 (or garbage)."""

from __future__ import annotations

import importlib

from sgl_kvq import SGLANG_VERSION

# Every hook load() places after the version check: (target, patches module, its function, HookType name). The
# targets checked at load are this table's, plus the CLI hook placed before the check (so a refusal can reach
# --kv-cache-dtype): one list, so a hook cannot go unchecked.
CLI_HOOK = "sglang.srt.server_args.ServerArgs.add_cli_args"
HOOKS = (
    ("sglang.srt.mem_cache.kv_cache_dtype.configure_kv_cache_dtype", "dtype", "configure_kv_cache_dtype", "AROUND"),
    ("sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator.__init__", "sizing",
     "pool_configurator_init", "AROUND"),
    ("sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._profile_available_bytes", "sizing",
     "profile_available_bytes", "AROUND"),
    ("sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator.resolve_max_num_reqs", "sizing",
     "resolve_max_num_reqs", "AROUND"),
    ("sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._apply_token_constraints", "sizing",
     "apply_token_constraints", "AROUND"),
    ("sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._build_token_to_kv_pool", "pool_build",
     "build_token_to_kv_pool", "AROUND"),
    ("sglang.srt.mem_cache.common.release_kv_cache", "retraction", "release_kv_cache", "AROUND"),
    ("sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._build_token_to_kv_pool_allocator", "frames",
     "build_allocator", "AROUND"),
    ("sglang.srt.managers.schedule_policy.PrefillAdder.add_one_req", "frames", "add_one_req", "AROUND"),
    ("sglang.srt.mem_cache.allocation.alloc_req_slots", "frames", "alloc_req_slots", "AROUND"),
    ("sglang.srt.mem_cache.memory_pool.ReqToTokenPool.free_rows", "frames", "free_rows", "AROUND"),
    ("sglang.srt.managers.scheduler_components.internal_state.SchedulerInternalStateController._add_memory_usage",
     "observability", "add_kv_pool_stats", "AFTER"),
    ("sglang.srt.managers.scheduler_components.metrics_reporter.SchedulerMetricsReporter._log_hicache_stats",
     "metrics", "publish_kvq_metrics", "AFTER"),
    ("sglang.srt.model_executor.runner.eager_runner.EagerRunner._execute_decode", "eager_decode", "execute_decode",
     "AROUND"),
    ("sglang.srt.layers.quantization.unquant.UnquantizedLinearMethod.apply", "cpu_gemm", "linear_apply", "AROUND"),
    ("sglang.srt.layers.logits_processor.LogitsProcessor._compute_lm_head", "cpu_gemm", "compute_lm_head", "AROUND"),
    ("sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend._run_sdpa_forward_extend",
     "torch_native_extend", "sdpa_forward_extend", "AROUND"),
    ("sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler.build_kv_host_pool", "hicache", "build_kv_host_pool",
     "AROUND"),
    ("sglang.srt.disaggregation.mooncake.conn.MooncakeKVSender.__init__", "pd", "mooncake_sender_init", "AFTER"),
    ("sglang.srt.disaggregation.prefill.SchedulerDisaggregationPrefillMixin.maybe_send_cached_prefix_chunk", "pd",
     "prefill_early_send", "AROUND"),
    ("sglang.srt.disaggregation.utils.setup_state_kv_args", "pd", "setup_state_kv_args", "AFTER"),
    ("sglang.srt.disaggregation.common.conn.CommonKVManager.try_ensure_parallel_info", "pd", "ensure_parallel_info",
     "AROUND"),
    ("sglang.srt.disaggregation.prefill.SchedulerDisaggregationPrefillMixin.send_kv_chunk", "pd",
     "prefill_send_kv_chunk", "BEFORE"),
    ("sglang.srt.disaggregation.decode.DecodeTransferQueue._commit_transfer_to_req", "pd", "decode_commit_transfer",
     "AFTER"),
    ("sglang.srt.distributed.device_communicators.mooncake_transfer_engine.MooncakeTransferEngine.batch_transfer_sync",
     "pd", "count_batch_transfer", "AROUND"),
    ("sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager.send_aux", "pd", "count_aux", "AROUND"),
)
HOOK_TARGETS = (CLI_HOOK,) + tuple(target for target, *_ in HOOKS)
IMPORTED = (
    "sglang.srt.arg_groups.resolution_hooks.register_resolution_hook",
    "sglang.srt.arg_groups.overrides.declare_resolution",
    "sglang.srt.arg_groups.overrides.resolving_view",
    "sglang.srt.arg_groups.overrides.model_config_of",
    "sglang.srt.arg_groups.choices.add_attention_backend_choices",
    "sglang.srt.layers.attention.attention_registry.register_attention_backend",
    "sglang.srt.layers.attention.base_attn_backend.AttentionBackend",
    "sglang.srt.mem_cache.memory_pool.KVCache",
    "sglang.srt.mem_cache.pool_host.base.HostKVCache",
    "sglang.srt.model_executor.cuda_graph_config.with_phase",
    "sglang.srt.disaggregation.utils.append_state_component",
    "sglang.srt.disaggregation.utils.is_aborted",
    "sglang.srt.disaggregation.utils.FAKE_BOOTSTRAP_HOST",
    "sglang.srt.observability.metrics_collector.SchedulerMetricsCollector._gauge_cls",
    "sglang.srt.observability.metrics_collector.SchedulerMetricsCollector._counter_cls",
    "sglang.srt.disaggregation.base.conn.StateType.REQUEST_ROW",
)
RESOLUTION_STEP = "handle_attention_backend_compatibility"


class SGLangVersionError(RuntimeError):
    pass


def resolve(path: str):
    parts = path.split(".")
    for i in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(path)


def check() -> None:
    import sglang

    problems = []
    if sglang.__version__ != SGLANG_VERSION:
        problems.append(f"sglang {sglang.__version__} is installed, sgl_kvq is built for exactly {SGLANG_VERSION}")
    for path in HOOK_TARGETS + IMPORTED:
        try:
            resolve(path)
        except (ImportError, AttributeError) as e:
            problems.append(f"{path} is missing ({type(e).__name__}: {e})")
    from sglang.srt.arg_groups.resolution_hooks import _OVERRIDABLE_HOOKS

    if RESOLUTION_STEP not in _OVERRIDABLE_HOOKS:
        problems.append(f"resolution step {RESOLUTION_STEP} is not overridable")
    if problems:
        raise SGLangVersionError("sgl_kvq cannot hook this SGLang: " + "; ".join(problems))
