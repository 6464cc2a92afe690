"""tandem's CPU kernels (daemon/kernels): llama.cpp's CPU backend built with tandem's patch, loaded by
the workers before llama.cpp. The pytest process itself has llama.cpp's own kernels loaded (the tests
import it), so what needs the patched ones runs in a fresh process, as a worker does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tandem.daemon import kernels

# In a fresh process: load the patched backend as a worker does, read a prompt longer than several of the
# patched attention's 256-position KV chunks, then decode the same tokens one at a time and in verify
# passes of 2 to 12 rows (a daemon's steps, and its verify passes: the patched matmuls take up to 8 rows at
# once, so 9 and 12 are a group of 8 and the rest): every row's logits must be the same bits.
CHECK = textwrap.dedent(
    """
    import json, sys
    from tandem.daemon import kernels
    loaded = kernels.preload("on")
    import numpy as np
    from tandem.daemon.worker.llama_model import LlamaModel

    extra = None if sys.argv[2] == "default" else False
    model = LlamaModel(sys.argv[1], n_ctx=2048, fast_prefill=True, extra_buffers=extra)
    colours = ['red', 'blue', 'green']
    text = " ".join(f"item {i}: the {colours[i % 3]} box holds {i * 7 % 13} stones." for i in range(90))
    prompt = model.tokenize(text + " Count the stones.", add_special=True)
    first = int(np.argmax(model.prefill(prompt)))
    steps, token = [], first
    for _ in range(12):
        row = model.decode([token])[0]
        steps.append(row)
        token = int(np.argmax(row))
    tokens = [first] + [int(np.argmax(r)) for r in steps[:11]]
    same = {}
    for width in (2, 3, 5, 8, 9, 12):
        model.truncate(len(prompt))
        rows = model.decode(tokens[:width], logits_for=list(range(width)))
        same[width] = all(np.array_equal(rows[i], steps[i]) for i in range(width))
    print(json.dumps({"loaded": str(loaded), "in_use": kernels.in_use(), "runtime": model.runtime()[0],
                      "prompt": len(prompt), "same": same, "repacked": model.repacked,
                      "step_rows": model.step_rows}))
    """
)


def run_script(script: str, *args: str) -> dict:
    """Run ``script`` in a fresh Python with ``args``; the JSON of its last line."""
    done = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_check(model, extra_buffers: str = "default") -> dict:
    return run_script(CHECK, str(model), extra_buffers)


@pytest.mark.parametrize("which", ["smollm2", "coder", "coder-1.5b", "coder-1.5b-not-repacked"])
def test_patched_attention_gives_every_row_of_a_verify_pass_the_bits_of_a_step(which, smollm2_path, coder_path):
    """SmolLM2 (9 query heads over 3 KV heads), Qwen2.5-Coder-0.5B (14 over 2; its Q4_K weights
    repacked where the CPU has AVX2 and no AMX) and Qwen2.5-Coder-1.5B Q4_K_M (most of its weights Q4_K,
    the rest and the output Q6_K: the two types the patch multiplies several rows at once), also with its
    weights not repacked (as on CPUs with AMX, where Q4_K goes through the patched dot product), over
    1,000+ positions of KV: the patched kernels are the ones loaded, a pass over repacked weights is one
    llama_decode of any width (not passes of 3 rows), and the steps and the verify passes agree bit for
    bit."""
    if which.startswith("coder-1.5b"):
        from tandem.daemon import models

        path = models.pull("qwen2.5-coder-1.5b", progress=lambda line: None)
    else:
        path = smollm2_path if which == "smollm2" else coder_path
    repack = "off" if which.endswith("not-repacked") else "default"  # (default: on, but off on AMX CPUs)
    out = run_check(path, repack)
    assert out["loaded"] == str(kernels.built()) and out["in_use"].startswith("tandem-"), out
    assert out["in_use"] in out["runtime"]  # (part of what KV pages and the probe's verdicts are kept under)
    assert out["prompt"] > 4 * 256
    assert out["step_rows"] == 0, out
    if which != "smollm2" and repack == "default":
        from tandem.daemon.worker.llama_load import cpu_has_amx

        assert out["repacked"] is not cpu_has_amx()  # (repacked: the 9-row pass went through the patched gemv)
    assert out["same"] == {str(w): True for w in (2, 3, 5, 8, 9, 12)}, out


# In a fresh process, with tandem's kernels loaded ("on") or llama.cpp's own ("off"): read a prompt with
# the fast kernels, as a prefill does, in passes of 256 rows and then one of 100 (two tiles of query rows
# for flash attention's tiled path, the second one partial), and keep every position's logits.
PREFILL = textwrap.dedent(
    """
    import ctypes, json, sys
    from tandem.daemon import kernels
    loaded = kernels.preload(sys.argv[2])
    import numpy as np
    from tandem.daemon.worker.llama_model import LlamaModel

    model = LlamaModel(sys.argv[1], n_ctx=2048, fast_prefill=True, n_threads=2)  # (a split any machine takes)
    text = " ".join(f"line {i}: def f{i}(x): return x * {i % 9} + {i * 5 % 11}" for i in range(200))
    tokens = model.tokenize(text, add_special=True)[:868]
    assert len(tokens) == 868
    model.use_reference(False)
    passes = ((0, 256), (256, 256), (512, 256), (768, 100))
    rows = [model.decode(tokens[at : at + n], logits_for=list(range(n))) for at, n in passes]
    np.save(sys.argv[3], np.concatenate(rows))
    heads, passes_heads = {}, []
    if loaded is not None:  # the heads a task of the patched tiled path takes: (rows, q heads, kv heads, threads)
        import llama_cpp

        fn = ctypes.CDLL(str(loaded)).ggml_tandem_fa_gqa_heads
        fn.restype, fn.argtypes = ctypes.c_int64, [ctypes.c_int64] * 4 + [ctypes.c_int]
        shapes = [(256, 14, 2, 2), (256, 14, 2, 8), (64, 14, 2, 2), (256, 9, 3, 2), (256, 14, 14, 2), (256, 64, 2, 2)]
        heads = {repr(s): fn(s[0], s[1], 1, s[2], s[3]) for s in shapes}
        n_head, n_kv = llama_cpp.llama_model_n_head(model.model), llama_cpp.llama_model_n_head_kv(model.model)
        passes_heads = [fn(n, n_head, 1, n_kv, model.n_threads) for _, n in passes]  # (this model's passes)
    print(json.dumps({"in_use": kernels.in_use(), "heads": heads, "passes_heads": passes_heads}))
    """
)


@pytest.mark.parametrize("which", ["smollm2", "coder"])
def test_patched_tiled_attention_reads_a_prompt_in_llama_cpps_own_bits(which, smollm2_path, coder_path, tmp_path):
    """Prompts are read with ggml's fast kernels, whose tiled flash attention converts each 64-position
    tile of K, V and the mask to F32 for every query head; tandem's converts them once for the heads
    that share a KV head (SmolLM2: 3, Qwen2.5-Coder-0.5B: 7) and gives every row the stock tile's
    arithmetic. Over 868 positions in passes of 256 and 100 rows, on 2 threads (where every pass takes
    that path, on any machine), every position's logits are those of llama.cpp's own kernels, bit for
    bit: what a prompt's KV is does not change with tandem's kernels."""
    path = smollm2_path if which == "smollm2" else coder_path
    outs = {
        setting: run_script(PREFILL, str(path), setting, str(tmp_path / f"{setting}.npy")) for setting in ("on", "off")
    }
    assert outs["on"]["in_use"].startswith("tandem-") and outs["off"]["in_use"] == "llama.cpp", outs
    # the query heads per task: all that share a KV head (at most 16), fewer where that leaves under two
    # tasks a thread, 1 (the stock path) where no KV head is shared
    assert outs["on"]["heads"] == {
        "(256, 14, 2, 2)": 7,
        "(256, 14, 2, 8)": 4,
        "(64, 14, 2, 2)": 4,
        "(256, 9, 3, 2)": 3,
        "(256, 14, 14, 2)": 1,
        "(256, 64, 2, 2)": 1,
    }, outs
    # every pass here went through it: the heads of a KV head together (SmolLM2 3, Qwen2.5-Coder-0.5B 7)
    assert outs["on"]["passes_heads"] == [3 if which == "smollm2" else 7] * 4, outs
    import numpy as np

    ours, theirs = np.load(tmp_path / "on.npy"), np.load(tmp_path / "off.npy")
    assert ours.shape[0] == 868
    assert np.array_equal(ours, theirs), f"{int((ours != theirs).any(axis=1).sum())} positions differ"


@pytest.mark.model  # (it loads llama.cpp, if not a model)
def test_a_fresh_process_without_preload_runs_llama_cpps_own_kernels(cpu_kernels):
    code = "import llama_cpp; from tandem.daemon import kernels; print(kernels.in_use())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "llama.cpp", out.stderr
    code = "from tandem.daemon import kernels; print(kernels.preload('off')); import llama_cpp; print(kernels.in_use())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["None", "llama.cpp"], out.stderr


def test_the_key_covers_the_patch_and_the_cpu(monkeypatch, tmp_path):
    before, original = kernels.key(), kernels.PATCH
    patch = tmp_path / "p.patch"
    patch.write_bytes(original.read_bytes() + b"\n")
    monkeypatch.setattr(kernels, "PATCH", patch)
    assert kernels.key() != before
    monkeypatch.setattr(kernels, "PATCH", original)
    assert kernels.key() == before
    monkeypatch.setattr(kernels, "_cpu_flags", lambda: "fpu sse2")
    assert kernels.key() != before


def test_off_never_builds_and_a_failed_auto_build_says_how_to_fix_it(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # nothing built here
    calls = []
    monkeypatch.setattr(kernels, "build", lambda say: calls.append(say) or (_ for _ in ()).throw(
        kernels.KernelBuildError("`cmake` is not installed: apt-get install cmake, or pip install cmake")
    ))  # fmt: skip
    kernels.check("off", print)
    assert calls == []
    with caplog.at_level("WARNING", logger="tandem.kernels"):
        kernels.check("auto", lambda line: None)
    assert len(calls) == 1 and "apt-get install cmake" in caplog.text and "--kernel-patch off" in caplog.text
    with pytest.raises(kernels.KernelBuildError, match="could not be built.*apt-get install cmake"):
        kernels.check("on", lambda line: None)


def test_a_daemon_says_it_runs_tandems_kernels(daemon):
    """The default settings: the workers loaded the patched backend, and status says so."""
    with daemon.client() as client:
        model = client.status().model
    assert model.cpu_kernels == f"tandem-{kernels.key()}"


def test_where_auto_was_decided_off_a_reload_does_not_call_that_a_change(tmp_path):
    """A daemon whose --kernel-patch auto could not build runs llama.cpp's kernels for its life, as if
    started with off: its SIGHUP reload reads auto as off (else it would ask for a restart)."""
    from tandem.daemon import config
    from tandem.daemon.serve import _kernels_off

    settings = config.load({}, None, environ={"XDG_CONFIG_HOME": str(tmp_path)})
    assert settings.values.kernel_patch == "auto"
    assert _kernels_off(lambda: settings)().values.kernel_patch == "off"
    on = config.load({"kernel_patch": "on"}, None, environ={"XDG_CONFIG_HOME": str(tmp_path)})
    assert _kernels_off(lambda: on)().values.kernel_patch == "on"  # (a real change: the warning is right)


def test_a_failed_build_is_recorded_and_a_daemon_tries_again_a_day_later(monkeypatch, tmp_path, caplog, capsys):
    """build() records why it failed beside the library and clears that when it tries again; a daemon's
    auto does not retry within RETRY_SECONDS, a foreground start (announce) does."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    tries = []

    def no_cmake(tool, fix):
        tries.append(tool)
        assert kernels.failed() is None  # (the record of the try before is gone while it tries)
        raise kernels.KernelBuildError(f"`{tool}` is not installed: {fix}")

    monkeypatch.setattr(kernels, "_need", no_cmake)
    with pytest.raises(kernels.KernelBuildError):
        kernels.build(lambda line: None)
    assert "`cmake` is not installed" in kernels.failed() and len(tries) == 1
    with caplog.at_level("WARNING", logger="tandem.kernels"):
        assert kernels.check("auto", lambda line: None) is None
    assert len(tries) == 1 and "tandem kernels status" in caplog.text
    assert kernels.check("auto", lambda line: None, announce="building first") is None and len(tries) == 2
    record = kernels.library_path().parent / kernels.FAILED
    day_ago = record.stat().st_mtime - kernels.RETRY_SECONDS - 1
    os.utime(record, (day_ago, day_ago))
    assert kernels.check("auto", lambda line: None) is None and len(tries) == 3
    from tandem.cli.kernels import cmd_kernels

    class Args:
        kernels_command = "status"

    assert cmd_kernels(Args()) == 1
    said = capsys.readouterr().out
    assert "the last build failed" in said and "    KernelBuildError: `cmake` is not installed" in said
    with pytest.raises(kernels.KernelBuildError):  # on: tried again (and an error)
        kernels.check("on", lambda line: None)
    assert len(tries) == 4
