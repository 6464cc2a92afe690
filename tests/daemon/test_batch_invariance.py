"""Batch invariance: the load probe (``LlamaModel.batch_invariance``) against a
longer, independent check, and the default settings' promise.

Which kernels llama.cpp picks depends on the CPU (AVX2 vs AVX-512/AMX builds,
repacking), so these tests do not encode one machine's rounding: the first
asserts that the probe's answer agrees with what a long prompt shows on *this*
CPU, whatever that answer is; the second asserts the product's default, which
was measured invariant on an AVX-512/AMX Xeon and on an AVX2-only build
(bench/experiments/batch_invariance.py, bench/README.md).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from tandem.daemon.cache.kv_pages import assemble, cut, parse

PAGE = 16
LONG_TEXT = (
    "Dear team, the quarterly report is attached. Revenue rose in the north and fell in the south; "
    "the new warehouse opened two weeks late because the permits were slow. "
    "SELECT id, name, total FROM orders WHERE total > 100 ORDER BY total DESC LIMIT 20;\n"
    "for (int i = 0; i < n; ++i) { sum += values[i] * weights[i]; }\n"
)


def really_invariant(model, n_tokens: int = 300) -> bool:
    """The paths a daemon takes, on a prompt past 256 tokens (where one-token
    flash attention splits across threads in llama.cpp's fast kernels), with the
    prefix restored through real pages."""
    tokens = model.tokenize(LONG_TEXT * 12, add_special=True)[:n_tokens]
    assert len(tokens) == n_tokens
    model.clear()
    whole = model.decode(tokens)[0]
    cached = (n_tokens - 1) // PAGE * PAGE
    model.clear()
    model.decode(tokens[:cached])
    p = parse(model.seq_state())
    pages = [cut(p, i * PAGE, (i + 1) * PAGE) for i in range(cached // PAGE)]
    model.set_seq_state(assemble(p.layout, pages, PAGE), cached)
    restored = model.decode(tokens[cached:])[0]
    model.clear()
    model.decode(tokens[:-4])
    rows = model.decode(tokens[-4:], logits_for=range(4))
    model.truncate(n_tokens - 4)
    singles = [model.decode([t])[0] for t in tokens[-4:]]
    model.clear()
    return (
        np.array_equal(restored, whole)
        and np.array_equal(rows[-1], whole)
        and all(np.array_equal(a, b) for a, b in zip(rows, singles))
    )


@pytest.mark.parametrize(
    "kernels, flash_attn",
    [("reference", True), ("fast", True), ("reference", False)],
    ids=["reference-flash", "fast-flash", "reference-no-flash"],
)
def test_the_load_probe_agrees_with_a_long_prompt(smollm2_path, kernels, flash_attn):
    from tandem.daemon.worker.llama_model import LlamaModel

    model = LlamaModel(smollm2_path, n_ctx=1024, flash_attn=flash_attn, reference_kernels=kernels == "reference")
    try:
        paths = model.batch_invariance()
        assert set(paths) == {"restore", "verify", "one_token", "small_batches", "exact_steps"}
        assert all(paths.values()) == really_invariant(model), paths
        assert model.n_past == 0  # the probe leaves the cache empty
    finally:
        model.close()


def test_fast_kernels_with_flash_attention_are_not_invariant_and_the_probe_says_so(smollm2_path):
    """The probe can fail: llama.cpp's tiled flash attention (64+ query rows)
    rounds differently from its one-row kernel on every x86 build."""
    from tandem.daemon.worker.llama_model import LlamaModel

    model = LlamaModel(smollm2_path, n_ctx=512, flash_attn=True, reference_kernels=False)
    try:
        assert not all(model.batch_invariance().values())
    finally:
        model.close()


@pytest.mark.parametrize("which", ["smollm2", "coder"])
def test_the_default_settings_are_batch_invariant(which, smollm2_path, coder_path):
    """The defaults (reference kernels, flash attention, no repacking) on the
    default model (Q4_1) and on Qwen2.5-Coder-0.5B (Q4_K_M)."""
    from tandem.daemon.worker.llama_model import LlamaModel

    model = LlamaModel(smollm2_path if which == "smollm2" else coder_path, n_ctx=1024)
    try:
        assert model.reference_kernels and model.flash_attn and not model.extra_buffers
        assert model.batch_invariance() == {
            "restore": True,
            "verify": True,
            "one_token": True,
            "small_batches": True,
            "exact_steps": True,
        }
        assert really_invariant(model)
    finally:
        model.close()


class StandInPlacement:
    """Stands in for devices.Placement: where the layers are ("" = all on the CPU)."""

    def __init__(self, key: str = ""):
        self._key = key

    def key(self) -> str:
        return self._key


class CountingModel:
    """Stands in for LlamaModel in the probe cache's pure logic: counts probes."""

    def __init__(self, path, verdict):
        self.path, self.verdict, self.probes = path, verdict, 0
        self.flash_attn, self.extra_buffers, self.n_batch, self.n_threads = True, False, 512, 2
        self.kv_type = "f16"
        self.step_rows = 0
        self.placement = StandInPlacement()

    def batch_invariance(self):
        self.probes += 1
        return dict(self.verdict)

    @staticmethod
    def runtime():
        return "0.3.36", "CPU : AVX2 = 1 | (a stand-in)"


def stand_in_config(tmp_path):
    """(a stand-in model file, the probe's state file, a target's WorkerConfig keeping verdicts there)"""
    from tandem.daemon.config import SettingsValues
    from tandem.daemon.worker.worker_config import WorkerConfig

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"not really a model")
    state = tmp_path / "state" / "batch-invariance.json"
    config = WorkerConfig(
        role="target", model_name="m", model_path=str(gguf), settings=SettingsValues(), probe_cache=str(state)
    )
    return gguf, state, config


