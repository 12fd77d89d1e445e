"""Every hook sgl_kvq places into SGLang 0.5.23, each target checked when the plugin loads (targets.py). The pool
and the attention backends are not hooks: they subclass SGLang's KVCache / AttentionBackend (sgl_kvq/pool.py,
sgl_kvq/backends/).

`load()` is the `sglang.srt.plugins` entry point: SGLang runs it in every process (launch_server, Engine, scheduler,
detokenizer). SGLang logs and swallows plugin exceptions, so a failed version check is re-raised where it matters:
the kvq dtypes stay registered and refuse to resolve with the reason.
"""

from __future__ import annotations

import importlib
import logging

logger = logging.getLogger("sgl_kvq")
_state = {"loaded": False, "error": None}


def load() -> None:
    if _state["loaded"]:
        return
    _state["loaded"] = True
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from sgl_kvq.patches import cli_args, targets

    HookRegistry.register(targets.CLI_HOOK, cli_args.extend_kv_cache_dtype_choices, HookType.AFTER)
    try:
        targets.check()
    except targets.SGLangVersionError as e:
        _state["error"] = e
        logger.error("%s", e)
        _register_refusal(e)
        return
    from sglang.srt.arg_groups.resolution_hooks import register_resolution_hook

    from sgl_kvq.patches import backends, resolution

    cli_args.register_backend_choices()
    backends.register()
    register_resolution_hook(targets.RESOLUTION_STEP)(resolution.resolve)
    for target, module, function, kind in targets.HOOKS:
        hook = getattr(importlib.import_module(f"sgl_kvq.patches.{module}"), function)
        HookRegistry.register(target, hook, getattr(HookType, kind))


def _register_refusal(error: Exception) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from sgl_kvq.config import is_kvq_dtype

    def refuse(orig, *args, **kwargs):
        if is_kvq_dtype(kwargs.get("server_args_kv_cache_dtype")):
            raise RuntimeError(str(error))
        return orig(*args, **kwargs)

    HookRegistry.register("sglang.srt.mem_cache.kv_cache_dtype.configure_kv_cache_dtype", refuse, HookType.AROUND)
