"""vLLM compatibility of the LLM object: get_tokenizer(), trust_remote_code, vLLM's
keyword names and the errors a user coming from vLLM meets first."""

from __future__ import annotations

import pytest
import torch
from conftest import save_tiny_model

from batchgen import LLM, SamplingParams

KW = dict(device="cpu", dtype="float32", page_size=4, max_model_len=64, num_kv_pages=64)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("compat")
    save_tiny_model(path, "LlamaForCausalLM")
    return path


def test_get_tokenizer_is_the_engines(model_dir):
    llm = LLM(model=str(model_dir), **KW)
    tok = llm.get_tokenizer()
    assert tok is llm.engine.tokenizer
    ids = tok.encode("w5 w6 w7", add_special_tokens=False)
    assert ids == [5, 6, 7]
    out = llm.generate("w5 w6 w7", SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert tok.decode(out[0].outputs[0].token_ids) == out[0].outputs[0].text


@pytest.mark.parametrize("trust", [True, False])
def test_trust_remote_code_is_accepted(model_dir, trust):
    llm = LLM(model=str(model_dir), trust_remote_code=trust, **KW)
    assert "trust_remote_code" not in vars(llm.config)
    out = llm.generate([[5, 6]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


def test_trust_remote_code_must_be_a_bool(model_dir):
    with pytest.raises(TypeError, match="trust_remote_code must be a bool"):
        LLM(model=str(model_dir), trust_remote_code="yes", **KW)


# --- vLLM's keyword names ----------------------------------------------------------------


def test_vllm_names_set_their_options(model_dir, tmp_path):
    kw = {k: v for k, v in KW.items() if k != "page_size"}
    llm = LLM(
        model=str(model_dir),
        block_size=8,
        swap_space=0.01,
        download_dir=str(tmp_path),
        kv_cache_dtype="auto",
        tokenizer=str(model_dir),
        revision=None,
        **kw,
    )
    config = llm.engine.config
    assert (config.page_size, config.host_kv_size_gib) == (8, 0.01)
    assert config.cache_dir == str(tmp_path)
    assert llm.engine.tier is not None  # swap_space gave the engine a host tier
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(kv_cache_dtype="int8"), "kv_cache_dtype must be 'auto', 'fp8' or 'fp8_e4m3', got"),
        (dict(tokenizer="other/tok"), "tokenizer='other/tok' is not supported"),
        (dict(revision=""), "revision must be None or a branch, tag or commit, got ''"),
        (dict(block_size=8), "block_size=8 and page_size=4 name one option"),
        (dict(swap_space=1, enable_prefix_caching=False), r"\(host_kv_size_gib is swap_space\)"),
    ],
)
def test_vllm_names_at_values_batchgen_cannot_take(model_dir, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(model=str(model_dir), **{**KW, **kwargs})


@pytest.mark.parametrize(
    "name, nearest",
    [("max_num_seq", "max_num_seqs"), ("blocksize", "block_size"), ("swapspace", "swap_space")],
)
def test_unknown_argument_names_the_nearest_option(model_dir, name, nearest):
    with pytest.raises(TypeError) as info:
        LLM(model=str(model_dir), **{**KW, name: 4})
    assert f"unknown argument(s): {name} (did you mean {nearest!r}?)" in str(info.value)


def test_max_model_len_beyond_the_models_context_is_refused(model_dir):
    # the tiny model's max_position_embeddings is 1024
    with pytest.raises(ValueError) as info:
        LLM(model=str(model_dir), **{**KW, "max_model_len": 1500, "num_kv_pages": 400})
    assert "max_model_len=1500" in str(info.value) and "(1024," in str(info.value)
    llm = LLM(model=str(model_dir), **{**KW, "max_model_len": 1024, "num_kv_pages": 256})
    assert llm.engine.max_model_len == 1024


def test_max_model_len_is_refused_before_any_weight_is_read(model_dir, monkeypatch):
    import safetensors

    def no_weights(path, *args, **kwargs):
        raise AssertionError(f"a weights file was opened: {path}")

    monkeypatch.setattr(safetensors, "safe_open", no_weights)
    with pytest.raises(ValueError) as info:
        LLM(model=str(model_dir), **{**KW, "max_model_len": 1025, "num_kv_pages": 400})
    assert str(info.value) == (
        "max_model_len=1025 is more than the model's context length (1024, "
        "max_position_embeddings in its config); use a max_model_len of at most 1024 or "
        "leave it unset"
    )
    # the patch is on the load path: a max_model_len the model takes reaches it
    with pytest.raises(AssertionError, match="a weights file was opened: .*safetensors"):
        LLM(model=str(model_dir), **{**KW, "max_model_len": 1024, "num_kv_pages": 256})


def test_cuda_device_without_a_cuda_build_of_torch(model_dir, monkeypatch):
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: False)
    with pytest.raises(ValueError) as info:
        LLM(model=str(model_dir), **{**KW, "device": "cuda"})
    assert str(info.value) == (
        f"device='cuda' but this torch build has no CUDA support (torch {torch.__version__}); "
        "install a CUDA build of torch or use device='cpu'"
    )


def test_cuda_device_that_torch_does_not_see(model_dir, monkeypatch):
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"device='cuda:1' but torch sees 1 CUDA device\(s\)"):
        LLM(model=str(model_dir), **{**KW, "device": "cuda:1"})


# --- sampling params of the wrong type ---------------------------------------------------


def test_a_dict_for_sampling_params_is_named(model_dir):
    llm = LLM(model=str(model_dir), **KW)
    with pytest.raises(TypeError) as info:
        llm.generate("w5 w6", {"temperature": 0}, use_tqdm=False)
    assert str(info.value) == (
        "sampling_params must be a SamplingParams or a list of them (one a prompt), got "
        "a dict; write SamplingParams(**d) for a dict d of its fields"
    )
    with pytest.raises(TypeError, match=r"^conversation 1: sampling params must be .* a dict"):
        llm.chat(
            [[{"role": "user", "content": "w5"}]] * 2,
            [SamplingParams(), {"max_tokens": 2}],
            use_tqdm=False,
        )
    assert not llm.engine.has_unfinished and not llm.engine.requests
