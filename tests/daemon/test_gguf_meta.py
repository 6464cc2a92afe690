"""The GGUF header reader behind /api/tags and /api/show: right on the real
model file, fast, and never failing (or running away) on a damaged or hostile
file."""

from __future__ import annotations

import struct
import time

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem.daemon.models.gguf_meta import GGUFError, facts, read_metadata


def test_the_real_models_facts(smollm2_path):
    f = facts(smollm2_path)
    assert (f["architecture"], f["parameter_size"], f["quantization"], f["context_length"]) == (
        "llama",
        "135M",
        "Q4_1",
        8192,
    )
    assert "{% for message in messages %}" in f["chat_template"]
    assert not any(k.startswith("tokenizer.") for k in f["metadata"])  # the vocabulary is skipped, not kept


def header(*kvs: bytes, n_kv: int | None = None) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, 0, len(kvs) if n_kv is None else n_kv) + b"".join(kvs)


def kv_string(key: str, value: bytes) -> bytes:
    k = key.encode()
    return struct.pack("<Q", len(k)) + k + struct.pack("<I", 8) + struct.pack("<Q", len(value)) + value


def kv_array(key: str, item: int, count: int, payload: bytes = b"") -> bytes:
    k = key.encode()
    return struct.pack("<Q", len(k)) + k + struct.pack("<IIQ", 9, item, count) + payload


def test_counts_beyond_the_file_are_refused_at_once(tmp_path):
    path = tmp_path / "bad.gguf"
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):  # the vocabulary's own walk, and the general one
        path.write_bytes(header(kv_array(key, 8, 2**40)))  # 2**40 strings in a few bytes
        t0 = time.monotonic()
        try:
            read_metadata(path)
            raise AssertionError("accepted")
        except GGUFError as exc:
            assert "fits the file" in str(exc) or "more than the file holds" in str(exc)
        assert time.monotonic() - t0 < 1
        assert facts(path) == {}
    path.write_bytes(header(kv_array("nested", 9, 1, struct.pack("<IQ", 8, 0))))  # an array of arrays
    assert facts(path) == {}
    path.write_bytes(header(kv_string("general.architecture", b"llama"), n_kv=2**40))
    assert facts(path) == {}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=300), cut=st.integers(0, 400))
def test_any_bytes_give_facts_or_nothing_never_an_exception(tmp_path, smollm2_path, data, cut):
    path = tmp_path / "fuzz.gguf"
    real = smollm2_path.read_bytes()[:4096]
    path.write_bytes(real[:cut] + data)  # a real header cut anywhere, then garbage
    out = facts(path)
    assert isinstance(out, dict)
