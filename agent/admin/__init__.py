"""meshagent.admin: the node's admin server and metrics.

families.py   every metric family (`FAMILIES`, `register`); declarations only
metrics.py    `WorkerMetrics`, the workers' cheap recorder, and its label building blocks
aggregate.py  `MetricsAggregator` (supervisor merge of worker snapshots), `render`, `Exposition`
node.py       process, node and agent-state metrics (`NodeMetrics`), event-loop lag
controls.py   readiness gate, log-level specs, config_dump scrubbing (no I/O)
tap.py        `TapHub`: live events to bounded per-reader rings
server.py     `AdminServer`: /metrics /live /ready /config_dump /proxy-log-level /tap

The workers' recorder (metrics, observe and its bases) runs compiled when a current
mypyc build exists (agent.native).
"""

from __future__ import annotations

from agent import native

native.activate(__path__, "admin")
