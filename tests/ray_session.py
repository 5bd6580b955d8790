"""A local Ray cluster for the tests that run engines as Ray actors."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import pytest


@contextmanager
def local_ray_cluster(num_cpus: int = 4) -> Iterator:
    """Ray started on a cluster of its own (address="local": never one another process on
    this machine started) of num_cpus logical CPUs, its actors one thread each; the ray
    module inside, shut down after. Ray is the one optional extra: without it the test
    that asked for it skips."""
    ray = pytest.importorskip("ray")
    old = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the actors' processes
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()
        if old is None:
            os.environ.pop("OMP_NUM_THREADS")
        else:
            os.environ["OMP_NUM_THREADS"] = old
