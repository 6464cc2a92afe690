"""``--drafter auto`` and the hub presets (daemon/models/drafter_auto.py, hub_presets.py), on GGUF files
that are only a header (tests/gguf_vocab.py): which pulled model is chosen, which is refused, what the
line says when none is there. No model is loaded and nothing reaches a network."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from tandem.daemon import models
from tandem.daemon.config import ServeError
from tandem.daemon.models import drafter_auto, hub
from tandem.daemon.models.drafter_auto import choose, pick_drafter, tokenizer_mismatch, vocab_of
from tandem.daemon.models.hub_presets import FAMILY_DRAFTERS, HUB_PRESETS, PYPI_DRAFTERS
from tandem.daemon.models.vocab import vocab_mismatch
from tandem.protocol import ModelInfo
from tests.gguf_vocab import tokens_of, write_header_gguf

A = [f"a{i}".encode() for i in range(5000)]  # a tokenizer (more than one 4,096-id block)
B = [f"b{i}".encode() for i in range(5000)]  # another, of the same size
C = [f"c{i}".encode() for i in range(5000)]  # a third
MB, GB = 1 << 20, 1 << 30


@pytest.fixture
def store(tmp_path, monkeypatch) -> Path:
    """An empty model store of this test's own."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return models.models_dir()


def test_the_token_list_is_read_from_the_header_alone(tmp_path):
    path = write_header_gguf(tmp_path / "m.gguf", A, size=2 * GB)  # (sparse: nothing past the header is read)
    assert vocab_of(path).count == 5000
    assert tokens_of(path) == A


@pytest.mark.parametrize(
    "drafter, why",
    [
        (A, None),
        (A[:-128], None),  # the target padded past the drafter (Qwen2.5 7B+ vs 0.5B-3B: 128 ids)
        (A[:-129], "vocabulary sizes differ (4,871 vs 5,000 tokens)"),
        (A + [b"more"], "vocabulary sizes differ (5,001 vs 5,000 tokens)"),  # ids the target lacks
        (A[:4500] + [b"other"] + A[4501:], "token texts differ"),
        (B, "token texts differ"),
    ],
)
def test_a_drafter_fits_when_its_tokens_are_the_targets_or_their_start(tmp_path, drafter, why):
    target = write_header_gguf(tmp_path / "t.gguf", A)
    d = write_header_gguf(tmp_path / "d.gguf", drafter)
    got = tokenizer_mismatch(target, d, "T", "D")
    if why is None:
        assert got is None
    else:
        assert got.startswith("drafter D does not fit target T: ") and why in got


def info(name: str, n_vocab: int, digests: list[str]) -> ModelInfo:
    return ModelInfo(
        name=name,
        path=f"/m/{name}",
        n_ctx=512,
        n_ctx_train=512,
        n_vocab=n_vocab,
        size_bytes=1,
        has_chat_template=True,
        vocab_digests=digests,
    )


def test_the_daemons_check_accepts_a_target_padded_past_its_drafter():
    blocks = [f"{i:016x}" for i in range(38)]
    qwen_7b, qwen_05b = 152_064, 151_936  # both 38 blocks of 4,096 ids; only the last, partial one differs
    assert vocab_mismatch(info("7b", qwen_7b, blocks[:-1] + ["7"]), info("05b", qwen_05b, blocks[:-1] + ["5"])) is None
    other = blocks[:5] + ["x"] + blocks[6:]
    assert "token texts differ for ids 20,480-24,575" in vocab_mismatch(
        info("7b", qwen_7b, blocks), info("05b", qwen_05b, other)
    )
    assert "vocabulary sizes differ" in vocab_mismatch(info("t", qwen_05b + 129, blocks), info("d", qwen_05b, blocks))
    assert "vocabulary sizes differ" in vocab_mismatch(info("t", qwen_05b, blocks), info("d", qwen_7b, blocks))
    assert (
        "token texts differ"
        in vocab_mismatch(  # equal sizes: every block, the last one too, as before
            info("t", qwen_05b, blocks), info("d", qwen_05b, blocks[:-1] + ["y"])
        )
    )


