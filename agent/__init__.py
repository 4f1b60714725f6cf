"""meshagent: a per-node service-mesh agent that speaks Linkerd's proxy API."""

from __future__ import annotations

__version__ = "0.1.0"
