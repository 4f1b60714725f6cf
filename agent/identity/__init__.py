"""meshagent.identity."""
