"""Worker plugin for tests/integration/test_worker_pool.py (loaded with `--plugin PATH`).

- The relay target comes from state key "test-target" (set by the test with
  `WorkerPool.broadcast`), so the echo server can live anywhere in the pod netns.
- Listeners whose id ends in "boom" get a handler that raises.
- Listeners whose id ends in "need" first wait for state key "need-gate",
  asking the supervisor for it with `Need(kind="test", key="need-gate")`.
"""

from __future__ import annotations

from agent.proxy import accept, worker
from agent.proxy.listener import ListenerKind


def _resolve(conn: accept.Conn) -> tuple[str, int]:
    lid = conn.listener.listener_id
    if lid.endswith("boom"):
        raise RuntimeError(f"handler of {lid} raises on purpose")
    host, port = conn.worker.state["test-target"]
    return (host, port)


async def _needy(conn: accept.Conn) -> None:
    if conn.listener.listener_id.endswith("need"):
        await conn.worker.state.want("need-gate", kind="test", wait_s=5.0)
    await worker.relay_handler(conn)


accept.resolve_target = _resolve
accept.HANDLERS[ListenerKind.OUTBOUND] = _needy
