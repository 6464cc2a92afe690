"""A drafter's weights are chosen for speed: a small drafter file at 16 bits is quantized once to
Q8_0, a drafter of 300M weights or more above 5.5 bits per weight to Q4_0 (Qwen2.5-Coder-0.5B's
file), and that copy is drafted with, its weights repacked; a small 4-bit one is loaded with a
warning; ``--drafter-quantize off`` loads the file as given (SmolLM2: its F16 copy as the wide
drafter, its Q4_1 file as the narrow one)."""

from __future__ import annotations

import time

import pytest

from tandem.daemon import kernels, models
from tandem.daemon.models import gguf_meta
from tests.shared_kernels import share_kernels


@pytest.fixture
def f16(smollm2_path):
    return models.derive_f16(smollm2_path)


def serve_with_drafter(start_daemon, target, drafter, cache_home, *extra, ctx="512"):
    share_kernels(cache_home)
    d = start_daemon(
        "--ctx-size",
        ctx,
        "--drafter",
        str(drafter),
        *extra,
        model=target,
        env={"XDG_CACHE_HOME": str(cache_home)},
        wait=False,
    )
    d.wait_ready(180)  # (a copy to make first, and the load checks of a 0.5B target)
    return d


def test_which_copy_each_drafter_gets(smollm2_path, f16, coder_path):
    # (weights, bits per weight): SmolLM2 Q4_1 (134M, 5.7: its embeddings are wider), its F16 copy,
    # Qwen2.5-Coder-0.5B (630M counting its output and embeddings apart, 6.2: Q5_0 and a Q8_0 output)
    assert [models.drafter_copy(smollm2_path, q) for q in ("auto", "q4_0", "q8_0", "off")] == ["", "Q4_0", "", ""]
    assert [models.drafter_copy(f16, q) for q in ("auto", "q4_0", "q8_0", "off")] == ["Q8_0", "Q4_0", "Q8_0", ""]
    assert [models.drafter_copy(coder_path, q) for q in ("auto", "q4_0", "q8_0", "off")] == ["Q4_0", "Q4_0", "", ""]
    # where its weights will not be repacked (AMX, --extra-buffers off) a Q4_0 step costs more than the file's
    assert models.drafter_copy(coder_path, "auto", repacked=False) == ""
    assert models.drafter_copy(f16, "auto", repacked=False) == "Q8_0"
    # the small 4-bit file is the one whose acceptance is reported; the large one's is not
    assert (models.narrow_drafter(smollm2_path), models.narrow_drafter(coder_path)) == ("Q4_1", "")


def test_a_large_drafter_is_quantized_to_q4_0_repacked_and_drafts_exactly(start_daemon, coder_path, tmp_path):
    d = serve_with_drafter(start_daemon, coder_path, coder_path, tmp_path, ctx="1024")
    copies = list((tmp_path / "tandem" / "models" / "derived").glob("*.Q4_0.gguf"))
    assert len(copies) == 1
    params, bits = gguf_meta.weight_profile(copies[0])
    assert params == gguf_meta.weight_profile(coder_path)[0] and 4.5 <= bits < 4.52  # every matrix Q4_0
    assert "to Q4_0 once" in d.log() and "is Q4_K_M: at 4 bits" not in d.log()
    prompt = "def parse_header(line):\n    " + "# split the key from the value and strip both\n    " * 6
    with d.client() as c:
        st = c.status()
        assert st.drafter.endswith(f"as Q4_0 ({copies[0]})")
        # repacked (its steps need not agree with its passes), except where AMX keeps extra buffers off
        assert any("REPACK" in buffer for buffer in st.drafter_model.weights) is not kernels.cpu_has_amx()
        out = c.complete(prompt=prompt, max_tokens=48, temperature=0.0, draft="on", ignore_eos=True)
        plain = c.complete(prompt=prompt, max_tokens=48, temperature=0.0, draft="off", ignore_eos=True)
    assert out.draft is not None and out.draft.accepted > 0 and out.text == plain.text


