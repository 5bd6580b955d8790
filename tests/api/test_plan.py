"""`batchgen plan`: weight bytes per GPU equal the engine's own models' tensors rank by
rank, the KV and state geometry equal the engine's, and real configs' totals (DeepSeek-V3,
Kimi-K2-Thinking) land on their published sizes. No network: configs are files."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from conftest import tiny_config
from deepseek_checkpoints import tiny_config as tiny_deepseek
from kimi_checkpoints import tiny_config as tiny_kimi

from batchgen.api import plan as plans
from batchgen.api.cli import main
from batchgen.api.plan_model import Parallel, read_config
from batchgen.engine.builder_plan import kv_layout
from batchgen.engine.memory import state_layout, weight_bytes
from batchgen.layers.tp_group import TPGroup
from batchgen.models.loader import build_model

CONFIGS = Path(__file__).parent / "model_configs"
BF16 = plans.PRECISIONS[0]


def _written(tmp_path: Path, config) -> Path:
    """config saved as config.json alone, as `batchgen plan` reads it."""
    config.save_pretrained(tmp_path)
    return tmp_path


TINY = {
    # GQA, llama3 rope; an odd vocabulary pads the last rank's rows
    "llama": lambda: tiny_config("LlamaForCausalLM", vocab_size=511),
    "qwen2_tied_bias": lambda: tiny_config("Qwen2ForCausalLM"),
    "qwen3_qk_norm": lambda: tiny_config("Qwen3ForCausalLM"),
    "llama_biases": lambda: tiny_config("LlamaForCausalLM", attention_bias=True, mlp_bias=True),
    # a dense first layer, then MoE with shared experts; q LoRA
    "deepseek_v3": lambda: tiny_deepseek(first_k_dense_replace=1, n_shared_experts=2),
    "deepseek_v3_plain_q": lambda: tiny_deepseek(first_k_dense_replace=1, q_lora_rank=None),
    "kimi_linear": lambda: tiny_kimi(
        ["linear_attention", "full_attention", "linear_attention"], first_k_dense_replace=1
    ),
}


@pytest.mark.parametrize("name", sorted(TINY))
@pytest.mark.parametrize("tp", [1, 2])
def test_weight_bytes_equal_the_engines_model_on_every_rank(tmp_path, name, tp):
    config = read_config(_written(tmp_path, TINY[name]()))
    expected = BF16.total(plans.model_weights(config, Parallel(tp)), True)
    for rank in range(tp):
        group = TPGroup(rank, tp) if tp > 1 else None
        model = build_model(
            None, config, torch.bfloat16, torch.device("cpu"), 64, "dummy", tp=group
        )
        tensors = [*model.parameters(), *model.buffers()]
        assert sum(t.numel() * t.element_size() for t in tensors) == expected, (name, rank)
        assert weight_bytes(model) == expected


FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
# Kimi-K2-Thinking's: attention, shared experts and dense MLPs kept in bf16
K2_IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"]  # fmt: skip


def _int4_config(group: int, ignore: list[str]) -> dict:
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group"}
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "ignore": ignore,
        "config_groups": {
            "g": {"targets": ["Linear"], "weights": {**weights, "group_size": group}}
        },
    }


# dimensions of whole 128-blocks, so that FP8 and INT4 hold every layer they can
WIDE = dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=256, vocab_size=1024)
MLA = dict(kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64)
WIDE_MODELS = {
    "llama": lambda: tiny_config("LlamaForCausalLM", **WIDE, head_dim=64),
    "deepseek_v3": lambda: tiny_deepseek(first_k_dense_replace=1, q_lora_rank=256, **WIDE, **MLA),
    # in_proj's b rows put f_a off a block: one process keeps each part's own blocks (and
    # a row index), two split ranks hold 1 row of b each and keep it bf16
    "kimi_linear": lambda: tiny_kimi(
        ["linear_attention", "full_attention"], **WIDE, **MLA, linear_head_dim=128
    ),
}
# (quantization_config in config.json, or the quantization option) -> the plan's row
QUANTIZED = {
    "option_fp8": (None, "fp8"),
    "checkpoint_fp8": (FP8_CONFIG, "fp8"),
    "checkpoint_int4_g32_k2": (_int4_config(32, K2_IGNORE), "int4-g32"),
    "checkpoint_int4_g128": (_int4_config(128, ["lm_head"]), "int4-g128"),
}


@pytest.mark.parametrize("quantized", sorted(QUANTIZED))
@pytest.mark.parametrize("name", sorted(WIDE_MODELS))
def test_quantized_weight_bytes_equal_the_engines_model(tmp_path, name, quantized):
    """Dummy weights take the quantized forms a checkpoint of the config (or the fp8
    option) gives the engine's layers; the plan counts their bytes, rank by rank, under
    tensor and expert parallel."""
    from batchgen.layers.expert_parallel import ExpertParallel

    config = WIDE_MODELS[name]()
    quantization_config, row = QUANTIZED[quantized]
    if quantization_config is not None:
        config.quantization_config = quantization_config
    config = read_config(_written(tmp_path, config))
    precision = plans.shipped_precision(config) or next(
        p for p in plans.PRECISIONS if p.name == row
    )
    assert precision.name == row
    moe = name != "llama"
    layouts = [(Parallel(2), lambda r: dict(tp=TPGroup(r, 2)))]
    if moe:  # attention data parallel: attention whole, experts split, shared replicated
        ep = lambda r: dict(ep=ExpertParallel(TPGroup(r, 2), local_tokens=True))  # noqa: E731
        layouts.append((Parallel(1, 2, expert_parallel=True), ep))
        # tensor parallel attention, experts by all-to-all over the same ranks
        tp_ep = lambda r: dict(tp=TPGroup(r, 2), ep=ExpertParallel(TPGroup(r, 2)))  # noqa: E731
        layouts.append((Parallel(2, 1, expert_parallel=True), tp_ep))
    option = "fp8" if quantized == "option_fp8" else None
    for parallel, split in layouts:
        expected = precision.total(plans.model_weights(config, parallel), moe, parallel.tp)
        for rank in range(2):
            model = build_model(
                None, config, torch.bfloat16, torch.device("cpu"), 64, "dummy",
                quantization=option, **split(rank),
            )  # fmt: skip
            assert weight_bytes(model) == expected, (parallel, rank)


@pytest.mark.parametrize("name", ["llama", "deepseek_v3", "kimi_linear"])
def test_kv_and_state_geometry_equal_the_engines(tmp_path, name):
    config = read_config(_written(tmp_path, TINY[name]()))
    model = build_model(
        None, config, torch.bfloat16, torch.device("cpu"), 64, "dummy", tp=TPGroup(0, 2)
    )
    engine_config = plans.EngineConfig(page_size=16)
    engine = kv_layout(engine_config, model, config, torch.bfloat16)
    planned = plans.kv_layout(config, Parallel(2), 16, torch.bfloat16)
    assert planned.bytes_per_page == engine.bytes_per_page
    engine_state = state_layout(model, torch.bfloat16)
    planned_state = plans.state_layout(config, Parallel(2))
    assert (planned_state is None) == (engine_state is None)
    if engine_state is not None:
        assert planned_state.bytes_per_slot == engine_state.bytes_per_slot


@pytest.mark.parametrize("name", ["llama", "deepseek_v3", "kimi_linear"])
def test_fp8_kv_column_is_the_engines_fp8_page(tmp_path, name):
    """The plan's "fp8 KV" pages are the pages kv_cache_dtype="fp8" gives the engine:
    float8_e4m3fn, half a bf16 page's bytes."""
    config = read_config(_written(tmp_path, TINY[name]()))
    model = build_model(
        None, config, torch.bfloat16, torch.device("cpu"), 64, "dummy", tp=TPGroup(0, 2)
    )
    engine = kv_layout(plans.EngineConfig(page_size=16, kv_cache_dtype="fp8"), model, config,
                       torch.bfloat16)  # fmt: skip
    planned = plans.kv_layout(config, Parallel(2), 16, plans.KV_DTYPES["fp8"])
    assert engine.dtype == planned.dtype == torch.float8_e4m3fn
    assert planned.bytes_per_page == engine.bytes_per_page
    bf16 = kv_layout(plans.EngineConfig(page_size=16), model, config, torch.bfloat16)
    assert 2 * engine.bytes_per_page == bf16.bytes_per_page


