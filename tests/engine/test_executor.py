"""One rank and tensor parallel answer the engine through one interface (engine/executor.py),
so the builder and EngineCore never ask whether workers exist."""

from __future__ import annotations

import inspect

from batchgen import LLM, SamplingParams
from batchgen.engine.executor import Executor, OneRank
from batchgen.engine.tensor_parallel import TPModelRunner
from batchgen.engine.tp_peers import TPWorkers
from batchgen.runner.model_runner import ModelRunner


def _methods(cls) -> dict[str, list[str]]:
    """The protocol's methods as `cls` defines them: name -> the parameters a caller must
    pass."""
    wanted = [n for n, v in vars(Executor).items() if callable(v) and not n.startswith("_")]
    out = {}
    for name in wanted:
        params = inspect.signature(getattr(cls, name)).parameters.values()
        out[name] = [p.name for p in params if p.default is inspect.Parameter.empty]
    return out


def test_one_rank_and_tensor_parallel_share_the_executor_interface():
    one, tp = _methods(OneRank), _methods(TPWorkers)
    assert set(one) == {
        "runner_args",
        "send",
        "plan_begin",
        "plan_pages",
        "reconfigure",
        "tier_metrics",
        "step_metrics",
        "shutdown",
    }
    assert one == tp  # the same names, the same parameters to pass
    assert (OneRank.runner_cls, TPWorkers.runner_cls) == (ModelRunner, TPModelRunner)


def test_one_rank_has_no_one_to_tell_ask_or_stop():
    rank = OneRank()
    assert rank.size == 1 and rank.runner_args(None) == {}
    assert rank.plan_pages() == [] and rank.reconfigure(8, None) == []
    assert rank.tier_metrics(None) == []


def test_a_one_rank_engine_runs_through_one_rank(tiny_llama):
    llm = LLM(tiny_llama, device="cpu", dtype="float32", num_kv_pages=64, max_model_len=256)
    engine = llm.engine
    assert isinstance(engine.executor, OneRank) and type(engine.runner) is ModelRunner
    out = llm.generate(["w1 w2"], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    assert engine.tier_worker_metrics() == []
    engine.reconfigure(48)  # through OneRank.reconfigure: no other rank to re-make
    assert engine.pool.num_pages == 48
    engine.shutdown()
    engine.shutdown()  # a second call does nothing
