"""--ctx-size auto within --kv-budget, from the GGUF header (models/context_size.py),
on the model files this machine has and on headers written for the case."""

from __future__ import annotations

import struct

import pytest

from tandem.daemon import config
from tandem.daemon.models.context_size import (
    MIN_CONTEXT,
    ContextError,
    choose_context,
    kv_bytes_per_token,
)
from tandem.daemon.models.gguf_meta import read_metadata

QWEN_05B = {  # Qwen2.5-Coder-0.5B's header, as read from its GGUF
    "general.architecture": "qwen2",
    "qwen2.block_count": 24,
    "qwen2.context_length": 32768,
    "qwen2.embedding_length": 896,
    "qwen2.attention.head_count": 14,
    "qwen2.attention.head_count_kv": 2,
}


def test_kv_bytes_per_token_follow_the_header_and_the_type():
    # 24 layers x 2 KV heads x (64 + 64) dims x 2 bytes
    assert kv_bytes_per_token(QWEN_05B) == 24 * 2 * 128 * 2 == 12288
    assert kv_bytes_per_token(QWEN_05B, "q8_0") == 24 * 2 * 128 * 34 // 32
    assert kv_bytes_per_token(QWEN_05B, "q4_0") == 24 * 2 * 128 * 18 // 32
    explicit = {**QWEN_05B, "qwen2.attention.key_length": 128, "qwen2.attention.value_length": 128}
    assert kv_bytes_per_token(explicit) == 2 * kv_bytes_per_token(QWEN_05B)
    per_layer = {**QWEN_05B, "qwen2.attention.head_count_kv": [2, 4] * 12}  # the widest layer counts
    assert kv_bytes_per_token(per_layer) == 2 * kv_bytes_per_token(QWEN_05B)
    with pytest.raises(ContextError, match="block_count"):
        kv_bytes_per_token({"general.architecture": "x"})


def test_the_default_context_is_the_trained_one_where_it_fits_else_the_longest_that_does(coder_path, smollm2_path):
    per_token = kv_bytes_per_token(read_metadata(coder_path))
    fits = choose_context(None, coder_path, budget=1 << 30)
    assert fits.n_ctx == fits.trained == 32768 and fits.kv_bytes == 32768 * per_token
    assert "trained context" in fits.note and "384 MiB" in fits.note and "1.0 GiB budget" in fits.note
    cut = choose_context(None, coder_path, budget=100 << 20)
    assert cut.n_ctx == (100 << 20) // per_token // 1024 * 1024 == 8192 and cut.trained == 32768
    assert "not the model's 32,768" in cut.note and "--kv-type q8_0" in cut.note
    assert choose_context(None, coder_path, kv_type="q8_0", budget=100 << 20).n_ctx > cut.n_ctx
    assert choose_context(None, coder_path, budget=1 << 20).n_ctx == MIN_CONTEXT  # never shorter than this
    # a model drafter's KV cache counts in the same budget
    both = choose_context(None, coder_path, drafter=coder_path, budget=500 << 20)
    assert both.n_ctx < 32768 and both.kv_bytes <= 500 << 20
    asked = choose_context(4096, smollm2_path, budget=1 << 20)  # asked for: taken as given, over the budget
    assert asked.n_ctx == 4096 and "(--ctx-size)" in asked.note
    # what the budget leaves beside them (a prompt reader's KV cache must fit in it): none when over it
    assert fits.room == (1 << 30) - 32768 * per_token and asked.room == 0


def test_kv_type_and_budget_are_settings_and_a_quantized_cache_needs_flash_attention():
    s = config.load({"kv_type": "q8_0", "kv_budget": "2G"}, environ={})
    assert s.values.kv_type == "q8_0" and s.values.kv_budget == 2 << 30
    config.check(s)
    with pytest.raises(config.ConfigError, match="needs flash attention"):
        config.check(config.load({"kv_type": "q4_0", "flash_attn": "off"}, environ={}))
    with pytest.raises(config.ConfigError, match="kv_type"):
        config.load({"kv_type": "q5_1"}, environ={})


def test_a_model_without_attention_heads_gets_a_context_without_a_budget(tmp_path):
    arch = b"mamba"
    k = b"general.architecture"
    header = struct.pack("<Q", len(k)) + k + struct.pack("<IQ", 8, len(arch)) + arch
    ctx = b"mamba.context_length"
    header += struct.pack("<Q", len(ctx)) + ctx + struct.pack("<II", 4, 1 << 20)
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 2) + header)
    auto = choose_context(None, path, budget=1 << 20)
    assert auto.n_ctx == 8192 and auto.kv_bytes == 0 and "not known" in auto.note and auto.room == -1
    assert choose_context(3000, path).n_ctx == 3000
