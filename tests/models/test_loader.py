"""Loading: load_format="dummy" (config and tokenizer, no weights); the checkpoint dtype."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from conftest import save_tiny_tokenizer, tiny_config

from batchgen import LLM, SamplingParams
from batchgen.models import loader
from batchgen.models.loader import ModelSource, build_model

KW = dict(device="cpu", dtype="float32", num_kv_pages=32, max_model_len=64, page_size=4)


def config_only(path, arch: str = "LlamaForCausalLM"):
    """config.json and tokenizer files, nothing else."""
    tiny_config(arch).save_pretrained(path)
    save_tiny_tokenizer(path, 512)
    assert not list(path.glob("*.safetensors"))
    return path


def _build(path, seed: int = 0, dtype=torch.float32):
    source = ModelSource.resolve(path)
    return build_model(source, source.load_config(), dtype, torch.device("cpu"), 64, "dummy", seed)


def test_a_config_only_directory_generates_with_dummy_weights(tmp_path):
    llm = LLM(model=str(config_only(tmp_path)), load_format="dummy", **KW)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = llm.generate([[5, 6, 7, 8, 9], [10, 11]], params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [6, 6]
    again = LLM(model=str(tmp_path), load_format="dummy", **KW)
    assert [o.outputs[0].token_ids for o in outs] == [
        o.outputs[0].token_ids for o in again.generate([[5, 6, 7, 8, 9], [10, 11]], params)
    ]


def test_two_dummy_loads_give_the_same_weights_and_another_seed_others(tmp_path):
    config_only(tmp_path)
    a, b, c = _build(tmp_path), _build(tmp_path), _build(tmp_path, seed=1)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert sa.keys() == sb.keys() and len(sa) > 10
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    matrices = [k for k in sa if sa[k].dim() == 2]
    assert matrices and not any(torch.equal(sa[k], sc[k]) for k in matrices)


@pytest.mark.parametrize("arch", ["Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def test_dummy_weights_have_the_benchmark_checkpoints_distribution(tmp_path, arch):
    """As workloads.random_checkpoint: matrices normal(0, 0.02), norms 1, biases 0."""
    model = _build(config_only(tmp_path, arch), dtype=torch.bfloat16)
    kinds = set()
    for name, p in model.named_parameters():
        assert p.dtype == torch.bfloat16 and p.device.type == "cpu"
        if p.dim() == 2:
            kinds.add("matrix")
            assert abs(p.float().mean().item()) < 2e-3, name
            assert abs(p.float().std().item() - 0.02) < 2e-3, name
        elif name.endswith("bias"):
            kinds.add("bias")
            assert not p.any(), name
        else:
            kinds.add("norm")
            assert (p == 1).all(), name
    assert kinds == (
        {"matrix", "norm", "bias"} if arch == "Qwen2ForCausalLM" else {"matrix", "norm"}
    )


def test_building_a_model_draws_no_initial_weights(tmp_path, monkeypatch):
    """Every weight is loaded or drawn after the build, so no layer draws its own on the
    meta device: torch.nn.init there goes through torch._refs, which imports
    torch._dynamo (about a second of every `batchgen run` start)."""

    def refuse(*args, **kwargs):
        raise AssertionError("a layer drew initial weights while the model was built")

    for name in ("normal_", "uniform_", "kaiming_uniform_", "trunc_normal_", "xavier_uniform_"):
        monkeypatch.setattr(torch.nn.init, name, refuse)
    model = _build(config_only(tmp_path))
    assert model.embed_tokens.weight.shape == (512, model.embed_tokens.embedding_dim)


def test_a_config_only_directory_without_dummy_names_the_missing_weights(tmp_path):
    config_only(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"weights are missing.*safetensors.*dummy"):
        LLM(model=str(tmp_path), **KW)


class _WarnsOnTorchDtype(transformers.LlamaConfig):
    """A config whose deprecated `torch_dtype` alias fails the test when read."""

    @property
    def torch_dtype(self):
        raise AssertionError("read the deprecated torch_dtype attribute")


@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_checkpoint_dtype_never_reads_the_deprecated_torch_dtype(tmp_path, dtype):
    """A GGUF config has no dtype; reading `torch_dtype` then warned on every load."""
    config = _WarnsOnTorchDtype(dtype=dtype)
    got = ModelSource(tmp_path).checkpoint_dtype(config)
    assert got == (torch.bfloat16 if dtype else None)


def test_checkpoint_dtype_reads_a_config_json_torch_dtype(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "llama", "torch_dtype": "float16"})
    )
    source = ModelSource(tmp_path)
    assert source.checkpoint_dtype(source.load_config()) == torch.float16


def test_a_directory_without_tokenizer_files_names_them(tmp_path):
    """It failed with transformers' "install sentencepiece or tiktoken", both installed."""
    tiny_config("LlamaForCausalLM").save_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError) as err:
        LLM(model=str(tmp_path), load_format="dummy", **KW)
    message = str(err.value)
    assert "tokenizer files are missing" in message
    assert str(tmp_path) in message
    assert "tokenizer.json" in message and "tokenizer.model" in message
    assert "install" not in message


@pytest.mark.parametrize("name", ["tokenizer.model", "vocab.json", "o200k.tiktoken"])
def test_one_tokenizer_file_is_enough_to_try_loading(tmp_path, name):
    assert not loader._has_tokenizer_files(tmp_path)
    (tmp_path / name).write_bytes(b"")
    assert loader._has_tokenizer_files(tmp_path)
