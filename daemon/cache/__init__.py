"""The prefix cache: the page tree, KV pages in the shared-memory arena, the page store and
the disk tier (its policy, disk_cache; its files, page_file)."""
