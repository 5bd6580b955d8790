"""LLM("org/name"): a Hugging Face model id resolved through the local Hugging Face
cache (a fake one in tmp_path, in the hub's snapshot layout); never the network."""

from __future__ import annotations

import shutil

import huggingface_hub.constants
import pytest
from conftest import save_tiny_model

from batchgen import LLM, SamplingParams
from batchgen.models.hub import looks_like_repo_id

KW = dict(device="cpu", dtype="float32", page_size=4, max_model_len=64, num_kv_pages=64)
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    save_tiny_model(path, "Qwen3ForCausalLM")
    return path


@pytest.fixture
def hub_cache(tmp_path, monkeypatch, checkpoint):
    """HF_HUB_CACHE holding "acme/tiny-qwen3" at COMMIT, the way the hub lays it out:
    models--acme--tiny-qwen3/{refs/main, snapshots/COMMIT/...}; offline mode on."""
    repo = tmp_path / "hub" / "models--acme--tiny-qwen3"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    shutil.copytree(checkpoint, repo / "snapshots" / COMMIT)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return repo / "snapshots" / COMMIT


def test_model_id_loads_from_the_local_cache(hub_cache, checkpoint, monkeypatch):
    params = SamplingParams(temperature=0, max_tokens=6)
    by_id = LLM("acme/tiny-qwen3", **KW)
    assert by_id.engine.hf_config.architectures == ["Qwen3ForCausalLM"]
    by_path = LLM(str(checkpoint), **KW)
    prompts = [[5, 6, 7, 8], "w9 w10 w11"]
    got = [o.outputs[0].token_ids for o in by_id.generate(prompts, params, use_tqdm=False)]
    want = [o.outputs[0].token_ids for o in by_path.generate(prompts, params, use_tqdm=False)]
    assert got == want


def test_unknown_model_id_names_it(hub_cache):
    with pytest.raises(FileNotFoundError, match="'acme/missing' is not a local path, not in"):
        LLM("acme/missing", **KW)


@pytest.mark.parametrize(
    "name, is_id",
    [
        ("acme/tiny-qwen3", True),
        ("gpt2", True),
        ("./acme/tiny", False),
        ("/abs/dir", False),
        ("a/b/c", False),
        ("~/models/x", False),
        ("model.gguf", False),
        ("acme//x", False),
    ],
)
def test_looks_like_repo_id(name, is_id):
    assert looks_like_repo_id(name) is is_id
