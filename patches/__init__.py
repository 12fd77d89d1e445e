"""Every hook sgl_kvq places into SGLang 0.5.23, each target checked when the plugin loads (targets.py). The pool
and the attention backends are not hooks: they subclass SGLang's KVCache / AttentionBackend (sgl_kvq/pool.py,
sgl_kvq/backends/).

`load()` is the `sglang.srt.plugins` entry point: SGLang runs it in every process (launch_server, Engine, scheduler,
detokenizer). SGLang logs and swallows plugin exceptions, so a failed version check is re-raised where it matters:
the kvq dtypes stay registered and refuse to resolve with the reason.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("sgl_kvq")
_state = {"loaded": False, "error": None}


def load() -> None:
    if _state["loaded"]:
        return
    _state["loaded"] = True
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from sgl_kvq.patches import cli_args, targets

    HookRegistry.register("sglang.srt.server_args.ServerArgs.add_cli_args", cli_args.extend_kv_cache_dtype_choices,
                          HookType.AFTER)
    try:
        targets.check()
    except targets.SGLangVersionError as e:
        _state["error"] = e
        logger.error("%s", e)
        _register_refusal(e)
        return
    from sglang.srt.arg_groups.resolution_hooks import register_resolution_hook

    from sgl_kvq.patches import (backends, dtype, hicache, observability, pd, pool_build, resolution, retraction,
                                 sizing, specache_lanes)

    cli_args.register_backend_choices()
    backends.register()
    register_resolution_hook(targets.RESOLUTION_STEP)(resolution.resolve)
    HookRegistry.register("sglang.srt.mem_cache.kv_cache_dtype.configure_kv_cache_dtype",
                          dtype.configure_kv_cache_dtype, HookType.AROUND)
    HookRegistry.register("sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator.__init__",
                          sizing.pool_configurator_init, HookType.AROUND)
    HookRegistry.register("sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._profile_available_bytes",
                          sizing.profile_available_bytes, HookType.AROUND)
    HookRegistry.register("sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator.resolve_max_num_reqs",
                          sizing.resolve_max_num_reqs, HookType.AROUND)
    HookRegistry.register("sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._apply_token_constraints",
                          sizing.apply_token_constraints, HookType.AROUND)
    HookRegistry.register("sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._build_token_to_kv_pool",
                          pool_build.build_token_to_kv_pool, HookType.AROUND)
    HookRegistry.register("sglang.srt.mem_cache.common.release_kv_cache", retraction.release_kv_cache, HookType.AROUND)
    HookRegistry.register("sglang.srt.managers.scheduler_components.internal_state.SchedulerInternalStateController"
                          "._add_memory_usage", observability.add_kv_pool_stats, HookType.AFTER)
    HookRegistry.register("sglang.srt.model_executor.runner.eager_runner.EagerRunner._execute_decode",
                          specache_lanes.execute_decode, HookType.AROUND)
    HookRegistry.register("sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler.build_kv_host_pool",
                          hicache.build_kv_host_pool, HookType.AROUND)
    HookRegistry.register("sglang.srt.disaggregation.mooncake.conn.MooncakeKVSender.__init__",
                          pd.mooncake_sender_init, HookType.AFTER)
    HookRegistry.register("sglang.srt.disaggregation.prefill.SchedulerDisaggregationPrefillMixin"
                          ".maybe_send_cached_prefix_chunk", pd.prefill_early_send, HookType.AROUND)
    HookRegistry.register("sglang.srt.disaggregation.utils.setup_state_kv_args", pd.setup_state_kv_args,
                          HookType.AFTER)
    HookRegistry.register("sglang.srt.disaggregation.prefill.SchedulerDisaggregationPrefillMixin.send_kv_chunk",
                          pd.prefill_send_kv_chunk, HookType.BEFORE)
    HookRegistry.register("sglang.srt.disaggregation.decode.DecodeTransferQueue._commit_transfer_to_req",
                          pd.decode_commit_transfer, HookType.AFTER)
    HookRegistry.register("sglang.srt.distributed.device_communicators.mooncake_transfer_engine."
                          "MooncakeTransferEngine.batch_transfer_sync", pd.count_batch_transfer, HookType.AROUND)
    HookRegistry.register("sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager.send_aux", pd.count_aux,
                          HookType.AROUND)


def _register_refusal(error: Exception) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from sgl_kvq.config import is_kvq_dtype

    def refuse(orig, *args, **kwargs):
        if is_kvq_dtype(kwargs.get("server_args_kv_cache_dtype")):
            raise RuntimeError(str(error))
        return orig(*args, **kwargs)

    HookRegistry.register("sglang.srt.mem_cache.kv_cache_dtype.configure_kv_cache_dtype", refuse, HookType.AROUND)
