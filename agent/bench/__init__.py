"""`meshagent bench`: meshagent against direct and HAProxy, side by side, as ratios.

Modules: `hist` (latency histogram, pure), `loadgen` (constant-rate HTTP/1.1
client run inside a pod), `server` (HTTP/1.1 + h2c test server run inside a
pod), `haproxy` (config rendering, pure), `setups` (topologies and the proxies
on them), `loads` (the load generators and what they measure), `report`
(ratios, table, JSON, plot) and `harness` (one run: setups x loads).
"""
