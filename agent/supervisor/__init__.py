"""`meshagent run`, the per-node supervisor: settings (`settings`), the pure
destination resolution (`resolve`) and the asyncio shell (`core.Supervisor`),
with its parts: pod enrollment (`enroll`), the destinations workers asked for
(`targets`) and the admin server's read-only views (`dump`)."""
