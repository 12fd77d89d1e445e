"""SGLang's own server test kits (sglang/test/kits/, unmodified; bench/commands/bench_conformance.py says which,
with what sizes and offline data) against SmolLM2 served in bf16 and in kvq dtypes, each server at the same pinned
KV budget: a kvq dtype passes every kit test bf16 passes (tests/helpers/conformance.py: the dtypes and the rule). A kit
test bf16 fails (SmolLM2-135M is small: it does not answer 17 x 23) is an expected failure for every dtype.
`sgl-kvq bench conformance` runs the same kits over the full matrix and writes the JSON."""

from __future__ import annotations

import contextlib

import pytest

from conformance import LazyBaseline, against_baseline, dtypes, kit_tests, pinned_server, record
from bench.commands import bench_conformance as bc

pytestmark = [pytest.mark.slow, pytest.mark.engine]



@pytest.fixture(scope="session")
def smollm2_model():
    from bench.models import smollm2

    return smollm2()


@pytest.fixture(scope="session")
def kit_files(smollm2_model, tmp_path_factory):
    return bc.prepare_offline_data(smollm2_model, tmp_path_factory.mktemp("kit-data"))


@pytest.fixture(scope="module", autouse=True)
def offline_kit_data(kit_files):
    """The kits read their offline data (the KL kit's prompts) while any kit test of this module runs."""
    with bc.offline_kits(kit_files):
        yield


@pytest.fixture
def kit_classes(conformance_server, smollm2_model, kit_files):
    dtype, server = conformance_server
    return dtype, bc.kit_classes(server, smollm2_model, kit_files)


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
@pytest.mark.parametrize("conformance_server", dtypes(), indirect=True)
def test_kvq_dtype_passes_every_kit_test_bf16_passes(conformance_server, kit_classes, bf16_kit_rows, kit_test):
    dtype, classes = kit_classes
    row = run_kit_test(classes, kit_test)
    record("kits", dtype, kit_test, row)
    against_baseline(bf16_kit_rows, dtype, kit_test, row)
