"""A tiny BERT-style embedding model as a GGUF file, for tests: llama.cpp's ``bert``
architecture (an encoder: no KV cache, attention both ways), a WordPiece vocabulary
with BERT's special tokens at their usual ids, ``bert.pooling_type`` CLS, and random
weights. No real embedding model can be had on the test machines (no PyPI package
ships one as GGUF, no hub), so this is what exercises the path such a model takes:
its own pooling read from the file, an encoder's pass, [CLS] ... [SEP] around a text."""

from __future__ import annotations

import string
from pathlib import Path

import numpy as np

N_EMBD, N_HEAD, N_FF, N_LAYER, N_CTX = 32, 2, 64, 2, 128
WORDS = "the a cat sat on mat kitten rug dog def return function sum add market stock revenue grew".split()
POOLING_CLS = 2  # llama.cpp's LLAMA_POOLING_TYPE_CLS


def vocabulary() -> list[str]:
    tokens = [f"[unused{i}]" for i in range(104)]
    tokens[0], tokens[100], tokens[101], tokens[102], tokens[103] = "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"
    letters = list(string.ascii_lowercase + string.digits + string.punctuation)
    words = [w for w in WORDS if w not in letters]
    # as llama.cpp's converter writes a WordPiece vocabulary: a word's first piece after "▁", "##" dropped
    return tokens + ["\u2581" + t for t in words + letters] + letters


def write_tiny_bert(path: Path, seed: int = 0) -> Path:
    import gguf

    rng = np.random.default_rng(seed)
    tokens = vocabulary()

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    out = gguf.GGUFWriter(str(path), "bert")
    out.add_name("tiny-bert-test")
    out.add_context_length(N_CTX)
    out.add_embedding_length(N_EMBD)
    out.add_feed_forward_length(N_FF)
    out.add_block_count(N_LAYER)
    out.add_head_count(N_HEAD)
    out.add_layer_norm_eps(1e-12)
    out.add_causal_attention(False)
    out.add_pooling_type(gguf.PoolingType(POOLING_CLS))
    out.add_file_type(gguf.LlamaFileType.ALL_F32)
    out.add_tokenizer_model("bert")
    out.add_token_list(tokens)
    out.add_token_types([3 if t.startswith("[") else 1 for t in tokens])  # control, normal
    out.add_token_type_count(2)
    out.add_tensor("token_embd.weight", w(len(tokens), N_EMBD))
    out.add_tensor("token_types.weight", w(2, N_EMBD))
    out.add_tensor("position_embd.weight", w(N_CTX, N_EMBD))
    out.add_tensor("token_embd_norm.weight", np.ones(N_EMBD, np.float32))
    out.add_tensor("token_embd_norm.bias", np.zeros(N_EMBD, np.float32))
    for i in range(N_LAYER):
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            out.add_tensor(f"blk.{i}.{name}.weight", w(N_EMBD, N_EMBD))
            out.add_tensor(f"blk.{i}.{name}.bias", w(N_EMBD))
        for name in ("attn_output_norm", "layer_output_norm"):
            out.add_tensor(f"blk.{i}.{name}.weight", np.ones(N_EMBD, np.float32))
            out.add_tensor(f"blk.{i}.{name}.bias", np.zeros(N_EMBD, np.float32))
        out.add_tensor(f"blk.{i}.ffn_up.weight", w(N_FF, N_EMBD))
        out.add_tensor(f"blk.{i}.ffn_up.bias", w(N_FF))
        out.add_tensor(f"blk.{i}.ffn_down.weight", w(N_EMBD, N_FF))
        out.add_tensor(f"blk.{i}.ffn_down.bias", w(N_EMBD))
    out.write_header_to_file()
    out.write_kv_data_to_file()
    out.write_tensors_to_file()
    out.close()
    return path
