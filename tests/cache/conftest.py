import json
import os

PROBES = []  # (probe, outcome, message) appended by tests/cache/test_probes.py


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("PROBE_TABLE")  # the test harness's own switch: where to write the outcome table
    if path and PROBES:
        with open(path, "w") as f:
            json.dump([{"probe": p, "outcome": o, "message": m} for p, o, m in PROBES], f, indent=1)
