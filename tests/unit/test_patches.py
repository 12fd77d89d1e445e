"""patches/ (sgl_kvq.patches): every SGLang symbol it hooks or imports exists in the installed SGLang, load() places
each hook of targets.HOOKS once (a second load adds none), a failed version check keeps the kvq dtypes registered
and refuses them with its reason, and SGLang's `--kv-cache-dtype` gains every kvq dtype name."""

from __future__ import annotations

import argparse
import importlib

import pytest

from plugin_process import loaded_plugin
from sgl_kvq import patches
from sgl_kvq.config import ALL_DTYPE_NAMES
from sgl_kvq.patches import cli_args, targets


def test_every_target_and_import_resolves_in_the_installed_sglang():
    targets.check()  # raises SGLangVersionError naming each missing symbol


def test_a_missing_symbol_is_named_by_the_check(monkeypatch):
    monkeypatch.setattr(targets, "IMPORTED", targets.IMPORTED + ("sglang.srt.mem_cache.memory_pool.NoSuchPool",))
    with pytest.raises(targets.SGLangVersionError, match=r"memory_pool\.NoSuchPool is missing"):
        targets.check()


def test_every_hook_is_a_function_of_its_patches_module():
    from sglang.srt.plugins.hook_registry import HookType

    for target, module, function, kind in targets.HOOKS:
        assert callable(getattr(importlib.import_module(f"sgl_kvq.patches.{module}"), function)), target
        assert kind in HookType.__members__, target
    assert len({t for t, *_ in targets.HOOKS}) == len(targets.HOOKS), "a target hooked twice"


def test_load_places_each_hook_once_and_a_second_load_adds_none():
    run = loaded_plugin()
    assert run["error"] == ""
    expected = {targets.CLI_HOOK: [["AFTER", "sgl_kvq.patches.cli_args", "extend_kv_cache_dtype_choices"]]}
    for target, module, function, kind in targets.HOOKS:
        expected[target] = [[kind, f"sgl_kvq.patches.{module}", function]]
    ours = {t: [h for h in hooks if h[1].startswith("sgl_kvq.")] for t, hooks in run["hooks"].items()}
    assert {t: h for t, h in ours.items() if h} == expected
    assert run["after_first_load"] == {t: len(h) for t, h in run["hooks"].items()}


def test_a_failed_version_check_refuses_kvq_dtypes_with_its_reason(monkeypatch):
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    placed = []
    monkeypatch.setattr(HookRegistry, "register", lambda target, hook, kind, **kw: placed.append((target, hook, kind)))
    monkeypatch.setattr(patches, "_state", {"loaded": False, "error": None})
    error = targets.SGLangVersionError("sgl_kvq cannot hook this SGLang: sglang 9.9 is installed")

    def fail():
        raise error

    monkeypatch.setattr(targets, "check", fail)
    patches.load()
    assert patches._state["error"] is error
    assert [(t, k) for t, _, k in placed] == [(targets.CLI_HOOK, HookType.AFTER),
                                             ("sglang.srt.mem_cache.kv_cache_dtype.configure_kv_cache_dtype",
                                              HookType.AROUND)]
    refuse = placed[1][1]
    with pytest.raises(RuntimeError, match="sglang 9.9 is installed"):
        refuse(lambda **kw: "served", server_args_kv_cache_dtype="kivi2")
    assert refuse(lambda **kw: "served", server_args_kv_cache_dtype="bf16") == "served"


def test_kv_cache_dtype_gains_every_kvq_dtype_name():
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    (action,) = [a for a in parser._actions if a.dest == "kv_cache_dtype"]
    # SGLang's own names: a test before this one in the worker may have loaded the plugin, whose hook already added
    # the kvq names to this parser, after SGLang's
    sglang_choices = [c for c in action.choices if c not in ALL_DTYPE_NAMES]
    assert list(action.choices) in (sglang_choices, sglang_choices + list(ALL_DTYPE_NAMES))
    assert cli_args.extend_kv_cache_dtype_choices("result", parser) == "result"
    cli_args.extend_kv_cache_dtype_choices(None, parser)  # SGLang may build its parser twice: no name twice
    assert action.choices == sglang_choices + list(ALL_DTYPE_NAMES)
    assert parser.parse_args(["--model-path", "m", "--kv-cache-dtype", "kivi2"]).kv_cache_dtype == "kivi2"
    assert "kivi2" in action.help
