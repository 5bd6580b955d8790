"""EOS ids listed only in an HF checkpoint's generation_config.json end generation, as
in transformers (an id or a list of ids); a GGUF model is not asked for one."""

from __future__ import annotations

import json
import random

import pytest
from conftest import save_tiny_model
from parity import reference_greedy

from batchgen import LLM, SamplingParams
from batchgen.engine import limits

# a fixed pool: a planned one for this tiny model on a GPU is tens of millions of pages,
# slow to build
KW = dict(device="cpu", dtype="float32", page_size=4, max_model_len=96, num_kv_pages=256)


def _prompts(n: int) -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randint(3, 500) for _ in range(rng.randint(2, 20))] for _ in range(n)]


def _set_generation_eos(path, eos) -> None:
    file = path / "generation_config.json"
    generation = json.loads(file.read_text())
    generation["eos_token_id"] = eos
    file.write_text(json.dumps(generation))


@pytest.mark.parametrize("as_list", [True, False])
def test_generation_config_eos_ends_requests(tmp_path, as_list, engine_device):
    ref = save_tiny_model(tmp_path, "LlamaForCausalLM")  # config.json: eos_token_id 2
    prompts = _prompts(6)
    params = SamplingParams(temperature=0, max_tokens=16)
    kw = dict(KW, device=engine_device)
    free = LLM(model=str(tmp_path), **kw).generate(prompts, params, use_tqdm=False)
    extra = free[0].outputs[0].token_ids[5]  # a token the first output reaches midway
    assert extra != 2
    _set_generation_eos(tmp_path, [2, extra] if as_list else extra)
    llm = LLM(model=str(tmp_path), **kw)
    assert extra in llm.engine.eos_token_ids
    outs = llm.generate(prompts, params, use_tqdm=False)
    ended = 0
    for prompt, out in zip(prompts, outs):
        done = out.outputs[0]
        expected, _ = reference_greedy(ref, prompt, 16, [2, extra])
        assert done.token_ids == expected
        if done.token_ids[-1] == extra:
            ended += 1
            assert done.finish_reason == "stop" and done.stop_reason is None
    assert ended >= 1


def test_generation_eos_reads_hf_directories_only(tmp_path):
    assert limits.generation_eos(None) is None
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    assert limits.generation_eos(hf) is None  # no generation_config.json
    (hf / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 9]}))
    assert limits.generation_eos(hf) == [5, 9]
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    assert limits.generation_eos(gguf) is None
