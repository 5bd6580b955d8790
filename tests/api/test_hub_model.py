"""LLM("org/name"): a Hugging Face model id resolved through the local Hugging Face
cache (a fake one in tmp_path, in the hub's snapshot layout), at a revision and in a
cache given as vLLM's revision= and download_dir=; never the network."""

from __future__ import annotations

import pytest
from conftest import hub_offline, save_hub_snapshot, save_tiny_model

from batchgen import LLM, SamplingParams
from batchgen.models.hub import looks_like_repo_id

KW = dict(device="cpu", dtype="float32", page_size=4, max_model_len=64, num_kv_pages=64)
COMMIT = "0123456789abcdef0123456789abcdef01234567"
V2_COMMIT = "89abcdef0123456789abcdef0123456789abcdef"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    save_tiny_model(path, "Qwen3ForCausalLM")
    return path


@pytest.fixture
def hub_cache(tmp_path, monkeypatch, checkpoint):
    """HF_HUB_CACHE holding "acme/tiny-qwen3" at COMMIT, the way the hub lays it out:
    models--acme--tiny-qwen3/{refs/main, snapshots/COMMIT/...}; offline mode on."""
    snapshot = save_hub_snapshot(tmp_path / "hub", "acme/tiny-qwen3", checkpoint, COMMIT)
    hub_offline(monkeypatch, tmp_path / "hub")
    return snapshot


def test_model_id_loads_from_the_local_cache(hub_cache, checkpoint, monkeypatch):
    params = SamplingParams(temperature=0, max_tokens=6)
    by_id = LLM("acme/tiny-qwen3", **KW)
    assert by_id.engine.hf_config.architectures == ["Qwen3ForCausalLM"]
    by_path = LLM(str(checkpoint), **KW)
    prompts = [[5, 6, 7, 8], "w9 w10 w11"]
    got = [o.outputs[0].token_ids for o in by_id.generate(prompts, params, use_tqdm=False)]
    want = [o.outputs[0].token_ids for o in by_path.generate(prompts, params, use_tqdm=False)]
    assert got == want


@pytest.fixture
def download_dir(tmp_path, monkeypatch, checkpoint, tiny_llama):
    """A Hugging Face cache outside HF_HUB_CACHE (which is empty) holding two revisions of
    "acme/tiny": main at COMMIT (the Qwen3 checkpoint) and branch "v2" at V2_COMMIT (the
    Llama one); offline mode on."""
    cache = tmp_path / "downloads"
    for ref, commit, ckpt in (("main", COMMIT, checkpoint), ("v2", V2_COMMIT, tiny_llama)):
        save_hub_snapshot(cache, "acme/tiny", ckpt, commit, ref)
    (tmp_path / "empty").mkdir()
    hub_offline(monkeypatch, tmp_path / "empty")
    return cache


def test_revision_and_download_dir_pick_the_snapshot(download_dir, tiny_llama):
    params = SamplingParams(temperature=0, max_tokens=6)
    v2 = LLM("acme/tiny", revision="v2", download_dir=str(download_dir), **KW)
    assert v2.engine.hf_config.architectures == ["LlamaForCausalLM"]
    prompts = [[5, 6, 7, 8], "w9 w10 w11"]
    got = [o.outputs[0].token_ids for o in v2.generate(prompts, params, use_tqdm=False)]
    by_path = LLM(tiny_llama, **KW)
    want = [o.outputs[0].token_ids for o in by_path.generate(prompts, params, use_tqdm=False)]
    assert got == want
    # a commit hash, and no revision (main), give the other snapshot
    for revision in (COMMIT, None):
        llm = LLM("acme/tiny", revision=revision, download_dir=str(download_dir), **KW)
        assert llm.engine.hf_config.architectures == ["Qwen3ForCausalLM"]


def test_revision_or_cache_that_does_not_hold_it_names_them(download_dir):
    with pytest.raises(FileNotFoundError) as info:
        LLM("acme/tiny", revision="v3", download_dir=str(download_dir), **KW)
    assert (
        f"'acme/tiny' at revision 'v3' is not a local path, not in the Hugging Face cache ({download_dir})"
        in str(info.value)
    )
    # without download_dir the id is looked up in HF_HUB_CACHE, which does not hold it
    with pytest.raises(FileNotFoundError, match=r"'acme/tiny' at revision 'v2' is not .*empty\)"):
        LLM("acme/tiny", revision="v2", **KW)


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
