"""`meshagent run`, the per-node supervisor: settings (`settings`), the pure
destination resolution (`resolve`) and the asyncio shell (`core.Supervisor`)."""
