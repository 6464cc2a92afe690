"""The tandem daemon, in packages by process and concern:

- ``front``: the front daemon's process (server.py, a shell around scheduler.py
  and supervisor.py; the client socket, systemd notification, metrics);
- ``worker``: a worker process's entry (worker_main.py) and the target's loop
  (target_worker.py) around the decoding logic without sockets (engine.py) and
  the llama.cpp model (llama_model.py);
- ``drafting``: the governor, the acceptance rule, the drafters and the drafter's
  worker;
- ``cache``: the prefix cache (page tree, KV pages, shared-memory arena, disk tier);
- ``constraints``: constrained output and tool calls;
- ``models``: model files (presets and pulling, GGUF metadata, devices, chat templates).

config.py (the options table), settings_fields.py (the settings as typed fields, generated from
that table by config_gen.py), serve.py (``tandem serve``) and version.py are shared."""
