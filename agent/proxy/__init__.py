"""meshagent.proxy."""
