"""benchmarks/workloads.py's config_dir: a directory is reused only for the very config
it holds; two workloads that differ in any field (an MoE width, the quantization
config, the dtype) never share one."""

from __future__ import annotations

import json

import pytest

from benchmarks import workloads


def test_a_config_dir_is_reused_for_its_own_config_only(tmp_path):
    path = tmp_path / "moonlight"
    config = workloads.SMALL_MOONLIGHT
    assert workloads.config_dir(path, config, "float32") == path
    written = (path / "config.json").read_text()
    assert workloads.config_dir(path, dict(config), "float32") == path  # the same: reused
    others = {
        "moe_intermediate_size": (dict(config, moe_intermediate_size=48), "float32"),
        "quantization_config": (workloads.with_int4_experts(config), "float32"),
        "dtype": (config, "bfloat16"),
    }
    for field, (other, dtype) in others.items():
        with pytest.raises(ValueError, match=field):
            workloads.config_dir(path, other, dtype)
    assert (path / "config.json").read_text() == written  # never overwritten
    assert json.loads(written)["moe_intermediate_size"] == config["moe_intermediate_size"]


def test_a_random_checkpoint_is_reused_for_its_own_config_only(tmp_path):
    path = tmp_path / "small"
    config = workloads.SMALL_MODEL
    assert workloads.random_checkpoint(path, config, "float32") == path
    weights = sorted(p.name for p in path.iterdir())
    assert workloads.random_checkpoint(path, dict(config), "float32") == path
    others = {"intermediate_size": (dict(config, intermediate_size=96), "float32")}
    others["dtype"] = (config, "bfloat16")
    for field, (other, dtype) in others.items():
        with pytest.raises(ValueError, match=f"[(]{field} differ"):
            workloads.random_checkpoint(path, other, dtype)
    assert sorted(p.name for p in path.iterdir()) == weights