def test_the_probe_verdict_is_kept_and_a_bad_file_only_means_probing_again(tmp_path):
    from tandem.daemon.worker.invariance import probe_batch_invariance

    gguf, state, config = stand_in_config(tmp_path)
    verdict = {"restore": True, "verify": False, "one_token": True, "small_batches": True, "exact_steps": True}
    model = CountingModel(gguf, verdict)
    assert probe_batch_invariance(model, config) == verdict and model.probes == 1
    assert probe_batch_invariance(model, config) == verdict and model.probes == 1  # kept
    config.settings = replace(config.settings, kernels="fast")  # another setting: probed again
    assert probe_batch_invariance(model, config) == verdict and model.probes == 2
    for junk in ("{not json", "[1, 2]", '{"x": 3}', "", "[" * 100_000, "{}"):
        state.write_text(junk)
        assert probe_batch_invariance(model, config) == verdict
    assert model.probes == 8
    key = next(iter(__import__("json").loads(state.read_text())))
    state.write_text('{"%s": {"restore": true}}' % key)  # a verdict with missing paths is not one
    assert probe_batch_invariance(model, config) == verdict and model.probes == 9
    gguf.write_bytes(b"another, longer model file")  # a changed file: probed again
    assert probe_batch_invariance(model, config) == verdict and model.probes == 10
    assert probe_batch_invariance(model, config) == verdict and model.probes == 10
    model.placement = StandInPlacement("layers=CUDA0:31")  # the layers on a GPU: the CPU's verdict says nothing
    assert probe_batch_invariance(model, config) == verdict and model.probes == 11
    assert probe_batch_invariance(model, config) == verdict and model.probes == 11
    model.placement = StandInPlacement()  # back on the CPU: its verdict is still kept
    assert probe_batch_invariance(model, config) == verdict and model.probes == 11
    model.extra_buffers, model.step_rows = True, 3  # repacked, steps in passes of 3 rows: probed again
    assert probe_batch_invariance(model, config) == verdict and model.probes == 12
    model.step_rows = 0  # the same buffers with unsplit steps: another verdict
    assert probe_batch_invariance(model, config) == verdict and model.probes == 13


def test_repacked_weights_keep_steps_exact_in_passes_of_up_to_three_rows(coder_path):
    """--kernels mixed with its default extra buffers (repacking, except on CPUs
    with AMX): a Q4_K model's steps run in passes of at most 3 rows, all through
    repack's one-row gemv, so a verify pass, a restore and one-token steps agree
    bit for bit. Without the limit, the probe's verdict still agrees with the long
    check, whatever this CPU's 4-row gemm gives."""
    from tandem.daemon.worker.llama_load import REPACK_STEP_ROWS, cpu_has_amx
    from tandem.daemon.worker.llama_model import LlamaModel

    model = LlamaModel(coder_path, n_ctx=1024, fast_prefill=True)
    try:
        assert model.extra_buffers is not cpu_has_amx()
        repacked = "CPU_REPACK" in model.placement.weights  # (the Q4_K/Q8_0 tensors llama.cpp repacks)
        assert repacked is model.extra_buffers
        assert model.step_rows == (REPACK_STEP_ROWS if repacked else 0)
        assert model.batch_invariance() == {
            "restore": True,
            "verify": True,
            "one_token": True,
            "small_batches": True,
            "exact_steps": True,
        }
        assert really_invariant(model)
        model.step_rows = 0  # every pass in one llama_decode: repack's gemm for 4 rows and more
        assert all(model.batch_invariance().values()) == really_invariant(model)
    finally:
        model.close()


