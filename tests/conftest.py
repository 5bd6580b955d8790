"""Shared fixtures: tiny random checkpoints of every supported architecture."""

from __future__ import annotations

import io
import os
import shutil
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # Triton kernels run under the interpreter on the CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

ARCHS = ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM"]

# what every tiny random checkpoint of the tests shares: a 512-token vocabulary (ids 0-2
# <pad> <s> </s>, as save_tiny_tokenizer spells them), 64 wide, MLPs of 128, untied
TINY_SIZES = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def tiny_config(arch: str, **overrides):
    """A small random config of `arch` (GQA, 2+ layers)."""
    import transformers

    common = dict(TINY_SIZES, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    if arch == "LlamaForCausalLM":
        cfg = transformers.LlamaConfig(
            **common,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 256,
                "rope_theta": 500000.0,
            },
        )
    elif arch == "Qwen2ForCausalLM":
        cfg = transformers.Qwen2Config(**{**common, "tie_word_embeddings": True})
    elif arch == "Qwen3ForCausalLM":
        cfg = transformers.Qwen3Config(**common, head_dim=32)
    elif arch == "MistralForCausalLM":
        cfg = transformers.MistralConfig(**common, sliding_window=None)
    else:
        raise ValueError(arch)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    cfg.architectures = [arch]
    return cfg


def save_tiny_model(path, arch: str, seed: int = 0, **overrides):
    """Write a random transformers checkpoint of `arch` (safetensors) and return the model."""
    return save_random_model(path, tiny_config(arch, **overrides), seed)


def save_random_model(path, config, seed: int = 0):
    """transformers' model of `config` with random float32 weights, written with a tiny
    tokenizer (safetensors); returns the model. Every matrix (stacked experts and conv
    taps too) is drawn from normal(0, 0.15): larger weights give peaked distributions,
    fewer near-ties. KDA's A_log and dt_bias are drawn as fla initialises them, and an
    MoE router's e_score_correction_bias from normal(0, 0.1), so that choosing experts
    differs from weighting them."""
    import math

    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):  # decay rates exp(A_log) in [1, 16]
                p.copy_(torch.empty_like(p).uniform_(1, 16).log())
            elif name.endswith("dt_bias"):  # softplus(dt_bias) in [1e-3, 1e-1]
                dt = torch.empty_like(p).uniform_(math.log(1e-3), math.log(1e-1)).exp()
                p.copy_(dt + torch.log(-torch.expm1(-dt)))
            elif p.dim() >= 2:
                p.normal_(0, 0.15)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.1)
    model.save_pretrained(path)
    save_tiny_tokenizer(path, config.vocab_size)
    return model.eval()


def save_tiny_tokenizer(path, vocab_size: int) -> None:
    """A word-level tokenizer: ids 0-2 are <pad> <s> </s>, id i >= 3 is the word "w{i}"."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"w{i}": i for i in range(3, vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<pad>",
    )
    fast.chat_template = (
        "{% for m in messages %}w10 {{ m['content'] }} w11 {% endfor %}"
        "{% if add_generation_prompt %}w12 {% endif %}"
    )
    fast.save_pretrained(path)


def save_hub_snapshot(cache, repo_id: str, checkpoint, commit: str, ref: str = "main") -> Path:
    """Lay `checkpoint` out in the Hugging Face cache folder `cache` the way the hub does:
    models--org--name/snapshots/`commit`, with refs/`ref` naming it; returns the snapshot."""
    repo = Path(cache) / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return shutil.copytree(checkpoint, repo / "snapshots" / commit)


def hub_offline(monkeypatch, hub_cache) -> None:
    """For the test: HF_HUB_CACHE is the folder `hub_cache` and the hub is offline."""
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def byte_chars() -> list[str]:
    """GPT-2's byte-level alphabet: the character that stands for byte b, by b."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(others)) for b in range(256)]


