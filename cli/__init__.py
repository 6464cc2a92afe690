"""The ``tandem`` command line (``tandem.cli.main:main``; ``python -m tandem.cli``), one
module per command group: serving (serve, stop, http, key), ask (run, chat, tokens),
status, cache, config_cmd (config show), service (the systemd units), models (list, pull,
show, rm, models); common.py holds what they share and autostart.py starts a daemon
in the background for the commands that need one."""
