"""A batch line in the engine: its sampling parameters and seeds, its samples as engine
requests, and its output line once every sample has finished.

    BatchItem ──prepare_line──> (prompt ids, params, one child per sample)
        │                          child i: seed = body seed + i, or
        │                          default_seed(run seed, custom_id, i)
        v
    InFlight.add ──> engine requests "<line>" (n = 1) or "<line>#<i>" (n > 1)
    InFlight.finished(request) ──> the line's Pending once all its samples are done

Invariant: a sample's seed depends on the run's seed, the line's custom_id and the
sample's index only, never on the line's position, its arrival in the engine or the
batch around it, so a resumed, reordered or sharded job draws the same noise.
"""

from __future__ import annotations

import dataclasses
import hashlib

from batchgen.api import batch_file as bf
from batchgen.api import batch_output as bo
from batchgen.api.parallel_sampling import child_params
from batchgen.engine.request import Request, RequestStatus
from batchgen.sampling_params import SamplingParams


def default_seed(run_seed: int, custom_id: str, index: int) -> int:
    """The seed of sample `index` of a line that gives no seed of its own (63 bits)."""
    digest = hashlib.blake2b(f"{run_seed}:{custom_id}:{index}".encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "little") >> 1


def prepare_line(llm, item: bf.BatchItem, defaults: dict, run_seed: int | None):
    """(prompt token ids, the line's SamplingParams, one SamplingParams per sample),
    checked by the engine; raises on a line the engine refuses (the caller writes its
    error record). A `max_tokens` the context cannot hold after the prompt is refused."""
    params = bf.sampling_params(item.body, item.url, defaults)
    ids = bf.encode(llm, item)
    children = child_params(params)
    if params.seed is None:
        base = run_seed or 0
        children = [
            dataclasses.replace(c, seed=default_seed(base, item.custom_id, i))
            for i, c in enumerate(children)
        ]
    what = f"request {item.custom_id!r}"
    engine = llm.engine
    engine.validate(ids, children[0], what)  # the children differ in seed and logprobs only
    asked = item.body.get("max_completion_tokens") or item.body.get("max_tokens")
    if type(asked) is int and len(ids) + asked > engine.max_model_len:
        raise ValueError(
            f"{what}: the prompt has {len(ids)} tokens and max_tokens is {asked}: "
            f"{len(ids) + asked} > max_model_len {engine.max_model_len}"
        )
    return ids, params, children


def request_id(line: int, index: int, samples: int) -> str:
    return str(line) if samples == 1 else f"{line}#{index}"


class InFlight:
    """Lines whose samples are in the engine, found by their engine request ids."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self._by_id: dict[str, tuple[bo.Pending, int]] = {}

    def __len__(self) -> int:
        """Engine requests in flight (a line of n samples counts n)."""
        return len(self._by_id)

    def add(
        self,
        item: bf.BatchItem,
        ids: list[int],
        params: SamplingParams,
        children: list[SamplingParams],
    ) -> bo.Pending:
        """Add one request per sample (consecutively: the first computes the prompt, the
        others hit its pages); all or none are added."""
        count = len(children)
        pending = bo.Pending(
            item.line,
            item.custom_id,
            item.url,
            params.logprobs,
            params=params if count > 1 else None,
            samples=[None] * count,
            digest=item.digest,
        )
        rids = [request_id(item.line, i, count) for i in range(count)]
        try:
            for i, (rid, child) in enumerate(zip(rids, children)):
                self.engine.add_request(rid, ids, child, validated=True)
                self._by_id[rid] = (pending, i)
        except BaseException:
            self.drop(pending)
            raise
        return pending

    def finished(self, req: Request) -> bo.Pending | None:
        """Record a finished sample; the line once all of its samples are done."""
        pending, index = self._by_id.pop(req.request_id)
        pending.samples[index] = req
        return pending if pending.done else None

    def pending_of(self, rid: str) -> bo.Pending | None:
        entry = self._by_id.get(rid)
        return None if entry is None else entry[0]

    def drop(self, pending: bo.Pending) -> None:
        """Take a line out: abort its samples still in the engine."""
        count = len(pending.samples)
        rids = [request_id(pending.line, i, count) for i in range(count)]
        rids = [rid for rid in rids if self._by_id.pop(rid, None) is not None]
        self.engine.abort(rids)

    def lines(self) -> list[bo.Pending]:
        """The lines in flight, in input order."""
        unique = {id(p): p for p, _ in self._by_id.values()}
        return sorted(unique.values(), key=lambda p: p.line)

    def not_started(self) -> list[bo.Pending]:
        """Lines with a sample the engine has not admitted to its running set (waiting,
        or preempted): they cannot finish without admitting it."""
        requests = self.engine.requests
        waiting = {
            id(p): p
            for rid, (p, _) in self._by_id.items()
            if (r := requests.get(rid)) is not None and r.status is not RequestStatus.RUNNING
        }
        return list(waiting.values())
