"""`meshagent bench`: meshagent against direct and HAProxy, side by side, as ratios.

Modules: `hist` (latency histogram, pure), `loadgen` (constant-rate HTTP/1.1
client run inside a pod), `server` (HTTP/1.1 + h2c test server run inside a
pod), `haproxy` (config rendering, pure), `topology` (the lab, its tuned pods
and servers, `Target`), `peers` (direct, HAProxy and Python-floor setups),
`setups` (the meshagent setups and the `SETUPS` registry), `loads` (the load
generators and what they measure), `report` (ratios, table, JSON, plot) and
`harness` (one run: setups x loads).
"""
