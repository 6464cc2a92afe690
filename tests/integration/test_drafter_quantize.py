"""A drafter file at 16 bits is quantized once to Q8_0 and that copy is drafted with;
a 4-bit one is loaded with a warning; ``--drafter-quantize off`` loads the file as given
(SmolLM2: its F16 copy as the wide drafter, its Q4_1 file as the narrow one)."""

from __future__ import annotations

import time

import pytest

from tandem.daemon import models
from tandem.daemon.models import gguf_meta
from tests.shared_kernels import share_kernels


@pytest.fixture
def f16(smollm2_path):
    return models.derive_f16(smollm2_path)


def serve_with_drafter(start_daemon, smollm2_path, drafter, cache_home, *extra):
    share_kernels(cache_home)
    return start_daemon(
        "--ctx-size",
        "512",
        "--drafter",
        str(drafter),
        *extra,
        model=smollm2_path,
        env={"XDG_CACHE_HOME": str(cache_home)},
    )


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