def test_auto_takes_the_presets_drafter_where_it_is_pulled(store):
    target = write_header_gguf(models.preset_path("qwen2.5-coder-1.5b"), A, "qwen2", size=1100 * MB)
    write_header_gguf(models.preset_path("qwen2.5-coder-0.5b"), A[:-100], "qwen2", size=490 * MB)  # (padded)
    got = choose("qwen2.5-coder-1.5b", "qwen2.5-coder-1.5b", target)
    assert (got.name, got.path) == ("qwen2.5-coder-0.5b", models.preset_path("qwen2.5-coder-0.5b"))
    assert got.why == "auto: qwen2.5-coder-0.5b, the drafter for qwen2.5-coder-1.5b"


def test_auto_passes_over_a_recommended_drafter_with_other_tokens(store, caplog):
    target = write_header_gguf(models.preset_path("qwen2.5-coder-1.5b"), A, "qwen2", size=1100 * MB)
    write_header_gguf(models.preset_path("qwen2.5-coder-0.5b"), B, "qwen2", size=490 * MB)
    small = write_header_gguf(store / "small-a.gguf", A, size=100 * MB)
    with caplog.at_level(logging.WARNING, logger="tandem.models"):
        got = choose("qwen2.5-coder-1.5b", "qwen2.5-coder-1.5b", target)
    assert (got.name, got.path) == ("small-a.gguf", small)
    assert "qwen2.5-coder-0.5b does not fit target qwen2.5-coder-1.5b: token texts differ" in caplog.text


def test_auto_scans_the_store_for_a_small_model_with_the_targets_tokenizer(store, tmp_path):
    target = write_header_gguf(tmp_path / "elsewhere" / "big.gguf", A, size=8 * GB)  # a path, no preset
    write_header_gguf(store / "a-512m.gguf", A, size=512 * MB)
    write_header_gguf(store / "a-900m.gguf", A, size=900 * MB)  # the largest at most 1/8 of the target
    write_header_gguf(store / "a-3g.gguf", A, size=3 * GB)
    write_header_gguf(store / "a-5g.gguf", A, size=5 * GB)  # over half the target: never
    write_header_gguf(store / "b-1g.gguf", B, size=GB)  # another tokenizer: never
    got = choose(str(target), "big.gguf", target)
    assert got.name == "a-900m.gguf"
    assert got.why == "auto: a-900m.gguf, a pulled model with big.gguf's tokenizer at 11% of its size"
    for f in ("a-512m.gguf", "a-900m.gguf"):
        (store / f).unlink()
    assert choose(str(target), "big.gguf", target).name == "a-3g.gguf"  # else the smallest at most half
    (store / "a-3g.gguf").unlink()
    assert choose(str(target), "big.gguf", target).path is None


def test_auto_without_a_fitting_model_names_the_one_to_pull(store, tmp_path):
    target = write_header_gguf(models.preset_path("qwen2.5-coder-1.5b"), A, "qwen2", size=1100 * MB)
    write_header_gguf(store / "b.gguf", B, size=100 * MB)
    got = choose("qwen2.5-coder-1.5b", "qwen2.5-coder-1.5b", target)
    assert (got.name, got.path) == ("none", None)
    assert "no pulled model has qwen2.5-coder-1.5b's tokenizer" in got.why
    assert got.why.endswith("to draft with one: tandem pull qwen2.5-coder-0.5b")
    # a model that is no preset (and no model in the store with its tokens): a drafter of its family, where
    # one is small enough
    qwen3 = write_header_gguf(tmp_path / "q3.gguf", C, "qwen3moe", size=18 * GB)
    assert choose(str(qwen3), "q3.gguf", qwen3).why.endswith("tandem pull qwen3-0.6b")
    llama = write_header_gguf(tmp_path / "l.gguf", C, "llama", size=18 * GB)
    assert choose(str(llama), "l.gguf", llama).why.endswith("--drafter ngram or suffix drafts from the context instead")
    tiny = write_header_gguf(tmp_path / "tiny-qwen2.gguf", C, "qwen2", size=600 * MB)  # the 0.5B is no drafter for it
    assert "tandem pull" not in choose(str(tiny), "tiny-qwen2.gguf", tiny).why