def test_the_load_checks_verdicts_are_kept_beside_the_probes(tmp_path):
    """The fast-prefill and grouping checks read several hundred tokens at every
    start unless their verdict is kept: kept per check name and probe key, never
    a None (a check that could not run), and the probe's own verdict survives them."""
    from tandem.daemon.worker.invariance import kept_check, probe_batch_invariance

    gguf, state, config = stand_in_config(tmp_path)
    verdict = {"restore": True, "verify": True, "one_token": True, "small_batches": True, "exact_steps": True}
    model = CountingModel(gguf, verdict)
    runs = []

    def check(result):
        def run():
            runs.append(result)
            return result

        return run

    assert probe_batch_invariance(model, config) == verdict and model.probes == 1
    assert kept_check(model, config, "grouping group=256", check(True)) is True
    assert kept_check(model, config, "grouping group=256", check(False)) is True  # kept: not run again
    assert kept_check(model, config, "grouping group=128", check(False)) is False  # another name: run
    assert kept_check(model, config, "fast_prefill", check(None)) is None
    assert kept_check(model, config, "fast_prefill", check(None)) is None  # None is not kept: run again
    assert runs == [True, False, None, None]
    assert probe_batch_invariance(model, config) == verdict and model.probes == 1  # still kept beside them
    config.settings = replace(config.settings, kernels="reference")  # another setting: every check runs again
    assert kept_check(model, config, "grouping group=256", check(False)) is False and len(runs) == 5
    state.write_text("{not json")  # a corrupt file only means checking again
    assert kept_check(model, config, "grouping group=256", check(True)) is True and len(runs) == 6
    assert kept_check(model, None, "grouping group=256", check(True)) is True and len(runs) == 7  # no config: no file


def test_a_timing_verdict_is_the_machines_the_first_one_kept_standing(tmp_path, monkeypatch):
    """The prompt reader's verdict (is it faster here?) decides which kernels read a prompt, so which bits
    its KV has: two daemons of the same settings with other state directories take the one verdict kept
    for the machine, the first one taken, whatever their own measurement or state directory says. (Before,
    a daemon that kept "not faster" in its state directory read prompts otherwise than fresh daemons that
    measured "faster", and 2 of 6 greedy agent answers differed.)"""
    from dataclasses import replace as with_

    from tandem.daemon.worker.invariance import kept_check, machine_kept_check, machine_verdicts

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    gguf, state, config = stand_in_config(tmp_path)
    other = with_(config, probe_cache=str(tmp_path / "other-state" / "batch-invariance.json"))
    model = CountingModel(gguf, {})
    runs = []

    def check(result):
        return lambda: runs.append(result) or result

    name = "prompt_reader faster chunk=64 group=256"
    assert kept_check(model, other, name, check(False)) is False  # a state directory's own, from before
    assert machine_kept_check(model, config, name, check(True)) is True
    assert machine_kept_check(model, other, name, check(False)) is True  # the machine's, not run again
    assert runs == [False, True] and machine_verdicts().is_file()
    assert machine_kept_check(model, config, "another", check(None)) is None  # None is not kept
    assert machine_kept_check(model, config, "another", check(False)) is False and len(runs) == 4
    assert machine_kept_check(model, None, name, check(False)) is False  # no state directory: measured, not kept
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "elsewhere"))  # (another machine, as far as it knows)
    assert machine_kept_check(model, other, name, check(False)) is False


def exact_steps_agree_with_verify_passes(model, n_tokens: int = 300) -> bool:
    """What drafting on a not-invariant target rests on, past 256 tokens of context:
    verify passes of 2 to 9 rows give, row for row, the logits exact steps (the token
    and a dropped guess, 2 rows) give at the same positions."""
    tokens = model.tokenize(LONG_TEXT * 12, add_special=True)[:n_tokens]
    base, rest = tokens[:270], tokens[270:]
    model.clear()
    model.decode(base)
    steps = []
    for t in rest:
        steps.append(model.decode([t, t], logits_for=(0, 1))[0])
        model.truncate(model.n_past - 1)
    at, same = 0, True
    for width in (2, 5, 9, 3):
        model.truncate(len(base) + at)
        rows = model.decode(rest[at : at + width], logits_for=range(width))
        same = same and all(np.array_equal(rows[j], steps[at + j]) for j in range(width))
        at += width
    model.clear()
    return same


def test_the_exact_steps_verdict_agrees_with_a_long_check_on_an_f16_target(smollm2_path):
    """An F16 target (llamafile's tinyBLAS for 2+ rows, ggml's dot product for one):
    the probe's exact_steps verdict, which decides whether a daemon may draft on it,
    is what 300 tokens of context show on this CPU, whichever it is."""
    from tandem.daemon import models
    from tandem.daemon.worker.llama_model import LlamaModel

    model = LlamaModel(models.derive_f16(smollm2_path), n_ctx=1024, flash_attn=True, reference_kernels=True)
    try:
        paths = model.batch_invariance()
        assert paths["exact_steps"] is exact_steps_agree_with_verify_passes(model), paths
    finally:
        model.close()
