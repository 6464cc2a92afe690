"""The tandem daemon, by process: the front (server.py, a shell around scheduler.py
and supervisor.py), the workers (worker_main.py, by role: target_worker.py and
drafter_worker.py), and the logic they wrap without sockets (engine, governor,
speculative, sampler, textstream, the prefix cache)."""
