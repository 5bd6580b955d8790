"""A group's ranks 1..N-1 as Ray actors, so that one engine spans the hosts of a Ray
cluster (distributed_executor_backend="ray", as in vLLM). Imported only under that
option: Ray is an optional extra (pip install 'batchgen[ray]').

    rank 0 (the driver)                       a placement group of N bundles, PACK:
      ray.init() unless connected             {GPU: 1} each (NCCL) or {CPU: 1} (gloo),
      bundle 0 on this node, for rank 0       bundle 0 on the driver's node, the rest
        (GPUs: a holder actor takes its GPU,  wherever they fit, over several nodes
        rank 0 then runs on it)               where one does not hold them all
      rank r: a _Rank actor in bundle r       its node recorded (ip, node id), then
        run(entry, args) -> a future          entry(*args): the rank's whole life, on
                                              its GPU among its node's, all visible
      wait: ray.wait on the run futures       an actor killed, or its node lost: its
                                              future fails (ActorDiedError) at once

The ranks meet at rank 0's TCPStore on this node's IP (`host`), then talk in
torch.distributed collectives as processes of one host do (workers.py): NCCL for the
tensors, gloo for rank 0's messages. Every host must have batchgen, its dependencies and
the model's files at the same path (the ranks load their shares themselves); gloo and
NCCL pick the network interface by the host's name (GLOO_SOCKET_IFNAME,
NCCL_SOCKET_IFNAME otherwise).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Collection

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from batchgen.distributed.rank_set import RankSet

logger = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 120.0  # the cluster's free resources to hold every rank
NODE_LABEL = "ray.io/node-id"  # the label Ray gives each node: its id
# Ray leaves an actor's CUDA_VISIBLE_DEVICES as its node's, instead of the actor's one GPU:
# NCCL on NVSwitch nodes (H100/H200) is slow to import peers' memory, and its NVLS
# collectives can hang, between processes that each see one GPU (NVIDIA/nccl#1749,
# #1906; ray-project/ray#61073); torchrun's ranks, and vLLM's Ray workers, see them all
NOSET_VISIBLE = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"


class _Rank:
    """One rank's actor: where it runs, then its life (`run` returns when it ends)."""

    def where(self) -> tuple[str, str]:
        return ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id()

    def run(self, entry: Callable[..., None], args: tuple, gpu: bool) -> None:
        """entry(*args, device=...): the torch index of the GPU Ray gave this actor,
        among all of its node's GPUs, which it sees (NOSET_VISIBLE), or None."""
        entry(*args, device=local_index(str(ray.get_gpu_ids()[0])) if gpu else None)


class _Holder:
    """Holds rank 0's bundle (its GPU: no rank's actor is given it) and says which."""

    def gpu(self) -> str:
        return str(ray.get_gpu_ids()[0])