def test_deepseek_v3_real_config_is_671b_params_1_34_tb_bf16_0_67_tb_fp8(tmp_path):
    (tmp_path / "config.json").write_text((CONFIGS / "deepseek-v3" / "config.json").read_text())
    config = read_config(tmp_path)
    p = plans.plan(config, Parallel())
    assert p.parameters == pytest.approx(671e9, rel=0.01)  # the MTP layer's 14B left out
    by_name = {f.precision.name: f for f in p.fits}
    assert by_name["bf16"].weight_bytes == pytest.approx(1.342e12, rel=0.02)
    assert by_name["fp8"].weight_bytes == pytest.approx(0.671e12, rel=0.03)
    assert by_name["fp8"].precision.shipped
    # MLA keeps 576 values a token in each of 61 layers: 70 KB a token in bf16
    assert p.kv_bytes_per_token == {"bf16": 61 * 576 * 2, "fp8": 61 * 576}


def test_kimi_k2_thinking_ships_int4_at_594_gb_against_1_03_tb_fp8():
    config = read_config(CONFIGS / "kimi-k2-thinking")
    fits = {f.precision.name: f for f in plans.plan(config, Parallel()).fits}
    assert fits["int4-g32"].precision.shipped and not fits["fp8"].precision.shipped
    assert fits["int4-g32"].weight_bytes == pytest.approx(594e9, rel=0.02)
    assert fits["fp8"].weight_bytes == pytest.approx(1.03e12, rel=0.02)
    # its ignore list keeps attention, shared experts and dense MLPs in bf16: what the
    # generic int4 row (routed experts only) quantizes too
    generic = plans.Precision("int4-g32", 4, 32, experts_only=True)
    weights = plans.model_weights(config, Parallel(8))
    shipped = fits["int4-g32"].precision
    assert [shipped.quantizes(w, True) for w in weights] == [
        generic.quantizes(w, True) for w in weights
    ]


