"""Errors meshagent raises on purpose.

Every error names what failed and where, in its fields and its message.

    AgentError                      base; anything else escaping is a bug
    ├── SettingError(source, value, reason)        a bad flag or MESHAGENT_* variable
    ├── ManifestError(file, index, kind, name, field, reason)
    ├── InvalidResource(kind, name, field, reason) a control-plane resource we refuse
    ├── AnnotationError(pod, annotation, value, reason)
    ├── PKIError(path, reason)                     certificates, keys, trust bundles
    ├── RedirectError(pod, netns, argv, stderr)    programming capture failed
    └── PrerequisiteError(what, hint)             something missing on this machine
"""

from __future__ import annotations


class AgentError(Exception):
    """Base of every error meshagent raises on purpose."""


class SettingError(AgentError):
    """A flag or environment variable has a bad value."""

    def __init__(self, source: str, value: str, reason: str) -> None:
        self.source = source
        self.value = value
        self.reason = reason
        super().__init__(f"{source}={value!r}: {reason}")


class ManifestError(AgentError):
    """A manifest document is malformed; it alone is rejected."""

    def __init__(  # noqa: PLR0913 - every field locates the error
        self,
        *,
        file: str,
        index: int,
        kind: str = "",
        name: str = "",
        field: str = "",
        reason: str,
    ) -> None:
        self.file = file
        self.index = index
        self.kind = kind
        self.name = name
        self.field = field
        self.reason = reason
        where = f"{file} document {index}"
        if kind or name:
            where += f" ({kind or '?'}/{name or '?'})"
        if field:
            where += f" field {field}"
        super().__init__(f"{where}: {reason}")


class InvalidResource(AgentError):  # noqa: N818 - the name Linkerd uses
    """A resource cannot be turned into a domain object."""

    def __init__(self, kind: str, name: str, field: str, reason: str) -> None:
        self.kind = kind
        self.name = name
        self.field = field
        self.reason = reason
        super().__init__(f"invalid {kind} {name!r}: {field}: {reason}")


class AnnotationError(AgentError):
    """A pod or namespace annotation has a value we cannot use."""

    def __init__(self, pod: str, annotation: str, value: str, reason: str) -> None:
        self.pod = pod
        self.annotation = annotation
        self.value = value
        self.reason = reason
        super().__init__(f"pod {pod}: annotation {annotation}={value!r}: {reason}")


class PKIError(AgentError):
    """A certificate, key or trust bundle is missing, malformed or does not chain."""

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"{path}: {reason}")


class RedirectError(AgentError):
    """Programming or reading a pod's capture failed."""

    def __init__(self, pod: str, netns: str, argv: list[str] | str, stderr: str) -> None:
        self.pod = pod
        self.netns = netns
        self.argv = argv
        self.stderr = stderr
        cmd = argv if isinstance(argv, str) else " ".join(argv)
        super().__init__(f"pod {pod} (netns {netns}): {cmd}: {stderr.strip()}")


class PrerequisiteError(AgentError):
    """Something this machine lacks; the hint says how to get it."""

    def __init__(self, what: str, hint: str) -> None:
        self.what = what
        self.hint = hint
        super().__init__(f"{what} (hint: {hint})")


class PoolError(AgentError):
    """The proxy workers could not be started."""


class RegistryError(AgentError):
    """The enrolled-pods registry's file is not one; it is neither read nor replaced."""

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"registry {path}: {reason}")
