"""Worker plugin that installs the mesh data path: `--plugin agent.proxy.dataplane`.

Importing this module sets `agent.proxy.worker.HANDLERS` for both listener
kinds: outbound (agent.proxy.outbound) and inbound (agent.proxy.inbound).
`WorkerPool` passes it to every worker by default (`WorkerOptions.plugins`).
"""

from __future__ import annotations

from agent.proxy import inbound, outbound, worker
from agent.proxy.listener import ListenerKind

PLUGIN = __name__


def install() -> None:
    """Point the worker's handlers at the data path (idempotent)."""
    worker.HANDLERS[ListenerKind.OUTBOUND] = outbound.handle
    worker.HANDLERS[ListenerKind.INBOUND] = inbound.handle


install()
