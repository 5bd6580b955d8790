"""Errors users hit: bad prompts, bad sampling values, bad arguments, broken checkpoints."""

from __future__ import annotations

import json
import logging
import math
import shutil

import pytest
from conftest import ARCHS, save_tiny_model

from batchgen import LLM, SamplingParams

VOCAB = 512  # tiny_config's vocab_size
MAX_LEN = 128
KW = dict(device="cpu", num_kv_pages=64, max_model_len=MAX_LEN)


def save_word_tokenizer(path) -> None:
    """A WordLevel tokenizer over the tiny vocab: "w5 w7" <-> [5, 7]."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="w0", pad_token="w0", bos_token="w1", eos_token="w2"
    ).save_pretrained(path)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_model(path, "LlamaForCausalLM")
    save_word_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model=str(model_dir), **KW)


@pytest.fixture
def broken(model_dir, tmp_path):
    """A fresh copy of the good checkpoint to damage."""
    path = tmp_path / "ckpt"
    shutil.copytree(model_dir, path)
    return path


def assert_idle(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.has_unfinished
    assert not engine.requests
    assert engine.kv.num_free_pages == engine.kv.allocator.num_pages


def assert_still_works(llm: LLM) -> None:
    out = llm.generate([[3, 4, 5]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert len(out) == 1 and len(out[0].outputs[0].token_ids) == 2
    assert_idle(llm)


GREEDY = SamplingParams(temperature=0, max_tokens=2)


# --- prompts ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "prompts, index",
    [
        ([[]], 0),
        ([[1, 2, 3], []], 1),
        ([[1, 2], {"prompt_token_ids": []}], 1),
        (["w5 w6", "w7", ""], 2),
    ],
)
def test_empty_prompt_names_its_index(llm, prompts, index):
    with pytest.raises(ValueError, match=rf"prompt {index}\b.*empty"):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_idle(llm)


def test_prompt_longer_than_max_model_len_starts_nothing(llm):
    too_long = [7] * (MAX_LEN + 5)
    with pytest.raises(ValueError, match=rf"prompt 2\b.*{MAX_LEN + 5} tokens.*max_model_len"):
        llm.generate([[1, 2, 3], [4, 5], too_long, [6]], GREEDY, use_tqdm=False)
    assert_idle(llm)
    assert_still_works(llm)


def test_prompt_of_exactly_max_model_len_is_refused(llm):
    with pytest.raises(ValueError, match=r"prompt 0\b.*max_model_len"):
        llm.generate([[7] * MAX_LEN], GREEDY, use_tqdm=False)
    assert_idle(llm)


def test_prompt_one_short_of_max_model_len_gets_one_token(llm):
    out = llm.generate(
        [[7] * (MAX_LEN - 1)], SamplingParams(temperature=0, max_tokens=None), use_tqdm=False
    )
    completion = out[0].outputs[0]
    assert len(completion.token_ids) == 1
    assert completion.finish_reason == "length"
    assert_idle(llm)


@pytest.mark.parametrize("bad", [VOCAB, VOCAB + 100, -1])
def test_token_id_outside_vocab(llm, bad):
    with pytest.raises(ValueError, match=rf"prompt 1\b.*token id {bad}\b.*vocabulary"):
        llm.generate([[1, 2], [3, bad, 4]], GREEDY, use_tqdm=False)
    assert_idle(llm)
    assert_still_works(llm)


@pytest.mark.parametrize("bad", [2.0, True, "7"], ids=["float", "bool", "str"])
def test_token_id_of_the_wrong_type(llm, bad):
    with pytest.raises(TypeError, match=rf"prompt 1\b.*token ids must be ints, got {bad!r}"):
        llm.generate([[1, 2], [3, bad, 4]], GREEDY, use_tqdm=False)
    assert_idle(llm)
    with pytest.raises(TypeError, match=r"request x\b.*must be ints"):
        llm.engine.add_request("x", [3, bad], GREEDY)
    assert_idle(llm)
    assert_still_works(llm)


def test_dict_prompt_without_a_known_key(llm):
    with pytest.raises(ValueError, match=r"prompt 1\b.*'prompt'"):
        llm.generate([[1, 2], {"text": "w5"}], GREEDY, use_tqdm=False)
    assert_idle(llm)


def test_prompt_of_the_wrong_type(llm):
    with pytest.raises(TypeError, match=r"prompt 1\b"):
        llm.generate([[1, 2], 3.5], GREEDY, use_tqdm=False)
    assert_idle(llm)


def test_the_vocab_edge_and_string_prompts_work(llm):
    out = llm.generate([[VOCAB - 1, 0], "w5 w6 w7"], GREEDY, use_tqdm=False)
    assert out[1].prompt_token_ids == [5, 6, 7]
    assert all(len(o.outputs[0].token_ids) == 2 for o in out)


# --- sampling parameters ---------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -1),
        ("temperature", math.nan),
        ("temperature", "hot"),
        ("top_p", 0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("top_k", 2.5),
        ("min_p", 2),
        ("min_p", -0.1),
        ("max_tokens", 0),
        ("max_tokens", 2.0),
        ("min_tokens", -1),
        ("logprobs", 99),
        ("logprobs", -1),
        ("stop", [""]),
        ("stop", ""),
        ("stop", [3]),
        ("stop_token_ids", [-1]),
        ("presence_penalty", 5),
        ("frequency_penalty", -3),
        ("repetition_penalty", 0),
        ("repetition_penalty", -1.0),
        ("seed", "x"),
        ("seed", 1.5),
        ("n", 0),
        ("best_of", 0),
        ("ignore_eos", "yes"),
    ],
)
def test_bad_sampling_value_names_the_field(field, value):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}\b"):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match=r"min_tokens.*max_tokens"):
        SamplingParams(min_tokens=5, max_tokens=3)


def test_good_sampling_edges_are_accepted():
    p = SamplingParams(
        temperature=0,
        top_p=1,
        top_k=-1,
        min_p=1,
        max_tokens=None,
        seed=3,
        logprobs=0,
        stop="x",
        presence_penalty=-2,
        repetition_penalty=0.5,
    )
    assert p.top_k == 0
    assert p.stop_strings == ["x"]
    assert SamplingParams(logprobs=20).logprobs == 20


@pytest.mark.parametrize("n_params", [0, 1, 3])
def test_sampling_params_list_of_the_wrong_length(llm, n_params):
    with pytest.raises(ValueError, match=rf"{n_params} SamplingParams for 2 prompts"):
        llm.generate([[1, 2], [3]], [GREEDY] * n_params, use_tqdm=False)
    assert_idle(llm)


def test_sampling_params_list_matching_one_token_id_prompt(llm):
    with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
        llm.generate([1, 2, 3], [GREEDY, GREEDY], use_tqdm=False)
    out = llm.generate([1, 2, 3], [GREEDY], use_tqdm=False)
    assert len(out) == 1


def test_sampling_params_of_the_wrong_type(llm):
    with pytest.raises(TypeError, match=r"prompt 1\b.*SamplingParams"):
        llm.generate([[1, 2], [3]], [GREEDY, {"temperature": 0}], use_tqdm=False)
    assert_idle(llm)


# --- LLM arguments ---------------------------------------------------------------------


def test_unknown_llm_kwarg_is_a_type_error(model_dir):
    with pytest.raises(TypeError, match="max_num_seq\\b"):
        LLM(model=str(model_dir), max_num_seq=4, **KW)


@pytest.mark.parametrize(
    "kwarg, value",
    [
        ("page_size", 0),
        ("max_num_seqs", -1),
        ("dtype", "int3"),
        ("device", "tpu"),
        ("admission", "lpm"),
        ("tier_policy", "never"),
        ("tier_copy_issue", "thread"),
        ("tier_load_scatter", "side"),
        ("load_format", "pt"),
    ],
)
def test_bad_llm_value_names_it(model_dir, kwarg, value):
    with pytest.raises(ValueError, match=kwarg):
        LLM(model=str(model_dir), **{**KW, kwarg: value})


def test_host_tier_without_prefix_caching_is_refused(model_dir):
    with pytest.raises(ValueError, match="host_kv_size_gib needs enable_prefix_caching"):
        LLM(model=str(model_dir), host_kv_size_gib=0.01, enable_prefix_caching=False, **KW)


def test_kv_cache_smaller_than_max_model_len(model_dir):
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(model=str(model_dir), **{**KW, "num_kv_pages": 4})  # 64 tokens < 128


# --- checkpoints -----------------------------------------------------------------------


def test_nonexistent_model_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        LLM(model=str(tmp_path / "does-not-exist"), **KW)


def test_model_dir_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        LLM(model=str(tmp_path), **KW)


def test_unknown_architecture_lists_supported_ones(broken):
    cfg = json.loads((broken / "config.json").read_text())
    cfg["architectures"] = ["FooForCausalLM"]
    (broken / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="FooForCausalLM") as info:
        LLM(model=str(broken), **KW)
    for arch in ARCHS:
        assert arch in str(info.value)


def test_config_without_architectures_lists_supported_ones(broken):
    cfg = json.loads((broken / "config.json").read_text())
    del cfg["architectures"]
    (broken / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="none given") as info:
        LLM(model=str(broken), **KW)
    for arch in ARCHS:
        assert arch in str(info.value)


def test_missing_safetensors_file(broken):
    (broken / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        LLM(model=str(broken), **KW)


def test_index_names_a_missing_shard(broken):
    from safetensors import safe_open

    with safe_open(str(broken / "model.safetensors"), framework="pt") as f:
        keys = list(f.keys())
    index = {"metadata": {}, "weight_map": {k: "model-00001-of-00002.safetensors" for k in keys}}
    index["weight_map"][keys[0]] = "model-00002-of-00002.safetensors"
    (broken / "model.safetensors").rename(broken / "model-00001-of-00002.safetensors")
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"):
        LLM(model=str(broken), **KW)


@pytest.mark.parametrize("keep", [0.5, 0.9, 10, 4])
def test_truncated_safetensors_file(broken, keep):
    file = broken / "model.safetensors"
    data = file.read_bytes()
    n = int(len(data) * keep) if isinstance(keep, float) else keep
    file.write_bytes(data[:n])
    with pytest.raises(ValueError, match="model.safetensors"):
        LLM(model=str(broken), **KW)


def _rewrite_weights(path, edit) -> None:
    from safetensors.torch import load_file, save_file

    file = path / "model.safetensors"
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


def test_checkpoint_missing_a_weight_names_it(broken):
    _rewrite_weights(broken, lambda t: t.pop("model.layers.1.self_attn.o_proj.weight"))
    with pytest.raises(ValueError, match=r"missing.*layers\.1\.self_attn\.o_proj\.weight"):
        LLM(model=str(broken), **KW)


def test_checkpoint_missing_one_shard_of_a_merged_weight_names_it(broken):
    _rewrite_weights(broken, lambda t: t.pop("model.layers.0.self_attn.k_proj.weight"))
    with pytest.raises(ValueError, match=r"missing.*layers\.0\.self_attn\.(k_proj|qkv_proj)"):
        LLM(model=str(broken), **KW)


def test_checkpoint_weight_of_the_wrong_shape_names_it(broken):
    def edit(t):
        name = "model.layers.0.mlp.down_proj.weight"
        t[name] = t[name][:, :-1].contiguous()

    _rewrite_weights(broken, edit)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.down_proj\.weight"):
        LLM(model=str(broken), **KW)


def test_checkpoint_with_more_layers_than_the_config_runs_the_configs_layers(
    broken, tmp_path, caplog
):
    """The config's num_hidden_layers rules: the extra layer's weights are logged as
    unused (as the loader does for every weight it has no place for) and the model is
    the checkpoint's first layer alone, generating what a checkpoint cut to that layer
    generates."""
    cfg = json.loads((broken / "config.json").read_text())
    cfg["num_hidden_layers"] = 1  # the weights hold 2 layers
    (broken / "config.json").write_text(json.dumps(cfg))
    cut = tmp_path / "cut"
    shutil.copytree(broken, cut)

    def drop_layer_1(tensors):
        for name in [n for n in tensors if n.startswith("model.layers.1.")]:
            del tensors[name]

    _rewrite_weights(cut, drop_layer_1)
    caplog.set_level(logging.WARNING)
    llm = LLM(model=str(broken), **KW)
    assert "model.layers.1.mlp.down_proj.weight is not used" in caplog.text
    prompts, params = [[3, 4, 5], [7, 8, 9, 10]], SamplingParams(temperature=0, max_tokens=8)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    want = LLM(model=str(cut), **KW).generate(prompts, params, use_tqdm=False)
    assert got == [o.outputs[0].token_ids for o in want]
    assert_idle(llm)


# --- failures during generation --------------------------------------------------------


def test_error_during_generation_leaves_no_unfinished_work(model_dir):
    llm = LLM(model=str(model_dir), **KW)  # not the shared one: this test may leave work
    runner = llm.engine.runner
    calls = []

    def failing(entry):
        def call(*args):
            calls.append(args)
            if len(calls) == 3:  # prefill, a decode, then the failure
                raise RuntimeError("simulated failure in the runner")
            return entry(*args)

        return call

    # a step runs through execute(), or launch_decode() when decode steps are pipelined
    runner.execute = failing(runner.execute)
    runner.launch_decode = failing(runner.launch_decode)
    with pytest.raises(RuntimeError, match="simulated"):
        llm.generate(
            [[1, 2, 3], [4, 5, 6]], SamplingParams(temperature=0, max_tokens=5), use_tqdm=False
        )
    del runner.execute, runner.launch_decode
    assert_idle(llm)
