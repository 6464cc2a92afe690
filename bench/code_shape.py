"""The shape of tandem's code: the largest class, the longest functions, import
cycles between its modules, and lines over 120 characters (issue 17's figures).

    python -m bench.code_shape           # the summary
    python -m bench.code_shape --over    # and every class over CLASS_LINES, function over FUNCTION_LINES

With ``--over`` it exits 1 where one of them is in daemon/ (issue 46's limits).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CLASS_LINES = 400  # issue 46: no class longer in daemon/
FUNCTION_LINES = 80  # nor function
PACKAGES = {
    "daemon": "tandem.daemon",
    "client": "tandem.client",
    "cli": "tandem.cli",
    "bridge": "tandem.bridge",
    "protocol": "tandem.protocol",
}


def modules():
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            name = ".".join([package, *rel.parts]).removesuffix(".__init__")
            yield name, path


def imports_of(name: str, tree: ast.AST, is_package: bool) -> set[str]:
    out = set()
    base = name.split(".") if is_package else name.split(".")[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                parts = base[: len(base) - node.level + 1]
                mod = ".".join(parts + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.add(mod)
            for alias in node.names:
                out.add(f"{mod}.{alias.name}")
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def main(argv: list[str]) -> int:
    classes, functions, long_lines, graph = [], [], 0, {}
    fmt_skips = 0
    mods = dict(modules())
    for name, path in mods.items():
        text = path.read_text()
        tree = ast.parse(text)
        long_lines += sum(1 for line in text.splitlines() if len(line) > 120)
        fmt_skips += text.count("# fmt" + ": skip")
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                methods = [n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
                classes.append((node.end_lineno - node.lineno + 1, len(methods), f"{name}.{node.name}"))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                functions.append((node.end_lineno - node.lineno + 1, f"{name}:{node.name}"))
        graph[name] = {m for m in imports_of(name, tree, path.name == "__init__.py") if m in mods and m != name}
    # cycles: strongly connected components (Tarjan)
    index, low, stack, on, sccs, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                sccs.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in graph:
        if v not in index:
            visit(v)
    classes.sort(reverse=True)
    functions.sort(reverse=True)
    print("largest classes (lines, methods):")
    for lines, n, cname in classes[:3]:
        print(f"  {lines:5d} lines {n:3d} methods  {cname}")
    print("longest functions:")
    for lines, fname in functions[:5]:
        print(f"  {lines:5d} lines  {fname}")
    print(f"import cycles: {len(sccs)}" + "".join(f"\n  {' <-> '.join(c)}" for c in sccs))
    tree_long = tree_skips = 0
    for path in ROOT.rglob("*.py"):
        if ".git" in path.parts:
            continue
        text = path.read_text()
        tree_long += sum(1 for line in text.splitlines() if len(line) > 120)
        tree_skips += text.count("# fmt" + ": skip")
    print(f"lines over 120 characters: {long_lines} in {', '.join(PACKAGES)}; {tree_long} in every .py file")
    print(f"formatter opt-out markers: {fmt_skips} in {', '.join(PACKAGES)}; {tree_skips} in every .py file")
    if "--over" not in argv:
        return 0
    over = [(lines, f"class {name}") for lines, _, name in classes if lines > CLASS_LINES]
    over += [(lines, f"function {name}") for lines, name in functions if lines > FUNCTION_LINES]
    print(f"over {CLASS_LINES} lines (classes) or {FUNCTION_LINES} (functions): {len(over)}")
    for lines, what in over:
        print(f"  {lines:5d} lines  {what}")
    return 1 if any(what.split()[1].startswith(f"{PACKAGES['daemon']}.") for _, what in over) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
