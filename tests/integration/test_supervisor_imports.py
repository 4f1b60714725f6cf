"""What the supervisor loads to learn its pods: not pydantic.

The supervisor reads its pods from the manifests folder (`ManifestPodSource`),
and only Pods and Namespaces, whose reader (`agent.controlplane.plain`) needs
no pydantic: 11 MB of the supervisor's RSS (issue 7: node
memory). Checked on a fresh interpreter that imports the supervisor and reads
a folder holding every kind the control plane reads, a bad Service among them.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

_READ = """
import asyncio, json, sys
import agent.supervisor.core
from agent.pods.source import ManifestPodSource

async def main():
    source = ManifestPodSource(sys.argv[1], "node-a")
    try:
        async for desired in source.desired():
            return sorted(p.name for p in desired)
    finally:
        source.close()

pods = asyncio.run(main())
print(json.dumps({"pods": pods, "modules": sorted(sys.modules)}))
"""

_POD = """\
apiVersion: v1
kind: Pod
metadata: {name: web-1, namespace: shop, labels: {app: web}}
spec: {nodeName: node-a, containers: [{name: web, ports: [{containerPort: 8080}]}]}
status: {phase: Running, podIP: 10.0.0.5}
---
apiVersion: v1
kind: Service
metadata: {name: broken, namespace: shop}
spec: {ports: [{port: 0}]}
"""


def test_the_supervisor_reads_its_pods_without_pydantic(tmp_path: Path) -> None:
    folder = tmp_path / "manifests"
    shutil.copytree(EXAMPLES, folder)
    (folder / "shop" / "pod.yaml").write_text(_POD)
    kinds = {
        line.split(":", 1)[1].strip()
        for path in folder.rglob("*.yaml")
        for line in path.read_text().splitlines()
        if line.startswith("kind:")
    }
    assert {"Deployment", "Service", "ServiceProfile", "Server", "Namespace"} <= kinds

    out = subprocess.run(
        [sys.executable, "-c", _READ, str(folder)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    result = json.loads(out.stdout)
    assert result["pods"] == ["web-1"]  # the folder was read, its Namespace too (meshed)
    modules = set(result["modules"])
    assert "agent.controlplane.plain" in modules
    assert sorted(m for m in modules if m.split(".")[0] in ("pydantic", "pydantic_core")) == []
    assert "agent.controlplane.schema_core" not in modules
