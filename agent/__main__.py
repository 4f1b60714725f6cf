"""`python -m agent` runs the `meshagent` command."""

from __future__ import annotations

from agent.cli import main

raise SystemExit(main())
