"""Settings: one schema, flags > environment > config file > default, clear errors."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tandem.daemon import config
from tandem.daemon.config import ConfigError, load


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.toml"
    path.write_text(text)
    return path


def test_defaults_without_a_file(tmp_path):
    s = load({}, None, environ={"XDG_CONFIG_HOME": str(tmp_path)})
    assert s.path == tmp_path / "tandem" / "config.toml" and not s.file_found
    for option in config.OPTIONS:
        assert s.values[option.key] == option.default and s.sources[option.key] == "default"


def test_precedence_flag_over_environment_over_file_over_default(tmp_path):
    path = write(tmp_path, 'max_queue = 3\ndraft_tokens = 5\ncache_bytes = "2G"\n')
    env = {"TANDEM_MAX_QUEUE": "7", "TANDEM_DRAFT_TOKENS": "6"}
    s = load({"max_queue": "9"}, path, environ=env)
    assert (s.values.max_queue, s.sources["max_queue"]) == (9, "flag --max-queue")
    assert (s.values.draft_tokens, s.sources["draft_tokens"]) == (6, "environment TANDEM_DRAFT_TOKENS")
    assert (s.values.cache_bytes, s.sources["cache_bytes"]) == (2 << 30, f"config file {path}")
    assert (s.values.page_tokens, s.sources["page_tokens"]) == (16, "default")


def test_the_file_is_found_through_tandem_config_and_xdg(tmp_path):
    path = write(tmp_path, "max_queue = 4\n")
    assert load({}, None, environ={"TANDEM_CONFIG": str(path)}).values.max_queue == 4
    xdg = tmp_path / "xdg"
    (xdg / "tandem").mkdir(parents=True)
    (xdg / "tandem" / "config.toml").write_text("max_queue = 5\n")
    assert load({}, None, environ={"XDG_CONFIG_HOME": str(xdg)}).values.max_queue == 5


def test_a_named_file_that_does_not_exist_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load({}, tmp_path / "nope.toml", environ={})


@pytest.mark.parametrize(
    "text, words",
    [
        ("cache_byte = 1\n", ["unknown key 'cache_byte'", "did you mean 'cache_bytes'"]),
        ("max_queue = -1\n", ["max_queue", "too small", "an integer from 0"]),
        ('governor = "maybe"\n', ["governor", "on or off"]),
        ('exact = "sometimes"\n', ["exact", "one of auto, on, off"]),
        ('cache_bytes = "lots"\n', ["cache_bytes", "512M, 2G"]),
        ("draft_p_min = 2.0\n", ["draft_p_min", "too large", "from 0 to 1"]),
        ('metrics_addr = "127.0.0.1"\n', ["metrics_addr", "HOST:PORT"]),
        ('metrics_addr = "example.com:9464"\n', ["metrics_addr", "IP address or localhost"]),
        ("max_queue = 1.5\n", ["max_queue", "an integer"]),
        ("[serve]\nmodel = 'x'\n", ["unknown key 'serve'"]),
        ("model = \n", ["not valid TOML"]),
    ],
)
def test_bad_files_name_the_key_the_source_and_what_is_accepted(tmp_path, text, words):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load({}, path, environ={})
    message = str(info.value)
    for word in words:
        assert word in message, message
    assert str(path) in message


def test_bad_environment_and_flag_values_say_where_they_came_from():
    with pytest.raises(ConfigError, match=r"environment TANDEM_PAGE_TOKENS.*page_tokens takes an integer"):
        load({}, None, environ={"TANDEM_PAGE_TOKENS": "sixteen"})
    with pytest.raises(ConfigError, match=r"flag --log-level.*one of debug"):
        load({"log_level": "loud"}, None, environ={})


def test_toml_types_and_strings_both_work(tmp_path):
    path = write(
        tmp_path,
        'governor = false\nflash_attn = "off"\ncache_bytes = 1048576\nctx_size = "auto"\nthreads = 2\n'
        'state_dir = "~/somewhere"\nexact = true\n',
    )
    v = load({}, path, environ={}).values
    assert v.governor is False and v.flash_attn is False and v.cache_bytes == 1 << 20
    assert v.ctx_size is None and v.threads == 2 and v.exact == "on"
    assert v.state_dir == Path("~/somewhere").expanduser()


def test_metrics_off_loopback_and_remote():
    assert load({"metrics_addr": "off"}, None, environ={}).values.metrics_addr == "off"
    assert load({"metrics_addr": "[::1]:9000"}, None, environ={}).values.metrics_addr == "[::1]:9000"
    assert load({"metrics_addr": "localhost:0"}, None, environ={}).values.metrics_addr == "localhost:0"
    with pytest.raises(ConfigError, match="not a loopback address.*metrics_allow_remote"):
        load({"metrics_addr": "0.0.0.0:9464"}, None, environ={})
    s = load({"metrics_addr": "0.0.0.0:9464", "metrics_allow_remote": "on"}, None, environ={})
    assert s.values.metrics_addr == "0.0.0.0:9464"


def test_gpu_layers_take_a_count_all_or_auto_from_every_source(tmp_path):
    assert load({}, None, environ={}).values.gpu_layers is None  # auto: llama.cpp's choice
    assert load({"gpu_layers": "all"}, None, environ={}).values.gpu_layers == "all"
    assert load({"gpu_layers": "ALL"}, None, environ={}).values.gpu_layers == "all"
    assert load({}, None, environ={"TANDEM_DRAFTER_GPU_LAYERS": "12"}).values.drafter_gpu_layers == 12
    f = tmp_path / "c.toml"
    f.write_text('gpu_layers = 7\ndrafter_gpu_layers = "all"\ndevice = "CUDA0,CUDA1"\n')
    s = load({}, f, environ={})
    v = s.values
    assert (v.gpu_layers, v.drafter_gpu_layers, v.device) == (7, "all", "CUDA0,CUDA1")
    for bad in ("-1", "many", "1.5"):
        with pytest.raises(ConfigError, match='gpu_layers.*a number of layers \\(0 or more\\) or "all"'):
            load({"gpu_layers": bad}, None, environ={})
    with pytest.raises(ConfigError, match="gpu_layers"):
        load({}, None, environ={"TANDEM_GPU_LAYERS": "true"})


def test_rpc_servers_are_loopback_unless_the_user_says_the_traffic_leaves():
    # names are resolved once, here: the workers and llama.cpp get the address that was checked
    s = load({"rpc": " 127.0.0.1:50052, localhost:50053,127.0.0.2:50054"}, None, environ={})
    assert s.values.rpc == "127.0.0.1:50052,127.0.0.1:50053,127.0.0.2:50054"
    assert config.rpc_servers(s.values.rpc) == ["127.0.0.1:50052", "127.0.0.1:50053", "127.0.0.2:50054"]
    with pytest.raises(ConfigError, match="the same server twice"):
        load({"rpc": "127.0.0.1:50052,localhost:50052"}, None, environ={})
    assert load({"rpc": "off"}, None, environ={}).values.rpc == "" and load({}, None, environ={}).values.rpc == ""
    for remote in ("192.168.1.20:50052", "127.0.0.1:50052,10.0.0.7:50052"):
        with pytest.raises(ConfigError, match="is not this machine.*unencrypted.*rpc_leaves_machine = true"):
            load({"rpc": remote}, None, environ={})
        loaded = load({"rpc": remote, "rpc_leaves_machine": "on"}, None, environ={})
        assert loaded.values.rpc == remote.replace(" ", "")
    for bad in ("127.0.0.1", "127.0.0.1:0", "127.0.0.1:70000", ":50052", "127.0.0.1:port"):
        with pytest.raises(ConfigError, match="is not HOST:PORT"):
            load({"rpc": bad}, None, environ={})
    for v6 in ("[::1]:50052", "[2001:db8::1]:50052"):  # llama.cpp's RPC client and server are IPv4 only
        with pytest.raises(ConfigError, match="IPv4 only.*127.0.0.1:PORT"):
            load({"rpc": v6, "rpc_leaves_machine": "on"}, None, environ={})
    with pytest.raises(ConfigError, match="cannot resolve 'no-such-host.invalid'"):
        load({"rpc": "no-such-host.invalid:50052"}, None, environ={})


def test_every_option_has_a_flag_an_environment_variable_and_help():
    keys = [o.key for o in config.OPTIONS]
    assert len(keys) == len(set(keys))
    for o in config.OPTIONS:
        assert o.flag == "--" + o.key.replace("_", "-") and o.env == "TANDEM_" + o.key.upper() and o.help
        if o.default is not None:  # every default passes its own parser
            assert config.parse_value(o, config.toml_value(o, o.default).strip('"'), "test") == o.default
    assert config.RELOADABLE == {"max_queue", "log_level", "preempt_tokens"}


def tandem(*args: str, env: dict) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    return subprocess.run(
        [sys.executable, "-m", "tandem.cli", *args],
        capture_output=True,
        text=True,
        env={**full, **env},
        timeout=60,
    )


def test_config_show_prints_each_value_with_its_source_as_a_valid_file(tmp_path):
    xdg = tmp_path / "xdg"
    (xdg / "tandem").mkdir(parents=True)
    path = xdg / "tandem" / "config.toml"
    path.write_text('cache_bytes = "512M"\nmax_queue = 3\n')
    out = tandem("config", "show", "--max-queue", "8", env={"XDG_CONFIG_HOME": str(xdg), "TANDEM_DRAFTER": "ngram"})
    assert out.returncode == 0, out.stderr
    lines = {
        line.split(" = ")[0]: line for line in out.stdout.splitlines() if " = " in line and not line.startswith("#")
    }
    assert set(lines) == {o.key for o in config.OPTIONS}
    assert lines["max_queue"].startswith("max_queue = 8") and "# flag --max-queue" in lines["max_queue"]
    assert lines["drafter"].startswith('drafter = "ngram"') and "# environment TANDEM_DRAFTER" in lines["drafter"]
    assert lines["cache_bytes"].startswith('cache_bytes = "512M"') and f"# config file {path}" in lines["cache_bytes"]
    assert "# default" in lines["page_tokens"]
    # what it prints is a config file that gives the same settings
    shown = tomllib.loads(out.stdout)
    again = tmp_path / "again.toml"
    again.write_text(out.stdout)
    v = load({}, again, environ={}).values
    assert v.max_queue == 8 and v.drafter == "ngram" and v.cache_bytes == 512 << 20 and set(shown) == set(lines)


@pytest.mark.slow  # seconds, no model: out of the fast subset
def test_a_bad_config_file_stops_commands_that_use_it_with_the_key_named(tmp_path):
    path = write(tmp_path, "max_queu = 3\n")
    for command in (["config", "show"], ["serve"], ["run", "hi"]):
        out = tandem("--config", str(path), *command, env={})
        assert out.returncode == 2, (command, out.stderr)
        assert "unknown key 'max_queu'" in out.stderr and "did you mean 'max_queue'" in out.stderr
    # status, stop and cache clear need only the socket: they warn and go on
    sock = tmp_path / "none.sock"
    for command in (["status"], ["stop"]):
        out = tandem("--config", str(path), "--socket", str(sock), *command, env={})
        assert "warning: unknown key 'max_queu'" in out.stderr and str(sock) in out.stderr, out.stderr


@pytest.mark.parametrize("raw", ["inf", "1e400", "nan"])
def test_non_finite_numbers_are_refused(raw):
    with pytest.raises(ConfigError, match="draft_p_min"):
        load({"draft_p_min": raw}, None, environ={})
    with pytest.raises(ConfigError, match="cache_bytes"):
        load({"cache_bytes": raw + "G"}, None, environ={})


def test_a_fractional_size_needs_a_unit(tmp_path):
    with pytest.raises(ConfigError, match=r'"1.5G"'):
        load({}, write(tmp_path, "cache_bytes = 1.5\n"), environ={})
    assert load({}, write(tmp_path, 'cache_bytes = "1.5G"\n'), environ={}).values.cache_bytes == 3 << 29


def test_relative_paths_in_the_file_are_relative_to_the_file(tmp_path):
    s = load({}, write(tmp_path, 'state_dir = "state"\nsocket = "/run/x.sock"\n'), environ={})
    assert s.values.state_dir == tmp_path / "state" and s.values.socket == Path("/run/x.sock")
    assert load({"state_dir": "rel"}, None, environ={}).values.state_dir == Path("rel")  # a flag: relative to the cwd


def test_a_config_file_that_is_not_utf8_is_a_config_error_naming_it(tmp_path):
    path = tmp_path / "config.toml"
    path.write_bytes(b'max_queue = 3\nlog_level = "\xff\xfe"\n')
    with pytest.raises(config.ConfigError, match="is not UTF-8"):
        config.read_file(path, required=True)
    out = tandem("--config", str(path), "serve", env={})
    assert out.returncode == 2 and "not UTF-8" in out.stderr and str(path) in out.stderr, out.stderr


def test_the_typed_settings_module_is_generated_from_the_options_table():
    """settings_fields.py is what the generator writes from OPTIONS today: an option
    changed without regenerating it fails here (and ``--check`` says so)."""
    from tandem.daemon import config_gen

    assert config_gen.TARGET.read_text() == config_gen.render(), (
        f"{config_gen.TARGET.name} is out of date with config.OPTIONS: run {config_gen.COMMAND}"
    )
    assert config_gen.main(["--check"]) == 0


def test_every_option_is_a_typed_field_with_its_default_and_its_kind_a_parser():
    from dataclasses import fields

    assert [f.name for f in fields(config.SettingsValues)] == [o.key for o in config.OPTIONS]
    defaults = config.SettingsValues()
    assert all(defaults[o.key] == getattr(defaults, o.key) == o.default for o in config.OPTIONS)
    assert {o.kind for o in config.OPTIONS} <= set(config.PARSERS)
    with pytest.raises(KeyError):
        defaults["no_such_option"]


def test_the_values_are_frozen_and_a_change_is_a_new_one():
    from dataclasses import FrozenInstanceError, replace

    s = load({}, None, environ={})
    with pytest.raises(FrozenInstanceError):
        s.values.max_queue = 3
    before = s.values
    s.values = replace(s.values, max_queue=3, log_level="debug")  # as a SIGHUP applies the reloadable ones
    assert s.values.changed(before) == ["max_queue", "log_level"] and before.max_queue == 16


def test_the_values_cross_processes_as_plain_data():
    import json

    import msgpack

    from tandem.daemon.worker.worker_config import WorkerConfig

    s = load({"state_dir": "/var/x", "gpu_layers": "all", "cache_bytes": "1G"}, None, environ={})
    plain = s.values.to_dict()
    assert plain["state_dir"] == "/var/x" and plain["socket"] is None and plain["gpu_layers"] == "all"
    assert config.SettingsValues.from_dict(json.loads(json.dumps(plain))) == s.values
    assert config.SettingsValues.from_dict(msgpack.unpackb(msgpack.packb(plain))) == s.values
    worker = WorkerConfig(role="target", model_name="m", model_path="/m.gguf", settings=s.values, life=2)
    again = WorkerConfig.from_dict(json.loads(json.dumps(worker.to_dict())))
    assert again == worker and again.settings.state_dir == Path("/var/x")


def test_settings_values_are_typed_and_read_by_key_too():
    """``tandem config show`` loops over OPTIONS and reads each value by its key; nothing else is untyped."""
    s = config.Settings(config.SettingsValues(socket=Path("/run/t.sock")), {}, Path(), False)
    assert s.values.socket == s.values["socket"] == Path("/run/t.sock") and s.values.model == "smollm2-135m"
    with pytest.raises(AttributeError):
        _ = s.socket  # (read settings.values.socket)
    with pytest.raises(KeyError):
        _ = s.values["no_such_option"]