def test_a_copy_that_cannot_be_written_loads_the_file_under_auto_and_stops_an_explicit_choice(
    start_daemon, coder_path, tmp_path
):
    (tmp_path / "tandem" / "models").mkdir(parents=True)
    (tmp_path / "tandem" / "models" / "derived").write_text("not a directory")  # the copies' place is taken
    d = serve_with_drafter(start_daemon, coder_path, coder_path, tmp_path, ctx="1024")
    assert "could not make the drafter's Q4_0 copy (FileExistsError" in d.log()
    with d.client() as c:
        assert c.status().drafter == coder_path.name
    d.stop()
    share_kernels(tmp_path)
    failed = start_daemon(
        "--drafter",
        str(coder_path),
        "--drafter-quantize",
        "q4_0",
        model=coder_path,
        wait=False,
        env={"XDG_CACHE_HOME": str(tmp_path)},
    )
    assert failed.proc.wait(120) != 0
    assert "--drafter-quantize off loads the file as it is" in failed.log()


def test_a_16_bit_drafter_is_quantized_once_to_q8_0_and_drafts_as_before(start_daemon, smollm2_path, f16, tmp_path):
    d = serve_with_drafter(start_daemon, smollm2_path, f16, tmp_path)
    copies = list((tmp_path / "tandem" / "models" / "derived").glob("*.Q8_0.gguf"))
    assert len(copies) == 1 and gguf_meta.facts(copies[0])["quantization"] == "Q8_0"
    assert copies[0].stat().st_size < f16.stat().st_size * 0.6
    assert "quantizing the drafter" in d.log() and "drafter quantized in" in d.log()
    with d.client() as c:
        st = c.status()
        assert st.drafter.endswith(f"as Q8_0 ({copies[0]})")
        out = c.complete(prompt="The capital of France is", max_tokens=24, temperature=0.0, draft="on")
        plain = c.complete(prompt="The capital of France is", max_tokens=24, temperature=0.0, draft="off")
    assert out.draft is not None and out.draft.drafted > 0 and out.text == plain.text
    d.stop()
    # a second start loads the copy made before
    again = serve_with_drafter(start_daemon, smollm2_path, f16, tmp_path)
    assert "quantizing the drafter" not in again.log()
    with again.client() as c:
        assert c.status().drafter.endswith(f"as Q8_0 ({copies[0]})")


def test_quantize_off_loads_the_file_as_given(start_daemon, smollm2_path, f16, tmp_path):
    d = serve_with_drafter(start_daemon, smollm2_path, f16, tmp_path, "--drafter-quantize", "off")
    with d.client() as c:
        assert c.status().drafter == f16.name
    assert "quantizing" not in d.log() and not (tmp_path / "tandem" / "models" / "derived").exists()


def test_a_4_bit_drafter_is_loaded_with_a_warning_that_names_the_usual_choice(start_daemon, smollm2_path, tmp_path):
    d = serve_with_drafter(start_daemon, smollm2_path, smollm2_path, tmp_path)
    log = d.log()
    assert "is Q4_1: at 4 bits or fewer" in log and "Q8_0 file of the same model" in log
    with d.client() as c:
        assert c.status().drafter == smollm2_path.name
        done = c.complete(prompt="List the planets:", max_tokens=24, temperature=0.0, draft="on", ignore_eos=True)
        assert "drafter's acceptance here" not in d.log()  # not yet: fewer than 64 drafts
        while c.status().draft.drafted < 64:
            c.complete(prompt="List the planets:", max_tokens=24, temperature=0.0, draft="on", ignore_eos=True)
        st = c.status().draft
    # once it has drafted enough, the acceptance it gets here, measured
    assert done.draft.drafted > 0
    deadline = time.monotonic() + 10  # (the worker logs it just after that request's reply)
    while "drafter's acceptance here" not in d.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    line = next(ln for ln in d.log().splitlines() if "the Q4_1 drafter's acceptance here" in ln)
    assert f"over its first {st.drafted} drafts" in line
