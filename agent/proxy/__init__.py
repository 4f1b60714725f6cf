"""meshagent.proxy.

The request path (HTTP/1, HTTP/2) runs compiled when a current mypyc build exists
(agent.native): `activate` puts it first on this package's path.
"""

from __future__ import annotations

from agent import native

native.activate(__path__, "proxy")
