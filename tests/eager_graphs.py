"""CUDA graphs' decode path on the CPU: DecodeGraphs whose "graphs" replay the captured
forward eagerly on the static buffers, so what a replay is given (padded buckets, the
split plan, state slots) is tested without a GPU."""

from __future__ import annotations


def install_eager_graphs(llm, run: dict, **graph_kw) -> list[int]:
    """Give llm's runner DecodeGraphs (Triton backend, a fixed split count of 2, for its
    eager steps too) whose replays run eagerly (_EagerGraph); returns the bucket sizes
    replayed, as they happen. graph_kw: DecodeGraphs' optional arguments."""
    from batchgen.runner.cuda_graphs import DecodeGraphs

    engine, runner = llm.engine, llm.engine.runner
    graphs = DecodeGraphs(
        engine.model,
        runner.kv_caches,
        "triton",
        run["max_num_seqs"],
        run["max_model_len"] // run["page_size"],
        engine.hf_config.hidden_size,
        engine.device,
        engine.dtype,
        lambda n: 2,
        **graph_kw,
    )
    graphs.graphs = {bs: _EagerGraph(graphs, bs) for bs in graphs.buckets}
    runner.graphs, runner.split_plan = graphs, lambda n: 2
    replays = []
    forward = graphs._forward
    graphs._forward = lambda bs: replays.append(bs) or forward(bs)
    return replays


class _EagerGraph:
    """Stands in for a captured CUDA graph on the CPU: replay runs the captured forward
    eagerly on the static buffers, so the graph path's inputs are what is tested."""

    def __init__(self, graphs, bs: int) -> None:
        self.graphs, self.bs = graphs, bs

    def replay(self) -> None:
        self.graphs._forward(self.bs)
