"""A grammar error planted in one request at run time, and the step loop that runs an
engine dry collecting what finished and what failed: shared by the tests of a request
that fails alone (batch jobs, one engine, attention data-parallel ranks)."""

from __future__ import annotations

from batchgen.engine.engine_core import RequestsFailed
from batchgen.engine.structured import StructuredOutputs


def grammar_fails_for(monkeypatch, poison: str, after: int = 3) -> list[int]:
    """StructuredOutputs.advance raises for request `poison` once it has taken `after`
    tokens, as a grammar error at run time would (in this process only: a spawned rank's
    grammar is its own); returns the tokens it took."""
    real = StructuredOutputs.advance
    taken: list[int] = []

    def advance(self, request_ids, token_ids):
        if poison in request_ids:
            taken.append(1)
            if len(taken) > after:
                raise RuntimeError("planted matcher error")
        return real(self, request_ids, token_ids)

    monkeypatch.setattr(StructuredOutputs, "advance", advance)
    return taken


def step_until_done(engine) -> tuple[list[str], list[RequestsFailed]]:
    """Steps `engine` until nothing is left: the ids of the requests its steps finished,
    and each RequestsFailed a step raised."""
    finished, failures = [], []
    while engine.has_unfinished:
        try:
            finished += [r.request_id for r in engine.step()]
        except RequestsFailed as e:
            failures.append(e)
    return finished, failures
