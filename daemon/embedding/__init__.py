"""Embeddings: the embedding model's worker process and what it computes.

vectors.py (pure: fitting inputs to the context, packing them into batches, the
vectors' last steps), llama_embed.py (the model in llama.cpp: pooled embeddings of
several sequences in one llama_decode), embed_worker.py (the worker process's
loop: the daemon's embed requests, its pace while a generation runs). The daemon's
side is daemon/front/embed_queue.py.
"""
