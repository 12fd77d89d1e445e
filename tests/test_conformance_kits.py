"""SGLang's own server test kits (sglang/test/kits/, unmodified; sgl_kvq/commands/bench_conformance.py says which,
with what sizes and offline data) against SmolLM2 served in bf16 and in kvq dtypes, each server at the same pinned
KV budget: a kvq dtype passes every kit test bf16 passes (tests/conformance.py: the dtypes and the rule). A kit
test bf16 fails (SmolLM2-135M is small: it does not answer 17 x 23) is an expected failure for every dtype.
`sgl-kvq bench conformance` runs the same kits over the full matrix and writes the JSON."""

from __future__ import annotations

import contextlib

import pytest

from conformance import LazyBaseline, against_baseline, dtypes, kit_tests, pinned_server, record
from sgl_kvq.commands import bench_conformance as bc

pytestmark = [pytest.mark.slow, pytest.mark.engine]



@pytest.fixture(scope="session")
def smollm2_model():
    from sgl_kvq.models import smollm2

    return smollm2()


@pytest.fixture(scope="session")
def kit_files(smollm2_model, tmp_path_factory):
    return bc.prepare_offline_data(smollm2_model, tmp_path_factory.mktemp("kit-data"))


@pytest.fixture(scope="module", params=dtypes())
def kit_server(request, smollm2_model, kit_files, tmp_path_factory):
    """One server per dtype, started once for all its kit tests."""
    log = tmp_path_factory.mktemp(f"kits-{request.param}") / "server.log"
    with pinned_server(smollm2_model, request.param, log) as server, bc.offline_kits(kit_files):
        yield request.param, bc.kit_classes(server, smollm2_model, kit_files)


def run_kit_test(classes: dict, kit_test: str) -> dict:
    kit, name = kit_test.split(".", 1)
    return bc.run_kit_test(classes[kit], name)


@pytest.fixture(scope="module")
def bf16_kit_rows(smollm2_model, kit_files, tmp_path_factory):
    """bf16's kit rows, its server started at the first kit test a kvq dtype misses (the kits read their offline
    data through the kvq server's offline_kits, active while any kit test runs)."""

    @contextlib.contextmanager
    def start():
        with pinned_server(smollm2_model, "bf16", tmp_path_factory.mktemp("kits-bf16") / "server.log") as server:
            yield bc.kit_classes(server, smollm2_model, kit_files)

    baseline = LazyBaseline("kits", start, run_kit_test)
    yield baseline.row
    baseline.close()


@pytest.mark.parametrize("kit_test", kit_tests())
def test_kvq_dtype_passes_every_kit_test_bf16_passes(kit_server, bf16_kit_rows, kit_test):
    dtype, classes = kit_server
    row = run_kit_test(classes, kit_test)
    record("kits", dtype, kit_test, row)
    against_baseline(bf16_kit_rows, dtype, kit_test, row)
