"""EngineConfig: flat options, frozen, grouped by concern, resolved once for a device."""

from __future__ import annotations

import dataclasses
import logging
import pickle

import pytest
import torch

from batchgen.config import EngineConfig
from batchgen.config_groups import GROUPS, CacheConfig, SchedulerConfig

CPU = torch.device("cpu")


def test_a_config_is_frozen_and_a_change_is_a_new_config():
    config = EngineConfig(max_num_seqs=4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_num_seqs = 8
    changed = dataclasses.replace(config, max_num_seqs=8, host_kv_size_gib=2.0)
    assert (config.max_num_seqs, changed.max_num_seqs) == (4, 8)
    assert changed.scheduler_config.max_num_seqs == 8  # the groups follow the options
    assert changed.cache_config.host_kv_size_gib == 2.0
    assert config.cache_config.host_kv_size_gib == 0.0


def test_every_option_is_in_exactly_one_group_with_the_same_value():
    config = EngineConfig(
        model="m", page_size=32, max_num_seqs=3, tensor_parallel_size=2, batchgen_debug=True
    )
    grouped = {}
    for name, group in GROUPS:
        for f in dataclasses.fields(group):
            assert f.name not in grouped, f"{f.name} in two groups"
            grouped[f.name] = getattr(getattr(config, name), f.name)
    assert set(grouped) == EngineConfig.field_names()
    assert grouped == {name: getattr(config, name) for name in EngineConfig.field_names()}
    assert config.cache_config == CacheConfig(page_size=32)
    assert config.scheduler_config == SchedulerConfig(max_num_seqs=3)


def test_the_groups_are_not_options():
    names = EngineConfig.field_names()
    assert "max_num_seqs" in names and "model" in names
    assert not names & {name for name, _ in GROUPS}
    with pytest.raises(TypeError):
        EngineConfig(cache_config=CacheConfig())


def test_a_bad_value_names_its_option_from_its_group():
    with pytest.raises(ValueError, match="^tier_load_scatter must be 'copy' or 'compute'"):
        EngineConfig(tier_load_scatter="side")
    with pytest.raises(ValueError, match="^max_queued_requests must be a positive integer"):
        EngineConfig(max_queued_requests=0)
    with pytest.raises(ValueError, match="^state_checkpoint_interval must be 0 or a positive"):
        CacheConfig(page_size=16, state_checkpoint_interval=24)  # a group checks alone too


def test_a_config_survives_pickling_with_its_groups():
    """Tensor-parallel workers are handed the config through pickling."""
    config = EngineConfig(model="m", max_num_seqs=5, decode_append="batched")
    back = pickle.loads(pickle.dumps(config))
    assert back == config
    assert back.scheduler_config.max_num_seqs == 5
    assert back.cache_config.decode_append == "batched"


def test_resolve_sets_the_batch_limits_and_keeps_async_scheduling_that_can_run(caplog):
    config = EngineConfig(async_scheduling=True)
    with caplog.at_level(logging.WARNING, logger="batchgen.config"):
        resolved = config.resolve(CPU)
    assert (resolved.max_num_seqs, resolved.max_num_batched_tokens) == (256, 8192)
    assert resolved.async_scheduling and resolved.scheduler_config.async_scheduling
    assert not caplog.records
    assert resolved.resolve(CPU) == resolved


@pytest.mark.parametrize(
    ("options", "named"),
    [
        (dict(pipeline_decode=False), "pipeline_decode=False"),
        (dict(batchgen_debug=True), "batchgen_debug=True"),
        (dict(decode_append="layer"), 'decode_append="layer"'),
        (dict(tensor_parallel_size=2), "tensor_parallel_size=2"),
    ],
)
def test_async_scheduling_that_cannot_run_is_turned_off_with_a_warning_naming_why(
    caplog, options, named
):
    config = EngineConfig(async_scheduling=True, **options)
    with caplog.at_level(logging.WARNING, logger="batchgen.config"):
        resolved = config.resolve(CPU)
    assert not resolved.async_scheduling
    [record] = caplog.records
    assert record.levelno == logging.WARNING
    assert f"async_scheduling=True is not used with {named}" in record.getMessage()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="batchgen.config"):
        EngineConfig(**options).resolve(CPU)  # not asked for: nothing to say
    assert not caplog.records


def test_describe_names_every_option_by_group():
    text = EngineConfig(model="m", max_num_seqs=7).describe()
    assert text.startswith(
        "parallel: tensor_parallel_size=1, data_parallel_size=1, enable_expert_parallel=False, "
        "distributed_executor_backend='mp'; "
        "scheduler: max_num_seqs=7, "
    )
    for name in EngineConfig.field_names():
        assert f"{name}=" in text


def test_deterministic_is_checked_where_it_cannot_hold():
    with pytest.raises(ValueError, match="deterministic"):
        EngineConfig(deterministic=1)
    # the Triton backend has batch-invariant kernels (kernels/invariant_attention.py)
    EngineConfig(deterministic=True, attention_backend="triton").resolve(CPU)
    # tensor parallel's all-reduces add the ranks' parts in rank order (layers/tp_group.py)
    assert EngineConfig(deterministic=True, tensor_parallel_size=2).resolve(CPU).deterministic
    # attention data parallel: expert parallel's combine adds a token's rows in its order
    dp = EngineConfig(deterministic=True, data_parallel_size=2, enable_expert_parallel=True)
    assert dp.resolve(CPU, moe=True).deterministic
    with pytest.raises(ValueError, match="max_num_batched_tokens >= 64"):
        EngineConfig(deterministic=True, max_num_batched_tokens=32).resolve(CPU, 1)
    with pytest.raises(ValueError, match="state_checkpoint_interval a multiple"):
        EngineConfig(deterministic=True, state_checkpoint_interval=1040).resolve(CPU, 1)
    EngineConfig(deterministic=True, max_num_batched_tokens=32).resolve(CPU)  # no KDA
    config = EngineConfig(deterministic=True).resolve(CPU)
    assert config.deterministic and config.model_config.deterministic
    # "auto" attends with the Triton kernels on a GPU, deterministic or not
    assert config.resolved_attention_backend(torch.device("cuda")) == "triton"
    assert config.resolved_attention_backend(CPU) == "torch"
    assert EngineConfig().resolved_attention_backend(torch.device("cuda")) == "triton"
