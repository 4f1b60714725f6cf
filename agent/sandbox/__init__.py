"""The sandbox: the whole mesh on one machine (`meshagent sandbox`)."""
