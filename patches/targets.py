"""Every SGLang 0.5.23 symbol sgl_kvq hooks or imports, checked when the plugin loads so a version change fails
loudly instead of silently serving bf16 (or garbage)."""

from __future__ import annotations

import importlib

from sgl_kvq import SGLANG_VERSION

HOOK_TARGETS = (
    "sglang.srt.server_args.ServerArgs.add_cli_args",
    "sglang.srt.mem_cache.kv_cache_dtype.configure_kv_cache_dtype",
    "sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator.__init__",
    "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._build_token_to_kv_pool",
    "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._profile_available_bytes",
    "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator.resolve_max_num_reqs",
    "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._apply_token_constraints",
    "sglang.srt.mem_cache.common.release_kv_cache",
    "sglang.srt.managers.scheduler_components.internal_state.SchedulerInternalStateController._add_memory_usage",
    "sglang.srt.model_executor.runner.eager_runner.EagerRunner._execute_decode",
    "sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler.build_kv_host_pool",
    "sglang.srt.disaggregation.mooncake.conn.MooncakeKVSender.__init__",
    "sglang.srt.disaggregation.prefill.SchedulerDisaggregationPrefillMixin.maybe_send_cached_prefix_chunk",
    "sglang.srt.disaggregation.utils.setup_state_kv_args",
    "sglang.srt.disaggregation.prefill.SchedulerDisaggregationPrefillMixin.send_kv_chunk",
    "sglang.srt.disaggregation.decode.DecodeTransferQueue._commit_transfer_to_req",
    "sglang.srt.distributed.device_communicators.mooncake_transfer_engine.MooncakeTransferEngine.batch_transfer_sync",
    "sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager.send_aux",
)
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
