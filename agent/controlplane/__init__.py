"""meshagent.controlplane."""
