"""meshagent.control."""