def save_byte_tokenizer(path) -> None:
    """A byte-level BPE tokenizer: ids 0-2 are <pad> <s> </s>, id 3 + b is byte b, then
    a few merges of JSON punctuation; every string encodes (structured outputs)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    vocab.update({c: 3 + b for b, c in enumerate(byte_chars())})
    merges = [('"', ":"), ("{", '"'), ('"', ","), (",", '"'), ("Ġ", '"')]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.save_pretrained(path)


class TtyStream(io.StringIO):
    """A text stream (stderr's stand-in) that is a terminal or not as told: isatty()
    says `tty`, what the progress output checks before it draws."""

    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def _on_decode_launch(runner, note) -> None:
    """Wrap `runner.launch_decode` so that each launch calls note(flight, behind): the
    step's InFlightDecode, and whether it was queued behind another (pipelined)."""
    launch = runner.launch_decode

    def recorded(sched, prev=None, *copies):
        flight = launch(sched, prev, *copies)
        note(flight, prev is not None)
        return flight

    runner.launch_decode = recorded


def record_launches(runner) -> list:
    """Wrap `runner.launch_decode`: the list returned gets each queued step's
    InFlightDecode and whether it was queued behind another, as (flight, behind)."""
    launches = []
    _on_decode_launch(runner, lambda flight, behind: launches.append((flight, behind)))
    return launches


def record_queued(runner) -> list[bool]:
    """Wrap `runner.launch_decode`: the list returned gets, per launched decode step,
    whether it was queued behind another (pipelined)."""
    queued: list[bool] = []
    _on_decode_launch(runner, lambda flight, behind: queued.append(behind))
    return queued


def count_launches_ahead(runner) -> dict:
    """Wrap `runner.launch_step` (async scheduling): the dict returned counts the steps
    launched while another was in flight ("steps") and those of them with a prefill
    chunk ("with_prefill")."""
    ahead = {"steps": 0, "with_prefill": 0}
    launch = runner.launch_step

    def counted(sched, prev=None, *copies):
        if prev is not None:
            ahead["steps"] += 1
            ahead["with_prefill"] += any(len(r.new_token_ids) > 1 for r in sched.requests)
        return launch(sched, prev, *copies)

    runner.launch_step = counted
    return ahead


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    """The path of a tiny random Llama checkpoint (save_tiny_model), one per module."""
    path = tmp_path_factory.mktemp("tiny")
    save_tiny_model(path, "LlamaForCausalLM")
    return str(path)


# the embedded default model (SmolLM2-135M GGUF) as the CPU tests run it: float32, chat
# prompts and their answers fit 1024 tokens
DEFAULT_MODEL_CPU = dict(
    device="cpu", dtype="float32", max_model_len=1024, max_num_batched_tokens=256
)


@pytest.fixture(scope="session")
def default_model_llm():
    """An LLM of the embedded default model on the CPU (DEFAULT_MODEL_CPU), one per session:
    building it parses the GGUF file and dequantizes it (~10-15 s on 2 cores), and the
    modules that run the default model share that."""
    from batchgen import LLM

    return LLM(**DEFAULT_MODEL_CPU)


@pytest.fixture(scope="session")
def shared_ray():
    """The session's local Ray cluster (tests/ray_session.py), started by the first test
    that asks for local_ray (none other pays for it) and shut down at the session's end."""
    from ray_session import SharedLocalRay

    shared = SharedLocalRay(num_cpus=4)
    yield shared
    shared.close()


@pytest.fixture
def local_ray(shared_ray):
    """The ray module with the session's local cluster of four logical CPUs running (two
    engines of two tensor-parallel ranks fit; this machine has two cores). Without Ray the
    test skips."""
    return shared_ray.ensure()


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def engine_device(request) -> str:
    """The device a module's engines run on: the CPU, and the GPU (marked gpu) with
    every default of a GPU run (CUDA graphs, Triton attention, pipelined decode) except
    the dtype: tests that compare runs token for token keep float32 there."""
    return request.param


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
