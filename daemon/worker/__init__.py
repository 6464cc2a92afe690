"""The target worker's process: its entry (worker_main), its loop (target_worker), the
decoding logic without sockets (engine, with prompts, rounds, request_state and
pass_timing), the llama.cpp model (llama_model: loaded by llama_load, decoded by
llama_decode, checked by load_checks, its prompts read by prompt_reader) and the load
probes' kept verdicts (invariance)."""
