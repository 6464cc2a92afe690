"""Hugging Face model names and the choice of a repository's GGUF (daemon/models/hub.py), without a hub."""

from __future__ import annotations

import json

import pytest

from tandem.daemon.models import ModelError, hub


@pytest.mark.parametrize(
    "name, repo, quant",
    [
        ("hf.co/Qwen/Qwen2.5-Coder-7B-Instruct-GGUF", "Qwen/Qwen2.5-Coder-7B-Instruct-GGUF", None),
        ("hf.co/Qwen/Qwen2.5-Coder-7B-Instruct-GGUF:q4_k_m", "Qwen/Qwen2.5-Coder-7B-Instruct-GGUF", "Q4_K_M"),
        ("huggingface.co/bartowski/gemma-3-4b-it-GGUF:IQ3_XXS", "bartowski/gemma-3-4b-it-GGUF", "IQ3_XXS"),
        ("https://huggingface.co/unsloth/gpt-oss-20b-GGUF/", "unsloth/gpt-oss-20b-GGUF", None),
        ("hf://ggml-org/Qwen3-0.6B-GGUF:Q8_0", "ggml-org/Qwen3-0.6B-GGUF", "Q8_0"),
        ("https://hf.co/ggml-org/Qwen3-0.6B-GGUF", "ggml-org/Qwen3-0.6B-GGUF", None),
        ("hf.co/ggml-org/Qwen3-0.6B-GGUF:latest", "ggml-org/Qwen3-0.6B-GGUF", None),  # (Ollama's tag: the default)
    ],
)
def test_names_parse_to_a_repository_and_a_quant(name, repo, quant):
    ref = hub.parse(name)
    assert (ref.repo, ref.quant) == (repo, quant)
    assert hub.is_hub_name(name)
    assert hub.parse(ref.name) == ref


@pytest.mark.parametrize("name", ["hf.co/justone", "hf.co/a/b/c", "hf.co/a/b:", "hf.co/a/b:Q4 K", "hf.co/../b", ""])
def test_malformed_names_say_what_a_name_looks_like(name):
    with pytest.raises(ModelError, match="hf.co/ORG/REPO:QUANT"):
        hub.parse(name)


def test_the_quant_is_read_from_the_file_name_or_its_folder():
    assert hub.quant_of("qwen2.5-coder-7b-instruct-q4_k_m.gguf") == "Q4_K_M"
    assert hub.quant_of("Qwen3-Coder-30B-A3B-Instruct-UD-Q4_K_XL.gguf") == "UD-Q4_K_XL"
    assert hub.quant_of("gpt-oss-20b-MXFP4.gguf") == "MXFP4"
    assert hub.quant_of("model.BF16.gguf") == "BF16"
    assert hub.quant_of("Q4_K_M/model-Q4_K_M-00001-of-00002.gguf") == "Q4_K_M"
    assert hub.quant_of("mmproj-model-f16.gguf") is None  # a vision projector is not a model to serve
    assert hub.quant_of("README.md") is None


FILES = [
    "README.md",
    "model-Q4_K_M.gguf",
    "model-Q8_0-00001-of-00003.gguf",
    "model-Q8_0-00002-of-00003.gguf",
    "model-Q8_0-00003-of-00003.gguf",
    "model-Q6_K-00001-of-00002.gguf",
    "mmproj-model-f16.gguf",
]


def test_the_default_quant_a_named_one_and_split_parts_in_order():
    assert hub.choose(hub.HubRef("o/r"), FILES) == ("Q4_K_M", ["model-Q4_K_M.gguf"])
    quant, files = hub.choose(hub.HubRef("o/r", "Q8_0"), FILES)
    assert quant == "Q8_0" and files == [f"model-Q8_0-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    with pytest.raises(ModelError, match="split parts are not all there"):
        hub.choose(hub.HubRef("o/r", "Q6_K"), FILES)


def test_what_is_missing_is_named_with_what_there_is():
    with pytest.raises(ModelError) as err:
        hub.choose(hub.HubRef("o/r", "Q5_K_M"), FILES)
    assert "no Q5_K_M GGUF (asked for); it has Q4_K_M, Q6_K, Q8_0" in str(err.value)
    assert hub.choose(hub.HubRef("o/r"), ["only-Q8_0.gguf"]) == ("Q8_0", ["only-Q8_0.gguf"])  # one quant: it
    with pytest.raises(ModelError, match="no GGUF files"):
        hub.choose(hub.HubRef("o/r"), ["model.safetensors", "config.json"])


def test_a_pulled_model_is_found_from_its_manifest_only_when_every_file_is_whole(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    folder = hub.repo_dir("o/r")
    folder.mkdir(parents=True)
    (folder / "m-Q4_K_M.gguf").write_bytes(b"x" * 10)
    manifest = {"repo": "o/r", "quant": "Q4_K_M", "revision": "c" * 40, "default": True,
                "files": [{"name": "m-Q4_K_M.gguf", "size": 10, "sha256": "s"}]}  # fmt: skip
    (folder / "Q4_K_M.json").write_text(json.dumps(manifest))
    assert hub.pulled(hub.HubRef("o/r")) == folder / "m-Q4_K_M.gguf"
    assert hub.pulled(hub.HubRef("o/r", "Q4_K_M")) == folder / "m-Q4_K_M.gguf"
    assert hub.pulled(hub.HubRef("o/r", "Q8_0")) is None
    (folder / "m-Q4_K_M.gguf").write_bytes(b"x" * 9)  # cut short: not pulled
    assert hub.pulled(hub.HubRef("o/r")) is None
    (folder / "Q4_K_M.json").write_text("{not json")  # a broken manifest is no model, and no crash
    assert hub.pulled(hub.HubRef("o/r")) is None and hub.pulled_models() == []