def test_more_gpus_leave_more_pages_and_fp8_kv_twice_the_pages():
    config = read_config(CONFIGS / "deepseek-v3")
    at8 = {f.precision.name: f for f in plans.plan(config, Parallel(8)).fits}
    at16 = {f.precision.name: f for f in plans.plan(config, Parallel(16)).fits}
    assert at8["bf16"].kv_pages["bf16"] == 0  # 170 GB of weights a GPU: no H200 holds them
    assert at16["fp8"].kv_pages["bf16"] > at8["fp8"].kv_pages["bf16"] > 0
    pages = at16["fp8"].kv_pages
    assert pages["fp8"] in (2 * pages["bf16"], 2 * pages["bf16"] + 1)
    assert at16["fp8"].batch["bf16"] == pages["bf16"] // (8192 // 16)


def test_pages_are_what_the_budget_leaves(tmp_path):
    config = read_config(_written(tmp_path, TINY["llama"]()))
    p = plans.plan(config, Parallel(), card_bytes=2**30, reserve_bytes=2**28, context=100)
    fit = p.fits[0]
    # 2 layers x K, V x 2 KV heads x 16 dims x 2 bytes = 256 B a token, 4 KiB a page
    assert p.kv_bytes_per_token["bf16"] == 256
    assert fit.kv_pages["bf16"] == int((0.9 * 2**30 - fit.weight_bytes - 2**28) // 4096)
    assert fit.batch["bf16"] == fit.kv_pages["bf16"] // 7  # 100 tokens: 7 pages


def test_attention_data_parallel_replicates_attention_and_splits_experts():
    config = read_config(CONFIGS / "deepseek-v3")
    tp8 = plans.model_weights(config, Parallel(8))
    dp8 = plans.model_weights(config, Parallel(1, 8, expert_parallel=True))
    part = lambda ws, kind: sum(w.numel for w in ws if w.part == kind)  # noqa: E731
    whole = plans.model_weights(config, Parallel())
    assert part(dp8, "attention") == part(whole, "attention") > 5 * part(tp8, "attention")
    assert part(dp8, "experts") == part(tp8, "experts")
    assert part(dp8, "shared") == 8 * part(tp8, "shared")
    p = plans.plan(config, Parallel(1, 8, expert_parallel=True))
    fp8 = {f.precision.name: f for f in p.fits}["fp8"]
    assert fp8.batch["bf16"] == 8 * (fp8.kv_pages["bf16"] // 512)  # each rank its own rows


def test_kimi_linear_holds_state_slots_and_mla_pages_only():
    config = read_config(CONFIGS / "kimi-linear-48b-a3b-instruct")
    p = plans.plan(config, Parallel(8))
    assert p.parameters == pytest.approx(48e9, rel=0.05)
    assert p.kv_bytes_per_token["bf16"] == 7 * 576 * 2  # 7 MLA layers of 27
    assert p.state_slots == 256  # as the engine's limits give a model of its size
    assert all(f.batch["bf16"] <= 256 for f in p.fits)


def test_unsplittable_layout_is_a_value_error():
    config = read_config(CONFIGS / "kimi-k2-instruct")
    with pytest.raises(ValueError, match="num_attention_heads=64"):
        plans.model_weights(config, Parallel(128))


def test_hub_id_reads_config_json_from_the_local_cache(tmp_path):
    snapshot = tmp_path / "models--moonshotai--Kimi-K2-Thinking" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    shutil.copy(CONFIGS / "kimi-k2-thinking" / "config.json", snapshot / "config.json")
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("abc123")
    config = read_config("moonshotai/Kimi-K2-Thinking", cache_dir=tmp_path)
    assert config.n_routed_experts == 384


def test_cli_prints_a_row_a_precision(capsys):
    assert main(["plan", str(CONFIGS / "kimi-k2-thinking"), "--gpus", "8"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("|")][2:]
    assert [r.split("|")[1].strip() for r in rows] == ["bf16", "fp8", "int4-g32 *", "int4-g128"]
    assert "TP 8, EP 8 on 8 x h200" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--gpus", "8", "--tp", "3"], "--gpus 8 is not --tp 3 x --dp 1"),
        (["--gpus", "3"], "does not split over 3 GPUs"),
        (["--gpu", "z80"], "--gpu must be one of"),
    ],
)
def test_cli_usage_errors_exit_2(caplog, argv, message):
    assert main(["plan", str(CONFIGS / "deepseek-v3"), *argv]) == 2
    assert message in caplog.text


def test_format_table_is_markdown():
    from batchgen.api.plan_command import format_plan

    config = read_config(CONFIGS / "deepseek-v3")
    table = [
        line
        for line in format_plan(plans.plan(config, Parallel(16))).splitlines()
        if line.startswith("|")
    ]
    assert len(table) == 2 + len(plans.PRECISIONS)
    assert all(line.count("|") == 7 for line in table)


def test_one_rank_keeps_room_for_the_sampling_decode_graphs():
    """On one rank the engine keeps the sampling decode graphs' logits and penalty
    counts out of the KV pool (a tensor-parallel group samples after the replay): a
    151,936-token vocabulary at 1,024 rows takes over 1.5 GiB more of the estimate."""
    from types import SimpleNamespace

    config = SimpleNamespace(
        vocab_size=151936, hidden_size=64, intermediate_size=128, model_type="qwen3"
    )
    limits = plans.Limits(max_num_seqs=1024, max_num_batched_tokens=1024)
    one = plans.activation_reserve(config, Parallel(1), limits)
    two = plans.activation_reserve(config, Parallel(2), limits)
    assert one - two > 1.5 * 2**30  # the sampler's step dominates both: tp leaves it
    fewer = plans.Limits(max_num_seqs=256, max_num_batched_tokens=1024)
    assert plans.activation_reserve(config, Parallel(1), fewer) < one
