"""``python -m tandem.daemon.config_gen``: write settings_fields.py, the typed settings, from config.OPTIONS.

The options table in config.py is the one place an option is spelled. This
writes one typed dataclass field per option into settings_fields.py (its type
from the option's kind, ``| None`` where "auto" leaves it to the daemon, its
default the option's, its docstring the option's help). Run it after changing
OPTIONS; tests/daemon/test_config.py fails while the file is out of date, and
``--check`` says so without writing.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path
from typing import Optional

from .config import OPTIONS, Option

TARGET = Path(__file__).with_name("settings_fields.py")
COMMAND = "python -m tandem.daemon.config_gen"

# an option's kind -> the type of its parsed value: every kind of config.PARSERS but "choice" (a Literal of its choices)
KIND_TYPES = {
    "str": "str",
    "int": "int",
    "float": "float",
    "bool": "bool",
    "size": "int",  # bytes
    "path": "Path",
    "addr": "str",  # HOST:PORT or "off"
    "layers": 'int | Literal["all"]',
    "rpc": "str",  # HOST:PORT,... or "" (none)
}

HEADER = f'''"""The daemon's settings, typed: one field per option of config.OPTIONS, in its order.

Generated from OPTIONS by `{COMMAND}`; do not edit (change OPTIONS in
config.py and run that). config.SettingsValues adds access by key and a plain form.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal


@dataclass(frozen=True)
class SettingsFields:
    """Each field's default is its option's; None is "auto" (the daemon decides)."""
'''

WIDTH = 120
INDENT = "    "


def field_type(option: Option) -> str:
    if option.kind == "choice":
        base = "Literal[" + ", ".join(f'"{c}"' for c in option.choices) + "]"
    else:
        base = KIND_TYPES[option.kind]  # KeyError: a new kind needs its type here
    return f"{base} | None" if option.auto else base


def literal(value: object) -> str:
    """``value`` as Python source, as ruff formats it (strings in double quotes)."""
    if isinstance(value, str):
        if '"' in value or "\\" in value or not value.isprintable():
            raise ValueError(f"a default that needs escaping: {value!r}")
        return f'"{value}"'
    if value is None or isinstance(value, (bool, int, float)):
        return repr(value)
    raise ValueError(f"a default that is not a plain literal: {value!r}")


def docstring(help_text: str) -> list[str]:
    """The option's help as the field's docstring lines (argparse's %% as %)."""
    text = help_text.replace("%%", "%")
    if '"' in text or "\\" in text:
        raise ValueError(f"help text with a double quote or a backslash: {text!r}")
    if len(INDENT) + len(text) + 6 <= WIDTH:
        return [f'{INDENT}"""{text}"""']
    lines = textwrap.wrap(text, WIDTH - len(INDENT) - 3, break_long_words=False, break_on_hyphens=False)
    lines[0] = '"""' + lines[0]
    lines[-1] += '"""'
    return [INDENT + line for line in lines]


def render(options: tuple[Option, ...] = OPTIONS) -> str:
    """settings_fields.py's text for ``options``."""
    out = [HEADER]
    for option in options:
        out.append(f"{INDENT}{option.key}: {field_type(option)} = {literal(option.default)}")
        out.extend(docstring(option.help))
    return "\n".join(out) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    text = render()
    if args == ["--check"]:
        if TARGET.exists() and TARGET.read_text() == text:
            return 0
        print(f"{TARGET} is out of date with config.OPTIONS: run {COMMAND}", file=sys.stderr)
        return 1
    if args:
        print(f"usage: {COMMAND} [--check]", file=sys.stderr)
        return 2
    TARGET.write_text(text)
    print(f"wrote {TARGET}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
