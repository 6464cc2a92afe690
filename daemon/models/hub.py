"""Models pulled from Hugging Face by name: ``hf.co/ORG/REPO[:QUANT]``.

``huggingface_hub`` does the talking (the repository's file list with each
file's LFS sha256 and size, the download URLs, retries, ``HF_ENDPOINT``,
``HF_TOKEN`` and ``HF_HUB_OFFLINE``); this module chooses the file, keeps
what was fetched of it so an interrupted pull resumes where it stopped (its
``http_get`` sends the ``Range``), checks the whole file's sha256 against the
hub's before the file is put in place, and records what it pulled in a
manifest beside it. A model that is pulled starts from its manifest with no
network call at all.

Layout: ``models_dir()/hf/ORG/REPO/`` holds the GGUF file(s) (a split model's
parts side by side, as llama.cpp loads them from the first), one manifest per
quant (``Q4_K_M.json``) and ``.partial/`` while a pull runs.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from . import ModelError, models_dir

DEFAULT_QUANT = "Q4_K_M"  # llama-server's and Ollama's default for a repository's GGUFs
PREFIXES = ("https://huggingface.co/", "http://huggingface.co/", "https://hf.co/", "huggingface.co/", "hf.co/", "hf://")
_PART = r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}"
REPO = re.compile(rf"^({_PART})/({_PART})$")
QUANT_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,32}$")
# the quant a GGUF's name (or its folder's) ends with: Q4_K_M, IQ3_XXS, Q8_0, F16, BF16, MXFP4_MOE, ...
QUANT_IN_NAME = re.compile(
    r"(?:^|[-._/])((?:UD-)?(?:I?Q\d(?:_[A-Z0-9]+)*|[BT]?F(?:16|32)|MXFP4(?:_[A-Z0-9]+)*))"
    r"(?:-\d{5}-of-\d{5})?\.gguf$",
    re.IGNORECASE,
)
SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")
ProgressFn = Callable[[str], None]


@dataclass(frozen=True)
class HubRef:
    """``hf.co/ORG/REPO[:QUANT]``: the repository and the quant asked for (None: the default)."""

    repo: str
    quant: Optional[str] = None

    @property
    def name(self) -> str:
        return f"hf.co/{self.repo}" + (f":{self.quant}" if self.quant else "")


def is_hub_name(model: str) -> bool:
    return model.startswith(PREFIXES)


def parse(model: str) -> HubRef:
    """``hf.co/ORG/REPO[:QUANT]`` (or huggingface.co/..., hf://...) -> HubRef; ModelError if malformed."""
    rest = model
    for prefix in PREFIXES:
        if rest.startswith(prefix):
            rest = rest[len(prefix) :]
            break
    rest = rest.rstrip("/")
    repo, _, quant = rest.partition(":")
    if not REPO.match(repo) or (quant and not QUANT_NAME.match(quant)) or (_ and not quant):
        raise ModelError(
            f"'{model}' is not a Hugging Face model name: give hf.co/ORG/REPO or hf.co/ORG/REPO:QUANT "
            f"(for example hf.co/Qwen/Qwen2.5-Coder-7B-Instruct-GGUF:Q4_K_M)"
        )
    quant = quant.upper()
    return HubRef(repo, quant if quant and quant != "LATEST" else None)  # (":latest", Ollama's tag: the default)


def repo_dir(repo: str) -> Path:
    return models_dir() / "hf" / repo


# --------------------------------------------------------------------------- the files of a repository


def quant_of(filename: str) -> Optional[str]:
    """The quant a GGUF file's name says (upper case), or None (not a GGUF, or a projector's)."""
    base = filename.rsplit("/", 1)[-1].lower()
    if not base.endswith(".gguf") or base.startswith("mmproj") or "mmproj" in base:
        return None
    m = QUANT_IN_NAME.search(filename)
    return m.group(1).upper() if m else None


def quants(filenames: list[str]) -> dict[str, list[str]]:
    """Quant -> the GGUF file(s) that hold it (a split model's parts in order)."""
    out: dict[str, list[str]] = {}
    for f in sorted(filenames):
        q = quant_of(f)
        if q is not None:
            out.setdefault(q, []).append(f)
    return out


def choose(ref: HubRef, filenames: list[str]) -> tuple[str, list[str]]:
    """(quant, its files) for ``ref`` among a repository's files; ModelError naming what there is."""
    found = quants(filenames)
    if not found:
        ggufs = [f for f in filenames if f.lower().endswith(".gguf")]
        what = "only projector GGUFs" if ggufs else "no GGUF files"
        raise ModelError(
            f"{ref.repo} has {what}: tandem serves GGUF models (look for a repository named ...-GGUF, "
            f"for example hf.co/Qwen/Qwen2.5-Coder-7B-Instruct-GGUF)"
        )
    quant = ref.quant or DEFAULT_QUANT
    if quant not in found and ref.quant is None and len(found) == 1:
        quant = next(iter(found))  # one quant only: that one
    if quant not in found:
        listed = ", ".join(sorted(found))
        asked = "asked for" if ref.quant else "the default"
        raise ModelError(
            f"{ref.repo} has no {quant} GGUF ({asked}); it has {listed}. "
            f"Pull one of those: tandem pull hf.co/{ref.repo}:{sorted(found)[0]}"
        )
    files = found[quant]
    split = [SPLIT.search(f) for f in files]
    if any(split):
        counts = {int(m.group(2)) for m in split if m}
        numbers = sorted(int(m.group(1)) for m in split if m)
        if not all(split) or len(counts) != 1 or numbers != list(range(1, counts.pop() + 1)):
            raise ModelError(f"{ref.repo}: the {quant} GGUF's split parts are not all there ({', '.join(files)})")
    elif len(files) > 1:
        raise ModelError(
            f"{ref.repo} has {len(files)} {quant} GGUFs ({', '.join(files)}): name the file's quant exactly"
        )
    return quant, files


# --------------------------------------------------------------------------- what is pulled


def _manifest(repo: str, quant: str) -> Path:
    return repo_dir(repo) / f"{quant}.json"


def _read_manifest(path: Path) -> Optional[dict]:
    """A manifest as ``pull`` writes it, or None (missing, broken, or some other JSON file)."""
    try:
        m = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(m, dict) or not isinstance(m.get("repo"), str) or not isinstance(m.get("quant"), str):
        return None
    files = m.get("files")
    if not isinstance(files, list) or not files or not all(isinstance(f, dict) for f in files):
        return None
    return m


def _complete(m: dict, folder: Path) -> Optional[Path]:
    """The first file of a manifest's model if every file is there at its size, else None."""
    try:
        for f in m["files"]:
            if (folder / f["name"]).stat().st_size != f["size"]:
                return None
        return folder / m["files"][0]["name"]
    except (OSError, KeyError, TypeError):
        return None


def pulled(ref: HubRef) -> Optional[Path]:
    """The model's first GGUF file if it is pulled whole (no network call), else None. Without a
    quant: the one a pull without a quant chose, else the default quant's."""
    folder = repo_dir(ref.repo)
    candidates = [_manifest(ref.repo, ref.quant)] if ref.quant else []
    if ref.quant is None:
        for path in sorted(folder.glob("*.json")):
            m = _read_manifest(path)
            if m is not None and m.get("default"):
                candidates.append(path)
        candidates.append(_manifest(ref.repo, DEFAULT_QUANT))
    for path in candidates:
        m = _read_manifest(path)
        if m is not None:
            first = _complete(m, folder)
            if first is not None:
                return first
    return None


def manifest_of(path: Path) -> Optional[dict]:
    """The manifest of the pulled model whose first file is ``path`` (None: not one pulled from the hub)."""
    for m_path in sorted(path.parent.glob("*.json")):
        m = _read_manifest(m_path)
        if m is not None and m["files"][0].get("name") == path.name and _complete(m, path.parent) == path:
            return m
    return None


def pulled_models() -> list[tuple[str, Path, int]]:
    """(name, first file, bytes) of every model pulled from the hub."""
    root = models_dir() / "hf"
    out = []
    for path in sorted(root.glob("*/*/*.json")) if root.is_dir() else []:
        m = _read_manifest(path)
        first = _complete(m, path.parent) if m is not None else None
        if first is not None:
            out.append((f"hf.co/{m['repo']}:{m['quant']}", first, sum(f["size"] for f in m["files"])))
    return out


def remove(ref: HubRef) -> list[Path]:
    """Delete a pulled model's files and manifest (the repository's folder too once it is empty)."""
    first = pulled(ref)
    if first is None:
        raise ModelError(f"{ref.name} is not pulled (tandem list shows what is)")
    folder = first.parent
    removed = []
    for path in sorted(folder.glob("*.json")):
        m = _read_manifest(path)
        if m is not None and _complete(m, folder) == first:
            for f in m["files"]:
                (folder / f["name"]).unlink(missing_ok=True)
                removed.append(folder / f["name"])
            path.unlink(missing_ok=True)
    if not any(folder.glob("*.json")):  # no other quant of the repository is left: nor anything else
        shutil.rmtree(folder / ".partial", ignore_errors=True)
        (folder / ".lock").unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            folder.rmdir()
    return removed


# --------------------------------------------------------------------------- pulling


def _endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")


def _hub_error(ref: HubRef, exc: Exception) -> ModelError:
    from huggingface_hub import errors

    where = _endpoint()
    if isinstance(exc, errors.OfflineModeIsEnabled):
        return ModelError(f"{ref.name} is not pulled, and HF_HUB_OFFLINE is set: unset it to pull the model")
    if isinstance(exc, errors.GatedRepoError):
        return ModelError(f"{ref.repo} is gated on {where}: accept its terms there and set HF_TOKEN")
    if isinstance(exc, errors.RepositoryNotFoundError):
        return ModelError(f"no repository {ref.repo} on {where} (a private one needs HF_TOKEN); check the name")
    if isinstance(exc, errors.HfHubHTTPError):
        status = exc.response.status_code if exc.response is not None else 0
        hint = " (is HF_TOKEN right, and does it have access?)" if status in (401, 403) else ""
        return ModelError(f"{where} answered {exc}{hint}")
    if isinstance(exc, OSError) and not isinstance(exc, ConnectionError) and exc.errno is not None:
        return ModelError(f"{ref.name}: could not write the model: {exc}")  # (a full disk, a read-only store)
    if isinstance(exc, OSError) and "Consistency check failed" in str(exc):
        return ModelError(f"{ref.name}: the download stopped short of the file's size; run the pull again (it resumes)")
    return ModelError(f"could not reach {where} to pull {ref.name}: {type(exc).__name__}: {exc}")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def pull(
    ref: HubRef,
    progress: ProgressFn = lambda line: None,
    make_bar: Optional[Callable] = None,
    revision: Optional[str] = None,
) -> Path:
    """Fetch ``ref``'s GGUF (all its parts) into the store, each checked against the hub's
    sha256 before it is put in place; the first file's path. A model that is pulled: returned
    with no network call. ``make_bar(total_bytes)`` (a tqdm) counts the bytes of every part; without
    it, only ``progress`` lines. ``revision``: a commit (or branch) to pull instead of main."""
    have = pulled(ref)
    if have is not None:
        progress(f"{ref.name}: already present at {have}")
        return have
    try:
        from huggingface_hub import HfApi
        from tqdm import tqdm
    except ImportError:
        raise ModelError("pulling from Hugging Face needs huggingface_hub: pip install huggingface_hub") from None

    try:
        info = HfApi(endpoint=_endpoint()).model_info(ref.repo, revision=revision, files_metadata=True)
    except Exception as exc:  # (connection errors, offline mode, a missing or gated repository: the hub's types)
        raise _hub_error(ref, exc) from None
    siblings = {s.rfilename: s for s in info.siblings or []}
    quant, files = choose(ref, list(siblings))
    folder = repo_dir(ref.repo)
    folder.mkdir(parents=True, exist_ok=True)
    with _locked(folder, ref, progress):
        return _pull_files(ref, info, quant, files, siblings, folder, progress, make_bar, tqdm)


@contextlib.contextmanager
def _locked(folder: Path, ref: HubRef, progress: ProgressFn):
    """One pull of a repository at a time (another tandem pulling the same waits for it)."""
    with open(folder / ".lock", "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            progress(f"{ref.name}: another pull of {ref.repo} is running; waiting for it")
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _pull_files(
    ref: HubRef, info, quant: str, files: list[str], siblings: dict, folder: Path, progress, make_bar, tqdm
):
    have = pulled(ref)  # (pulled by the pull this one waited for)
    if have is not None:
        return have
    entries = []
    for name in files:
        s = siblings[name]
        if s.lfs is None or not s.lfs.sha256:
            raise ModelError(f"{ref.repo}: the hub gave no sha256 for {name}, so it cannot be checked; not pulled")
        entries.append({"name": name.rsplit("/", 1)[-1], "path": name, "size": s.lfs.size, "sha256": s.lfs.sha256})
    total = sum(e["size"] for e in entries)
    parts = f" in {len(entries)} parts" if len(entries) > 1 else ""
    progress(f"{ref.name}: {quant}, {total / 2**20:,.0f} MiB{parts} from {_endpoint()} (revision {info.sha[:12]})")
    started = time.monotonic()
    bar = make_bar(total) if make_bar is not None else tqdm(total=total, disable=True)
    try:
        for e in entries:
            _fetch(ref, info.sha, e, folder, progress, bar)
    finally:
        bar.close()
    manifest = {
        "repo": ref.repo,
        "quant": quant,
        "revision": info.sha,
        "default": ref.quant is None,
        "pulled": int(time.time()),
        "files": [{k: e[k] for k in ("name", "size", "sha256")} for e in entries],
    }
    tmp = _manifest(ref.repo, quant).with_suffix(".json.tmp")
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, _manifest(ref.repo, quant))
    try:
        (folder / ".partial").rmdir()  # (only if no other quant's pull left files there)
    except OSError:
        pass
    progress(f"{ref.name}: sha256 verified; saved {folder / entries[0]['name']} in {time.monotonic() - started:.0f} s")
    return folder / entries[0]["name"]


def _fetch(ref: HubRef, revision: str, e: dict, folder: Path, progress: ProgressFn, bar) -> None:
    """One file, into ``.partial/SHA256.part`` (resumed from what is there: the same content, as
    its name is its hash), then checked and put in place."""
    from huggingface_hub import constants, hf_hub_url
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import build_hf_headers

    final = folder / e["name"]
    if final.is_file() and final.stat().st_size == e["size"]:
        # a part put in place by a pull that stopped before its manifest: checked again (the hub may
        # have changed the file since), unless a manifest already vouches for it
        if _vouched(folder, e) or _sha256(final) == e["sha256"]:
            bar.update(e["size"])
            return
        final.unlink()
    partial = folder / ".partial" / f"{e['sha256']}.part"
    partial.parent.mkdir(exist_ok=True)
    have = partial.stat().st_size if partial.is_file() else 0
    if have > e["size"]:
        partial.unlink()
        have = 0
    if have:
        progress(f"{ref.name}: resuming {e['name']} at {have / 2**20:,.0f} of {e['size'] / 2**20:,.0f} MiB")
    bar.update(have)
    if constants.is_offline_mode():
        raise ModelError(f"{ref.name} is not pulled, and HF_HUB_OFFLINE is set: unset it to pull the model")
    url = hf_hub_url(ref.repo, e["path"], revision=revision, endpoint=_endpoint())
    try:
        with open(partial, "ab") as f:
            http_get(
                url,
                f,
                resume_size=have,
                headers=build_hf_headers(),
                expected_size=e["size"],
                displayed_filename=e["name"],
                _tqdm_bar=bar,
            )
        digest = _sha256(partial)
    except Exception as exc:
        raise _hub_error(ref, exc) from None
    if digest != e["sha256"]:
        partial.unlink(missing_ok=True)
        raise ModelError(
            f"{ref.name}: {e['name']} has sha256 {digest}, not the hub's {e['sha256']}: deleted, nothing kept. "
            f"Run the pull again"
        )
    os.replace(partial, final)


def _vouched(folder: Path, e: dict) -> bool:
    """A manifest in ``folder`` lists this file with this sha256 (it was checked when it was pulled)."""
    for path in folder.glob("*.json"):
        m = _read_manifest(path)
        if m is not None and any(f.get("name") == e["name"] and f.get("sha256") == e["sha256"] for f in m["files"]):
            return True
    return False
