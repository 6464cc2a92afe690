"""``--drafter auto``: a drafter model that is already pulled and reads the target's tokens, or a line
saying which to pull.

Whether two models share a tokenizer is read from their GGUF headers (``tokenizer.ggml.tokens``, the
token texts in id order), with no model loaded: a few tens of milliseconds a file. A drafter fits when
its token list is the target's, or the start of it with at most ``PAD_TOKENS`` ids more in the target
(Qwen2.5's 7B and larger pad their vocabulary to 152,064 ids, the 0.5B-3B to 151,936; llama.cpp accepts
the same difference). The daemon checks again once both models are loaded (``vocab.vocab_mismatch``).

The choice, in order:

1. the target is a preset with a recommended drafter (``hub_presets``) that is pulled and fits: that one;
2. else the pulled models that fit and are at most half the target's size (a drafter near the target's
   size cannot pay): the largest of those at most 1/8 of it, else the smallest;
3. else no drafter, and a line naming the one to pull (the preset's, or one for the target's family).

Nothing is pulled: a service sandboxed to loopback starts the same way offline.
"""

from __future__ import annotations

import logging
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from .gguf_meta import _ARRAY, _STRING, MAX_HEADER, GGUFError, _read, _string, _value, header
from .vocab import PAD_TOKENS

log = logging.getLogger("tandem.models")

MAX_SHARE = 1 / 2  # a drafter over half the target's size is never chosen by scanning
GOOD_SHARE = 1 / 8  # ... and one at most this share is preferred (the largest of them)


@dataclass(frozen=True)
class Vocab:
    count: int
    raw: bytes  # the token strings as the file has them (u64 length + bytes each), in id order


_cache: dict[tuple, Optional[Vocab]] = {}


def vocab_of(path: Path) -> Optional[Vocab]:
    """The token list of a GGUF file's header (None: the header has none); GGUFError if unreadable."""
    st = os.stat(path)
    key = (str(Path(path).resolve()), st.st_size, st.st_mtime_ns)
    if key not in _cache:
        _cache[key] = _read_vocab(path)
    return _cache[key]


def _read_vocab(path: Path) -> Optional[Vocab]:
    with open(path, "rb") as f:
        size, _tensors, n_kv = header(f, path)
        for _ in range(n_kv):
            key = _string(f)
            kind = _read(f, "<I")
            if key == "tokenizer.ggml.tokens" and kind == _ARRAY:
                return _tokens(f, size)
            _value(f, kind, False, size)
            if f.tell() > MAX_HEADER:
                raise GGUFError(f"the header is over {MAX_HEADER >> 20} MiB")
    return None


def _tokens(f, size: int) -> Vocab:
    item, count = _read(f, "<I"), _read(f, "<Q")
    if item != _STRING or count * 8 > size - f.tell():
        raise GGUFError("tokenizer.ggml.tokens is not an array of strings that fits the file")
    buf = bytearray()
    at = 0
    for _ in range(count):
        while at + 8 > len(buf) or at + 8 + struct.unpack_from("<Q", buf, at)[0] > len(buf):
            more = f.read(max(count * 16, 1 << 16))  # (a token is about 6-12 bytes with its length)
            if not more or len(buf) > MAX_HEADER:
                raise GGUFError("the file ends inside its token list")
            buf += more
        at += 8 + struct.unpack_from("<Q", buf, at)[0]
    return Vocab(count, bytes(buf[:at]))


def tokenizer_mismatch(target: Path, drafter: Path, target_name: str, drafter_name: str) -> Optional[str]:
    """None when ``drafter`` reads ``target``'s tokens (see the module's docstring), else why not,
    naming both (as vocab.vocab_mismatch does)."""
    who = f"drafter {drafter_name} does not fit target {target_name}"
    try:
        t, d = vocab_of(target), vocab_of(drafter)
    except (OSError, GGUFError) as exc:
        return f"{who}: could not read the token lists ({exc})"
    if t is None or d is None:
        return f"{who}: {'the target' if t is None else 'the drafter'} has no token list in its header"
    if not 0 <= t.count - d.count <= PAD_TOKENS:
        return f"{who}: vocabulary sizes differ ({d.count:,} vs {t.count:,} tokens)"
    if t.raw[: len(d.raw)] != d.raw:
        return f"{who}: token texts differ (different tokenizers)"
    return None


# --------------------------------------------------------------------------- choosing


@dataclass(frozen=True)
class Choice:
    name: str  # the drafter's display name, or "none"
    path: Optional[Path]
    why: str  # for the log and `tandem status`: "auto: ..."


