"""``tandem config show``: every setting as the daemon would use it, and where it came from
(the output is itself a valid config file)."""

from __future__ import annotations

from tandem.daemon import config

from .common import say, serve_options


def add_config(sub) -> None:
    p = sub.add_parser(
        "config",
        help="show the effective settings and where each came from",
        description="Settings come from flags, then TANDEM_<OPTION> environment variables, then the config file "
        f"({config.default_config_path()}, or --config / $TANDEM_CONFIG), then defaults.",
    )
    gsub = p.add_subparsers(dest="config_command", metavar="ACTION")
    pp = gsub.add_parser(
        "show",
        help="print every setting as the daemon would use it, with its source (the output is a valid config file)",
        description="Print the effective settings; give serve flags to see their effect.",
    )
    serve_options(pp)


def cmd_config(args) -> int:
    if args.config_command != "show":
        say("usage: tandem config show [serve flags]")
        return 2
    st = args.settings
    where = "found" if st.path.exists() else "not found; defaults apply"
    print(f"# tandem settings; config file: {st.path} ({where})")
    print("# precedence: flag > environment (TANDEM_<OPTION>) > config file > default")
    resolved = {"socket": args.socket, "state_dir": st.values.state_dir or config.default_state_dir()}
    for o in config.OPTIONS:
        value = st.values[o.key]
        text = config.toml_value(o, value)
        if value is None and o.key in resolved:
            text = config.toml_value(o, resolved[o.key])
        reload = ", reloads on SIGHUP" if o.reload else ""
        print(f"{o.key} = {text}".ljust(44) + f"  # {st.sources[o.key]}{reload}")
    return 0
