"""The GGUF header reader behind /api/tags and /api/show: right on the real
model file, fast, and never failing (or running away) on a damaged or hostile
file."""

from __future__ import annotations

import struct
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem.daemon.models.gguf_meta import GGUFError, facts, read_metadata, weight_profile


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


def test_weight_profile_counts_what_the_gguf_package_reads(smollm2_path):
    import gguf

    reader = gguf.GGUFReader(smollm2_path)
    matrices = [t for t in reader.tensors if len(t.shape) >= 2]
    params = sum(int(t.n_elements) for t in matrices)
    bits = 8 * sum(int(t.n_bytes) for t in matrices) / params
    got = weight_profile(smollm2_path)
    assert got[0] == params == 134_479_872
    assert abs(got[1] - bits) < 0.01  # (a tensor's bytes here run to the next one's offset: its padding too)


def test_weight_profile_refuses_a_damaged_table(tmp_path, smollm2_path):
    data = bytearray(smollm2_path.read_bytes()[: 4 << 20])  # the header and the table, cut
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[:4096])  # inside the vocabulary
    with pytest.raises(GGUFError):
        weight_profile(path)
    data[8:16] = struct.pack("<Q", 2**40)  # a tensor count beyond any file
    path.write_bytes(data)
    with pytest.raises(GGUFError):
        weight_profile(path)


def test_a_token_longer_than_the_file_is_refused(tmp_path):
    # (seeking past it raised ValueError: a daemon reading a drafter's header died of it)
    tokens = kv_array("tokenizer.ggml.tokens", 8, 1, struct.pack("<Q", 2**63))
    path = tmp_path / "long.gguf"
    path.write_bytes(header(tokens))
    for read in (read_metadata, weight_profile):
        with pytest.raises(GGUFError):
            read(path)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> bytes:
    """A small GGUF written by the gguf package: a 4x32 F32 matrix and an 8-element vector."""
    import gguf
    import numpy as np

    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    out = gguf.GGUFWriter(str(path), "llama")
    out.add_tensor("a.weight", np.ones((4, 32), np.float32))
    out.add_tensor("b.bias", np.ones(8, np.float32))
    out.write_header_to_file()
    out.write_kv_data_to_file()
    out.write_tensors_to_file()
    out.close()
    return path.read_bytes()


def test_weight_profile_of_a_written_file(tmp_path, tiny_gguf):
    path = tmp_path / "tiny.gguf"
    path.write_bytes(tiny_gguf)
    assert weight_profile(path) == (128, 32.0)  # the matrix only, at 32 bits


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(flips=st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 255)), max_size=8), cut=st.integers(0, 1024))
def test_a_damaged_table_gives_a_profile_or_gguf_error_never_another_exception(tmp_path, tiny_gguf, flips, cut):
    data = bytearray(tiny_gguf)
    for at, value in flips:
        data[at % len(data)] = value
    path = tmp_path / "fuzz.gguf"
    path.write_bytes(bytes(data[: len(data) - cut]))
    for read in (read_metadata, weight_profile):
        try:
            read(path)
        except GGUFError:
            pass