def model_bytes(path: Path) -> int:
    """A model's size: all its parts for a split one pulled from the hub."""
    from . import hub

    m = hub.manifest_of(path)
    return sum(f["size"] for f in m["files"]) if m else path.stat().st_size


def pulled_models() -> list[tuple[str, Path]]:
    """(name, path) of every model in the store: presets, hub pulls, other .gguf files (each file once)."""
    from . import list_models

    seen, out = set(), []
    for name, path, _ in list_models():
        if path is None:
            continue
        key = path.resolve()
        if key not in seen:
            seen.add(key)
            out.append((name, path))
    return out


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def choose(target_model: str, target_name: str, target_path: Path) -> Choice:
    """The drafter ``--drafter auto`` gives ``target_model`` (the --model setting; ``target_name``,
    ``target_path``: what it resolved to)."""
    from . import is_pulled, resolve
    from .hub_presets import recommended_drafter

    recommended = recommended_drafter(target_model)
    if recommended is not None and is_pulled(recommended):
        _, path = resolve(recommended)
        mismatch = tokenizer_mismatch(target_path, path, target_name, recommended)
        if mismatch is None:
            return Choice(recommended, path, f"auto: {recommended}, the drafter for {target_name}")
        log.warning("--drafter auto: %s; looking for another", mismatch)
    target_bytes = model_bytes(target_path)
    fits = []
    for name, path in pulled_models():
        if path.resolve() == target_path.resolve():
            continue
        size = model_bytes(path)
        if size > target_bytes * MAX_SHARE:
            continue
        if tokenizer_mismatch(target_path, path, target_name, name) is None:
            fits.append((size, name, path))
    if fits:
        good = [f for f in fits if f[0] <= target_bytes * GOOD_SHARE]
        size, name, path = max(good, key=lambda f: f[0]) if good else min(fits, key=lambda f: f[0])
        why = f"auto: {name}, a pulled model with {target_name}'s tokenizer at {size / target_bytes:.0%} of its size"
        if recommended is not None and not is_pulled(recommended):
            why += f" (the one for it is {recommended}: tandem pull {recommended})"
        return Choice(name, path, why)
    why = f"auto: no drafter: no pulled model has {target_name}'s tokenizer and at most half its size"
    suggestion = recommended or _family_drafter(target_model, target_path, target_bytes)
    if suggestion is not None and not is_pulled(suggestion):
        why += f"; to draft with one: tandem pull {suggestion}"
    elif suggestion is None:
        why += "; --drafter ngram or suffix drafts from the context instead"
    return Choice("none", None, why)


def _family_drafter(target_model: str, target_path: Path, target_bytes: int) -> Optional[str]:
    """A drafter preset for the target's architecture (a guess, checked once it is pulled), if it is
    at most half the target's size."""
    from .gguf_meta import facts
    from .hub_presets import FAMILY_DRAFTERS, HUB_PRESETS

    name = FAMILY_DRAFTERS.get(facts(target_path).get("architecture", ""))
    if name is None or name == target_model:
        return None
    approx = HUB_PRESETS[name].approx_bytes if name in HUB_PRESETS else _pypi_bytes(name)
    return name if approx <= target_bytes * MAX_SHARE else None


def _pypi_bytes(name: str) -> int:
    from . import PRESETS

    return PRESETS[name].size_bytes


def pick_drafter(
    setting: str,
    target_model: str,
    target_name: str,
    target_path: Path,
    resolve: Callable[[str], tuple[str, Path]],
) -> tuple[str, Optional[Path], str]:
    """(name, path or None, how auto chose or "") for the --drafter setting: "none" and the prompt
    lookup drafters as they are, "auto" chosen here, anything else resolved with ``resolve`` (pulled
    on first use). A model drafter whose vocabulary is a little shorter than the target's (padded) is
    checked from the files here: the daemon's check after loading compares the whole 4,096-id blocks
    they share, not the drafter's last, partial one."""
    from ..config import ServeError
    from ..worker.worker_config import LOOKUP_DRAFTERS

    if setting in ("none", *LOOKUP_DRAFTERS):
        return setting, None, ""
    if setting == "auto":
        choice = choose(target_model, target_name, target_path)
        log.info("drafter: %s", choice.why)
        return choice.name, choice.path, choice.why
    name, path = resolve(setting)
    try:
        t, d = vocab_of(target_path), vocab_of(path)
    except (OSError, GGUFError):
        t = d = None  # (left to the daemon's check)
    if t is not None and d is not None and 0 < t.count - d.count <= PAD_TOKENS:
        mismatch = tokenizer_mismatch(target_path, path, target_name, name)
        if mismatch is not None:
            raise ServeError(mismatch + "; choose a drafter from the target's model family, or --drafter ngram|suffix")
    return name, path, ""
