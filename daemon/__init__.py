"""The tandem daemon: the front process (server.py), the model worker process
(worker.py), and the logic they wrap (engine, sampler, textstream, chat)."""
