"""The prefix cache's index is tied to the model file (issue 19, item 13): a
``.gguf`` replaced at the same path by another of the same architecture (the
same KV layout, so the old check passed) must not get the old model's KV back
after a worker restart."""

from __future__ import annotations

import os
import shutil

from tandem.daemon import models
from tandem.daemon.cache.page_store import model_identity

PROMPT = "Notes for the next turn, kept in the prefix cache. " * 6


def test_the_identity_changes_with_the_file_not_with_its_path(smollm2_path, tmp_path):
    a = tmp_path / "a.gguf"
    shutil.copyfile(smollm2_path, a)
    first = model_identity(a)
    assert model_identity(a) == first
    os.utime(a, ns=(1, 1))
    assert model_identity(a) != first  # touched: the weights might have been rewritten in place
    b = tmp_path / "b.gguf"
    shutil.copyfile(smollm2_path, b)
    os.utime(b, ns=(1, 1))
    os.replace(b, a)  # same size, same mtime, same content, another inode
    assert model_identity(a) not in (first, model_identity(smollm2_path))


def test_a_model_file_replaced_under_the_daemon_does_not_restore_its_old_kv(
    start_daemon, smollm2_path, tmp_path, restart_target
):
    served = tmp_path / "model.gguf"
    shutil.copyfile(smollm2_path, served)  # Q4_1
    f16 = models.derive_f16(smollm2_path, tmp_path / "f16.gguf")  # same architecture, same KV layout
    d = start_daemon("--ctx-size", "512", "--cache-bytes", "16M", model=served)
    with d.client() as c:
        first = c.complete(prompt=PROMPT, max_tokens=6, ignore_eos=True, temperature=0)
        assert c.complete(prompt=PROMPT, max_tokens=6, ignore_eos=True, temperature=0).usage.cached_tokens > 0
        os.replace(f16, served)  # the user swaps the weights; the worker restarts onto them
        restart_target(c)
        after = c.complete(prompt=PROMPT, max_tokens=6, ignore_eos=True, temperature=0)
        assert after.usage.cached_tokens == 0, "KV computed with the old weights was restored"
        assert c.complete(prompt=PROMPT, max_tokens=6, ignore_eos=True, temperature=0).usage.cached_tokens > 0
    assert "written for another model file" in d.log()
    assert first.usage.prompt_tokens == after.usage.prompt_tokens