def test_a_hub_preset_is_listed_under_its_name_once_pulled(store):
    ref = HUB_PRESETS["qwen2.5-coder-7b"].ref
    assert not models.is_pulled("qwen2.5-coder-7b") and models.needs_pull("qwen2.5-coder-7b")
    with pytest.raises(models.ModelError, match="not pulled yet; run: tandem pull qwen2.5-coder-7b"):
        models.resolve("qwen2.5-coder-7b")
    # what hub.pull leaves: the file and its manifest
    folder = hub.repo_dir(ref.repo)
    path = write_header_gguf(folder / "qwen2.5-coder-7b-instruct-q4_k_m.gguf", A, "qwen2")
    size = path.stat().st_size
    entry = {"name": path.name, "size": size, "sha256": "0" * 64}
    manifest = {"repo": ref.repo, "quant": "Q4_K_M", "revision": "c" * 40, "default": False, "files": [entry]}
    (folder / "Q4_K_M.json").write_text(json.dumps(manifest))
    assert models.resolve("qwen2.5-coder-7b") == ("qwen2.5-coder-7b", path)
    assert not models.needs_pull("qwen2.5-coder-7b")
    rows = {name: p for name, p, _ in models.list_models()}
    assert rows["qwen2.5-coder-7b"] == path and f"hf.co/{ref.repo}:Q4_K_M" not in rows  # (once, by its name)
    assert ("qwen2.5-coder-7b", path) in drafter_auto.pulled_models()


def test_pick_drafter_checks_a_padded_drafter_from_the_files(tmp_path):
    target = write_header_gguf(tmp_path / "t.gguf", A)
    fits = write_header_gguf(tmp_path / "fits.gguf", A[:4900])
    tail = write_header_gguf(tmp_path / "tail.gguf", A[:4500] + [b"other"] + A[4501:4900])  # past the last whole block
    other = write_header_gguf(tmp_path / "other.gguf", B)

    def resolve(m: str):
        return Path(m).name, Path(m)

    for setting in ("none", "ngram", "suffix"):
        assert pick_drafter(setting, "t", "t.gguf", target, resolve) == (setting, None, "")
    assert pick_drafter(str(fits), "t", "t.gguf", target, resolve) == ("fits.gguf", fits, "")
    with pytest.raises(ServeError, match="drafter tail.gguf does not fit target t.gguf: token texts differ"):
        pick_drafter(str(tail), "t", "t.gguf", target, resolve)
    # the same size: left to the daemon's check once both are loaded (it compares every block)
    assert pick_drafter(str(other), "t", "t.gguf", target, resolve) == ("other.gguf", other, "")


def test_the_hub_presets_are_well_formed():
    names = models.preset_names()
    assert len(names) == len(set(names))  # no hub preset takes a PyPI preset's name
    for p in HUB_PRESETS.values():
        ref = p.ref
        assert ref.quant and ref.quant == ref.quant.upper() and hub.is_hub_name(p.source)
        assert p.revision is None or len(p.revision) == 40
        if p.drafter is not None:
            assert p.drafter in names
            drafter = HUB_PRESETS.get(p.drafter)
            approx = drafter.approx_bytes if drafter else models.PRESETS[p.drafter].size_bytes
            assert approx <= p.approx_bytes / 4  # a drafter that can pay
    assert set(PYPI_DRAFTERS) <= set(models.PRESETS) and set(PYPI_DRAFTERS.values()) <= set(names)
    assert set(FAMILY_DRAFTERS.values()) <= set(names)
