"""Worker plugin that installs the mesh data path: `--plugin agent.proxy.dataplane`.

Importing this module sets the worker's `HANDLERS` (`agent.proxy.accept`) for both listener
kinds: outbound (agent.proxy.outbound) and inbound (agent.proxy.inbound), and
the observability hooks (agent.admin.observe): the metrics recorder, its
reports to the supervisor every second and at drain, and tap events.
`WorkerPool` passes it to every worker by default (`WorkerOptions.plugins`).
"""

from __future__ import annotations

from agent.admin import observe
from agent.proxy import accept, inbound, outbound, worker
from agent.proxy.listener import ListenerKind

PLUGIN = __name__


def install() -> None:
    """Point the worker's handlers at the data path and add the metrics hooks (idempotent)."""
    accept.HANDLERS[ListenerKind.OUTBOUND] = outbound.handle
    accept.HANDLERS[ListenerKind.INBOUND] = inbound.handle
    if observe.start not in worker.START_HOOKS:
        worker.START_HOOKS.append(observe.start)
    if observe.final not in worker.DRAIN_HOOKS:
        worker.DRAIN_HOOKS.append(observe.final)


install()
