"""batchgen in a Ray Data pipeline (api/ray_data.py): rows with their own prompts and
sampling parameters come back once each, with what LLM.generate / LLM.chat answers them."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen import LLM, SamplingParams
from batchgen.api.ray_data import EngineStage, ProcessorConfig, build_processor, engine_gpus

ENGINE = dict(device="cpu", dtype="float32", max_model_len=64, page_size=4)


def _row(i: int) -> dict:
    """Row i: greedy or seeded sampling, its own max_tokens, a prompt in words."""
    words = " ".join(f"w{3 + (i * k) % 500}" for k in (7, 13, 29)[: 1 + i % 3])
    params = {"max_tokens": 2 + i % 5, "temperature": 0.0}
    if i % 2:
        params.update(temperature=0.8, top_p=0.9, seed=i)
    return {"id": i, "prompt": words, "sampling_params": params}


def _table(rows: list[dict]) -> pa.Table:
    """rows as one table whose columns are every row's (None where a row has none), as
    a dataset read from a file has them."""
    names = list(dict.fromkeys(k for r in rows for k in r))
    return pa.Table.from_pylist([{k: r.get(k) for k in names} for r in rows])


def _reference(llm: LLM, rows: list[dict]) -> list:
    return llm.generate(
        [r["prompt"] for r in rows],
        [SamplingParams(**r["sampling_params"]) for r in rows],
        use_tqdm=False,
    )


def test_a_batch_of_mixed_rows_answers_as_generate_and_chat(tiny_llama):
    stage = EngineStage(tiny_llama, ENGINE, sampling_params={"max_tokens": 3})
    rows = [_row(i) for i in range(6)]
    rows[1] = {"id": 1, "prompt_token_ids": [5, 6, 7], "sampling_params": {"temperature": 0.0}}
    chat = [{"role": "user", "content": "w40 w41"}]
    rows[4] = {"id": 4, "messages": chat, "sampling_params": {"seed": 3, "temperature": 1.0}}
    out = stage(_table(rows)).to_pylist()

    llm = LLM(model=tiny_llama, **ENGINE)
    assert [r["id"] for r in out] == list(range(6))
    plain = [0, 2, 3, 5]
    ref = dict(zip(plain, _reference(llm, [rows[i] for i in plain])))
    # rows 1 and 4 give no max_tokens: the config's 3 fills in
    ref[1] = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=3))[0]
    ref[4] = llm.chat(chat, SamplingParams(seed=3, temperature=1.0, max_tokens=3))[0]
    for row in out:
        want = ref[row["id"]]
        sample = want.outputs[0]
        assert row["generated_tokens"] == sample.token_ids, row["id"]
        assert row["generated_text"] == sample.text
        assert row["finish_reason"] == sample.finish_reason
        assert row["num_input_tokens"] == len(want.prompt_token_ids)
        assert row["num_generated_tokens"] == len(sample.token_ids)


@pytest.mark.parametrize(
    "row, message",
    [
        ({"id": 0}, "needs exactly one of prompt, prompt_token_ids, messages"),
        (
            {"id": 0, "prompt": "w5", "prompt_token_ids": [5]},
            "it has ['prompt', 'prompt_token_ids']",
        ),
        ({"id": 0, "prompt": "w5", "sampling_params": {"n": 2}}, "asks n=2"),
    ],
)
def test_a_row_that_is_no_single_request_fails_naming_it(tiny_llama, row, message):
    stage = EngineStage(tiny_llama, ENGINE)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        stage(_table([{"id": 1, "prompt": "w4"}, row]))


def test_an_actor_asks_for_its_engines_gpus():
    assert engine_gpus({}) == 1
    assert engine_gpus({"tensor_parallel_size": 4}) == 4
    # attention data parallel with expert parallel is one engine over tp x dp ranks
    ep = {"tensor_parallel_size": 1, "data_parallel_size": 8, "enable_expert_parallel": True}
    assert engine_gpus(ep) == 8
    assert engine_gpus({"tensor_parallel_size": 2, "data_parallel_size": 4}) == 2


@pytest.mark.slow
def test_a_parquet_file_of_1000_rows_comes_back_once_each_as_generate_answers(
    tmp_path, tiny_llama, local_ray
):
    rows = [_row(i) for i in range(1000)]
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    config = ProcessorConfig(model=tiny_llama, engine_kwargs=ENGINE, concurrency=2, batch_size=128)
    processor = build_processor(
        config, postprocess=lambda row: {"id": row["id"], "tokens": row["generated_tokens"],
                                         "finish": row["finish_reason"]}
    )  # fmt: skip
    # eight blocks: both engines get batches
    ds = local_ray.data.read_parquet(str(path)).repartition(8)
    got = processor(ds).take_all()

    assert sorted(r["id"] for r in got) == list(range(1000))
    want = _reference(LLM(model=tiny_llama, **ENGINE), rows)
    by_id = {r["id"]: r for r in got}
    for i, out in enumerate(want):
        assert list(by_id[i]["tokens"]) == out.outputs[0].token_ids, i
        assert by_id[i]["finish"] == out.outputs[0].finish_reason
