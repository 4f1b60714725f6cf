"""What a proxy worker process loads: none of the supervisor's libraries.

Every worker pays, in resident memory, for each library it imports (issue 7:
node memory). Workers run the data path only, so the control-plane client
(grpc, protobuf), the manifest schema (pydantic, yaml), node metrics (psutil),
netlink and capture (pyroute2, python-iptables, bcc) and Prometheus parsing
must stay out of them. Checked two ways on real processes: the module table of
a fresh interpreter that runs the worker's start-up imports (the worker module
and the default plugins, as `worker.main` loads them), and the memory map of a
worker started by a real `WorkerPool`.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from agent.proxy.pool import WorkerOptions, WorkerPool

pytestmark = pytest.mark.privileged

# top-level packages a worker must not import
SUPERVISOR_ONLY = (
    "grpc",
    "google.protobuf",
    "pydantic",
    "pydantic_core",
    "yaml",
    "prometheus_client",
    "psutil",
    "pyroute2",
    "iptc",
    "bcc",
    "sqlite3",
    "cryptography",  # the supervisor seals keys (agent.identity.tls.seal)
)
# shared objects of those packages, as they appear in /proc/PID/maps
SUPERVISOR_ONLY_OBJECTS = (
    "cygrpc",
    "_pydantic_core",
    "_psutil_linux",
    "yaml/_yaml",
    "libbcc",
    "_upb",
    "libiptc",
    "cryptography/hazmat/bindings",
)

_STARTUP = """
import json, sys
from agent.proxy import worker
from agent.proxy.pool import WorkerOptions
for plugin in WorkerOptions().plugins:
    worker.load_plugin(plugin)
print(json.dumps(sorted(sys.modules)))
"""


def test_worker_startup_imports_none_of_the_supervisor_libraries() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _STARTUP], capture_output=True, text=True, check=True, timeout=60
    )
    modules = set(json.loads(out.stdout))
    assert "agent.proxy.dataplane" in modules  # the data path really was loaded
    assert "agent.admin.node" in modules  # it imports the node-metrics module...
    loaded = sorted(
        m for m in modules for bad in SUPERVISOR_ONLY if m == bad or m.startswith(bad + ".")
    )
    assert loaded == []  # ...but not psutil, nor any other supervisor library


async def test_pool_worker_maps_none_of_the_supervisor_shared_objects() -> None:
    pool = WorkerPool(1, options=WorkerOptions(stats_interval_s=60.0, log_level="warning"))
    await pool.start()
    try:
        (info,) = pool.workers
        maps = await asyncio.to_thread(Path(f"/proc/{info.pid}/maps").read_text)
    finally:
        await pool.close()
    objects = {
        line.split()[-1] for line in maps.splitlines() if line.endswith(".so") or ".so." in line
    }
    assert any("uvloop" in o for o in objects)  # the map is a real worker's
    assert sorted(o for o in objects for bad in SUPERVISOR_ONLY_OBJECTS if bad in o) == []
