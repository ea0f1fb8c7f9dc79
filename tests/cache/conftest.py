import json
import os
import shutil

import pytest

PROBES = []  # (probe, outcome, message) appended by tests/cache/test_probes.py


@pytest.fixture(scope="module")
def built_cache(request, tmp_path_factory):
    """The test module's small cache, built once by the module's own build(out) (the settings its tests rebuild
    with), and the snapshot of its bytes."""
    from test_cache_resume import snapshot
    d = tmp_path_factory.mktemp("built") / "cache"
    request.module.build(d)
    return d, snapshot(d)


@pytest.fixture
def cache(built_cache, tmp_path):
    """A copy of the module's built cache for one test to corrupt or rebuild (the build is deterministic: the copy
    holds the bytes a fresh build would write)."""
    d = tmp_path / "cache"
    shutil.copytree(built_cache[0], d)
    return d


@pytest.fixture
def cache_bytes(built_cache):
    """{relative path: bytes} of the intact built cache."""
    return built_cache[1]


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("PROBE_TABLE")  # the test harness's own switch: where to write the outcome table
    if path and PROBES:
        with open(path, "w") as f:
            json.dump([{"probe": p, "outcome": o, "message": m} for p, o, m in PROBES], f, indent=1)
