"""meshagent.policy."""
