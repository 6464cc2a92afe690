"""The prefix cache: the page tree, KV pages in the shared-memory arena, the page store and
the disk tier."""
