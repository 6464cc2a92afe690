"""Grammar-constrained output (llguidance) and tool calls."""
