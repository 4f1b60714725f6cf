"""meshagent.admin."""
