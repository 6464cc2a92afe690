"""The target worker's process: its entry (worker_main), its loop (target_worker), the
decoding logic without sockets (engine), the llama.cpp model (llama_model) and the load
probes (invariance)."""
