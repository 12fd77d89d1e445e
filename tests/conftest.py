"""Shared test setup. Imported before any test module, so the Triton switch below precedes every triton import."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch


def _use_triton_interpreter_without_cuda() -> bool:
    """Without a GPU every Triton launch fails ("0 active drivers") unless TRITON_INTERPRET=1; then kernels run on
    CPU tensors. A value the caller set is kept."""
    if not torch.cuda.is_available():
        assert "triton" not in sys.modules, "triton was imported before tests/conftest.py could set TRITON_INTERPRET"
        os.environ.setdefault("TRITON_INTERPRET", "1")
    return os.environ.get("TRITON_INTERPRET") == "1"


TRITON_INTERPRET = _use_triton_interpreter_without_cuda()


@pytest.fixture(scope="session")
def triton_interpret() -> bool:
    """True when Triton kernels run in the interpreter (CPU): keep shapes small and blocks large there."""
    return TRITON_INTERPRET


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def venv_bin() -> Path:
    """The bin/ folder of the interpreter running the tests (the project venv under `make test`)."""
    return Path(sys.executable).parent


@pytest.fixture(scope="session")
def frontend_fork():
    """fn(base_url, text) -> [(answer, meta_info)] per branch: SGLang's frontend language against a running server,
    a shared prefix forked into two generated branches."""
    return _frontend_fork


def _frontend_fork(base_url: str, text: str) -> list[tuple[str, dict]]:
    import sglang as sgl

    @sgl.function
    def two_branches(s, text):
        s += text
        forks = s.fork(2)
        for i, f in enumerate(forks):
            f += f" branch {i}:" + sgl.gen("answer", max_tokens=8, temperature=0)
        s["branches"] = [(f["answer"], f.get_meta_info("answer")) for f in forks]

    return two_branches.run(text=text, backend=sgl.RuntimeEndpoint(base_url))["branches"]



@pytest.fixture(scope="session")
def conformance_server(request, tmp_path_factory):
    """(dtype, server): SmolLM2 served in a kvq dtype (indirect parameter) at the conformance budget, one server per
    dtype for the session, shared by the kit and client conformance tests (a SmolLM2 start takes 45-60 s on CI)."""
    from conformance import pinned_server
    from bench.models import smollm2

    dtype = request.param
    with pinned_server(smollm2(), dtype, tmp_path_factory.mktemp(f"conformance-{dtype}") / "server.log") as server:
        yield dtype, server


# The modules whose tests share session servers (conformance_server): one pytest-xdist worker runs them all, or each
# worker would start its own SmolLM2 server per dtype.
SHARED_SERVER_MODULES = {"test_conformance_kits.py", "test_conformance_clients.py"}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile` (make test) with SHARED_SERVER_MODULES as one unit. (pytest-xdist 3.8's loadgroup marks do
    not reach pytest 9's node ids, so the grouping is done here, in the scheduler.)"""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return "shared-servers" if Path(module).name in SHARED_SERVER_MODULES else module

    return ModuleScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    """Mark the documented expected failures xfail(strict=True) (tests/data/expected_failures.json, read at
    collection: conformance.mark_documented_failures)."""
    from conformance import mark_documented_failures

    mark_documented_failures(items)
