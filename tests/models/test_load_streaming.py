"""Loading streams: the host memory a load takes beyond the weights it fills stays about
one shard of the checkpoint.

A Llama of 7 safetensors shards (a decoder layer a shard of ~16 MB, the embeddings and
lm_head one more), block-scaled FP8 (128 x 128, `weight_scale_inv`) and pack-quantized
INT4 (g32), is built on the CPU in a fresh process (malloc giving freed blocks back);
its peak resident memory (VmHWM, reset after a first load of one layer has imported
what loading imports) over what it held before is at most the model's weights (kept
quantized) and one and a half shards: the shard being read (measured: one shard over
the weights for FP8, one INT4 layer shard for INT4). A loader that read every shard
before filling the layers would take all seven.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fp8_blocks import quantize_blocks
from int4_blocks import quantization_config, quantize_int4
from safetensors.torch import save_file

import batchgen

LAYERS, HIDDEN, INTER, VOCAB, HEADS = 6, 1024, 4096, 4096, 8

MEASURE = """
import copy, json, logging, sys, torch
from batchgen.engine.memory import weight_bytes
from batchgen.models.loader import ModelSource, build_model

def kib(key):
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(key))

torch.set_num_threads(1)
source = ModelSource.resolve(sys.argv[1])
config = source.load_config()
# a first load of one layer imports what loading imports (its other layers: unused)
logging.disable(logging.WARNING)
one = copy.deepcopy(config)
one.num_hidden_layers = 1
build_model(source, one, torch.bfloat16, torch.device("cpu"), 256)
before = kib("VmRSS:")
open("/proc/self/clear_refs", "w").write("5")  # VmHWM from here
model = build_model(source, config, torch.bfloat16, torch.device("cpu"), 256)
print(json.dumps({
    "grown": (kib("VmHWM:") - before) * 1024,
    "weights": weight_bytes(model),
    "dtypes": sorted({str(p.dtype) for p in model.parameters()}),
}))
"""


def _layer(i: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    shapes = {
        "self_attn.q_proj": (HIDDEN, HIDDEN),
        "self_attn.k_proj": (HIDDEN, HIDDEN),
        "self_attn.v_proj": (HIDDEN, HIDDEN),
        "self_attn.o_proj": (HIDDEN, HIDDEN),
        "mlp.gate_proj": (INTER, HIDDEN),
        "mlp.up_proj": (INTER, HIDDEN),
        "mlp.down_proj": (HIDDEN, INTER),
    }
    p = f"model.layers.{i}."
    t = {
        p + name + ".weight": torch.randn(shape, generator=gen) * 0.02
        for name, shape in shapes.items()
    }
    t[p + "input_layernorm.weight"] = torch.ones(HIDDEN)
    t[p + "post_attention_layernorm.weight"] = torch.ones(HIDDEN)
    return t


def _quantized(tensors: dict[str, torch.Tensor], fmt: str) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in tensors.items():
        if not name.endswith("proj.weight"):
            out[name] = t.to(torch.bfloat16)
        elif fmt == "fp8":
            out[name], out[name + "_scale_inv"] = quantize_blocks(t, (128, 128))
        else:
            out[name + "_packed"], out[name + "_scale"] = quantize_int4(t, 32)
            out[name + "_shape"] = torch.tensor(t.shape, dtype=torch.int32)
    return out


def _write_checkpoint(path: Path, fmt: str) -> list[int]:
    """The sharded checkpoint; returns each shard's file size."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER,
        num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=HEADS,
        max_position_embeddings=256, tie_word_embeddings=False, torch_dtype="bfloat16",
        architectures=["LlamaForCausalLM"],
    )  # fmt: skip
    config.save_pretrained(path)
    data = json.loads((path / "config.json").read_text())
    if fmt == "fp8":
        data["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    else:
        data["quantization_config"] = quantization_config(32, ["lm_head"])
    (path / "config.json").write_text(json.dumps(data))
    gen = torch.Generator().manual_seed(0)
    shards = {
        "model-00000.safetensors": {
            "model.embed_tokens.weight": torch.randn(VOCAB, HIDDEN, generator=gen) * 0.02,
            "lm_head.weight": torch.randn(VOCAB, HIDDEN, generator=gen) * 0.02,
            "model.norm.weight": torch.ones(HIDDEN),
        }
    }
    for i in range(LAYERS):
        shards[f"model-{i + 1:05d}.safetensors"] = _layer(i, gen)
    weight_map = {}
    for file, tensors in shards.items():
        tensors = _quantized(tensors, fmt)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / file))
        weight_map.update(dict.fromkeys(tensors, file))
    index = {"metadata": {}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return [(path / file).stat().st_size for file in shards]


@pytest.mark.slow  # two fresh processes importing torch, ~100 MB checkpoints written
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="Linux's VmHWM reset")
@pytest.mark.parametrize("fmt, kept", [("fp8", "torch.float8_e4m3fn"), ("int4", "torch.int32")])
def test_peak_host_memory_while_loading_is_the_weights_and_about_one_shard(tmp_path, fmt, kept):
    sizes = _write_checkpoint(tmp_path, fmt)
    # every allocation of 64 KiB or more its own mapping, given back when freed: the
    # resident size then counts live tensors, not blocks malloc keeps for reuse
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536")
    src = str(Path(batchgen.__file__).parents[1])
    env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")])
    run = subprocess.run(
        [sys.executable, "-c", MEASURE, str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=600, check=True,
    )  # fmt: skip
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert kept in got["dtypes"], got  # the weights stay quantized
    shard = max(sizes)
    assert min(sizes) > 8e6 and sum(sizes) > 4 * shard, sizes  # shards of some size
    assert got["grown"] <= got["weights"] + 1.5 * shard, (got, sizes)
