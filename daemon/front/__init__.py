"""The front daemon's process: its poll loop (server), the queue (scheduler), the workers'
supervision, the client socket, systemd notification and the metrics endpoint."""
