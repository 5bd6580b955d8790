"""One local Ray cluster for every test that runs engines as Ray actors."""

from __future__ import annotations

import os

import pytest


class SharedLocalRay:
    """A local Ray cluster (address="local": never one another process on this machine
    started) of num_cpus logical CPUs, its actors one thread each, started the first time
    a test asks for it and kept for the tests after: Ray's start-up (tens of seconds on
    two cores) is paid once a session, not once a module. A test that shuts Ray down (the
    two-node tests of tests/distributed/test_ray_ranks.py start a cluster of their own)
    gets the next asker a fresh one. Ray is the one optional extra: without it the test
    that asked skips."""

    def __init__(self, num_cpus: int = 4) -> None:
        self.num_cpus = num_cpus
        self.starts = 0  # how many clusters this session has started

    def ensure(self):
        """The ray module, a cluster of this shape running."""
        ray = pytest.importorskip("ray")
        if ray.is_initialized():
            return ray
        old = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"  # the raylet's, which its workers inherit
        try:
            ray.init(
                address="local",
                num_cpus=self.num_cpus,
                include_dashboard=False,
                log_to_driver=False,
            )
        finally:  # the session's other tests (and their subprocesses) keep their own
            if old is None:
                os.environ.pop("OMP_NUM_THREADS")
            else:
                os.environ["OMP_NUM_THREADS"] = old
        self.starts += 1
        return ray

    def close(self) -> None:
        """Shut Ray down if it runs (the session's end)."""
        if self.starts:
            import ray

            if ray.is_initialized():
                ray.shutdown()
