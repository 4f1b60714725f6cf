"""meshagent.pods."""