class RayRanks(RankSet):
    """The ranks as actors of a placement group (`group`; `actors`, `runs`, rank 1
    first; `nodes`: rank -> (node ip, node id)). A rank's status: "returned", or what
    ended its actor (killed, its node lost, the error it raised)."""

    grace_s = 10.0  # the actor's death reaches the driver through Ray's control store

    def __init__(
        self, size: int, backend: str, role: str, placement_timeout_s: float = PLACEMENT_TIMEOUT_S
    ) -> None:
        super().__init__(size, backend, role)
        if not ray.is_initialized():
            ray.init(include_dashboard=False)  # a cluster's address from RAY_ADDRESS, if set
        self.host = ray.util.get_node_ip_address()
        self.gpus = backend == "nccl"
        self.placement_timeout_s = placement_timeout_s
        self.group = None
        self.actors: list = []
        self.runs: list = []
        self.nodes: dict[int, tuple[str, str]] = {}
        self._holder = None

    def start(self, entry: Callable[..., None], args: dict[int, tuple]) -> None:
        bundle = {"GPU": 1.0} if self.gpus else {"CPU": 1.0}
        here = ray.get_runtime_context().get_node_id()
        self.group = placement_group(
            [dict(bundle) for _ in range(self.size)],
            strategy="PACK",
            bundle_label_selector=[{NODE_LABEL: here}] + [{}] * (self.size - 1),
        )
        try:
            ray.get(self.group.ready(), timeout=self.placement_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(
                f"Ray could not place {self.size} {self.role} ranks ({bundle} each, rank "
                f"0's on this node) within {self.placement_timeout_s:.0f} s; the cluster "
                f"has {ray.cluster_resources()} in all, {ray.available_resources()} free"
            ) from None
        if self.gpus:
            self._holder = self._actor(_Holder, 0).remote()
            self.local_device = local_index(ray.get(self._holder.gpu.remote()))
        self.actors = [self._actor(_Rank, rank).remote() for rank in self.ranks]
        self.nodes = dict(zip(self.ranks, ray.get([a.where.remote() for a in self.actors])))
        self.runs = [
            actor.run.remote(entry, args[rank], self.gpus)
            for rank, actor in zip(self.ranks, self.actors)
        ]
        logger.info(
            "%s ranks 1..%d on Ray nodes %s (rank 0 on %s)",
            self.role,
            self.size - 1,
            sorted({ip for ip, _ in self.nodes.values()}),
            self.host,
        )

    def _actor(self, cls: type, bundle: int):
        one = {"num_gpus": 1, "num_cpus": 0} if self.gpus else {"num_gpus": 0, "num_cpus": 1}
        if self.gpus:  # every GPU of its node visible, its own picked by index
            one["runtime_env"] = {"env_vars": {NOSET_VISIBLE: "1"}}
        strategy = PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=bundle)
        return ray.remote(cls).options(scheduling_strategy=strategy, max_restarts=0, **one)

    def wait(self, ranks: Collection[int], timeout: float | None) -> dict[int, object]:
        refs = {self.runs[r - 1]: r for r in ranks if r <= len(self.runs)}
        if not refs:
            return {}
        ready, _ = ray.wait(list(refs), num_returns=1, timeout=timeout)
        if ready:  # every one that has ended by now, not only the first
            ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0)
        return {refs[ref]: _status(ref) for ref in ready}

    def describe(self, ended: dict[int, object]) -> str:
        parts = []
        for rank, status in sorted(ended.items()):
            ip, node = self.nodes.get(rank, ("?", "?"))
            parts.append(f"{rank} on node {ip} (id {node[:12]}): {status}")
        return "ended (rank, where: how) " + "; ".join(parts)

    def kill(self, rank: int) -> None:
        ray.kill(self.actors[rank - 1], no_restart=True)

    def stop(self, timeout_s: float) -> None:
        if not ray.is_initialized():
            return
        if self.runs:
            ray.wait(self.runs, num_returns=len(self.runs), timeout=timeout_s)
        for actor in [*self.actors, self._holder]:
            if actor is not None:
                ray.kill(actor)
        if self.group is not None:
            remove_placement_group(self.group)
        self.actors, self._holder, self.group = [], None, None


def local_index(gpu_id: str, visible: str | None = None) -> int:
    """The torch index, in this process, of the GPU Ray calls `gpu_id` (Ray numbers a
    node's GPUs as CUDA_VISIBLE_DEVICES lists them where it is set; `visible`: that
    variable, read from the environment when None)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
    if not visible:
        return int(gpu_id)
    listed = [v.strip() for v in visible.split(",")]
    if gpu_id not in listed:
        raise RuntimeError(
            f"Ray gave rank 0 GPU {gpu_id}, which this process does not see "
            f"(CUDA_VISIBLE_DEVICES={visible}): start Ray on this node with the same "
            "CUDA_VISIBLE_DEVICES as the driver"
        )
    return listed.index(gpu_id)


def _status(ref) -> str:
    """How a rank's run ended, in one line."""
    try:
        ray.get(ref, timeout=0)
    except ray.exceptions.RayTaskError as e:
        return f"raised {e.cause!r}"
    except ray.exceptions.RayActorError as e:
        # the lines that say why (killed, node died, out of memory), not the actor's ids
        lines = [s.strip() for s in str(e).splitlines() if s.strip() and not s[:1].isspace()]
        return "its actor died: " + " ".join(lines).rstrip(".")
    except ray.exceptions.RayError as e:  # its arguments did not unpickle there, ...
        return f"failed: {e}"
    return "returned"
