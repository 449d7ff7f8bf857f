"""The cores' bound of a run (hybridagg.train.usage)."""

from __future__ import annotations

import time

import pytest

from hybridagg.train.usage import cores_bound, machine_usage


def test_cores_count_each_machine_once():
    reports = [
        {"role": "worker", "cpu_s": 3.0, "machine": "m1", "cores": 2},
        {"role": "worker", "cpu_s": 1.0, "machine": "m1", "cores": 2},
        {"role": "server", "cpu_s": 2.0, "machine": "m2", "cores": 4},
        {"role": "worker"},  # a report from before the field: left out
    ]
    cpu, cores, bound = cores_bound(reports, samples=600)
    assert (cpu, cores) == (6.0, 6)
    assert bound == pytest.approx(600 / (6.0 / 6))


def test_no_cpu_no_bound():
    assert cores_bound([], 10) == (0, 0, None)


def test_machine_usage_counts_this_processs_cpu():
    cpu0 = time.process_time()
    t = time.perf_counter()
    while time.perf_counter() - t < 0.05:  # 50 ms of CPU
        pass
    usage = machine_usage(cpu0)
    assert usage["cpu_s"] >= 0.02 and usage["cores"] >= 1 and usage["machine"]
    assert machine_usage(cpu0)["machine"] == usage["machine"]
