"""Wire compatibility of agent/_proto with Linkerd's proxy API (linkerd2-proxy-api v0.20.0).

Every message type is built with the generated stubs, serialized, and the bytes are
read back by a small protobuf wire decoder written here (no protobuf library on the
decoding side). Each field seen on the wire is checked against TABLE, a hand-written
copy of the upstream field numbers, wire types and value kinds; each value is checked
against the sample that was put in. The compiled descriptors are also compared with
TABLE, ONEOFS, ENUMS, RESERVED and SERVICES so that a field added, renumbered or
retyped on either side fails here.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

import pytest
from google.protobuf import descriptor_pb2, duration_pb2, timestamp_pb2

from agent._proto import (
    destination_pb2,
    grpc_route_pb2,
    http_route_pb2,
    http_types_pb2,
    identity_pb2,
    inbound_pb2,
    meta_pb2,
    net_pb2,
)

# --- wire decoder (independent of the protobuf library) ----------------------------

VARINT, I64, LEN, I32 = 0, 1, 2, 5


class WireField(NamedTuple):
    number: int
    wire_type: int
    value: int | bytes  # int for VARINT, raw bytes for I64 / LEN / I32


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(data):
            raise ValueError(f"truncated varint at byte {pos}")
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
        if shift >= 70:
            raise ValueError(f"varint longer than 10 bytes at byte {pos}")


def decode(data: bytes) -> list[WireField]:
    """Split one serialized message into its top-level fields, in wire order."""
    fields: list[WireField] = []
    pos = 0
    while pos < len(data):
        key, pos = _read_varint(data, pos)
        number, wire_type = key >> 3, key & 7
        if number == 0:
            raise ValueError(f"field number 0 at byte {pos}")
        if wire_type == VARINT:
            value, pos = _read_varint(data, pos)
            fields.append(WireField(number, wire_type, value))
            continue
        if wire_type == LEN:
            size, pos = _read_varint(data, pos)
        elif wire_type == I64:
            size = 8
        elif wire_type == I32:
            size = 4
        else:
            raise ValueError(f"unsupported wire type {wire_type} for field {number}")
        if pos + size > len(data):
            raise ValueError(f"field {number} runs past the end ({pos}+{size} > {len(data)})")
        fields.append(WireField(number, wire_type, data[pos : pos + size]))
        pos += size
    return fields


# --- hand-written copy of the upstream definitions ---------------------------------


class F(NamedTuple):
    number: int
    wire_type: int
    kind: str  # scalar type name, "enum:<full name>", "msg:<full name>" or "map"
    repeated: bool = False


def f(number: int, wire_type: int, kind: str) -> F:
    return F(number, wire_type, kind)


def rep(number: int, wire_type: int, kind: str) -> F:
    return F(number, wire_type, kind, repeated=True)


def string_map(number: int) -> F:
    return F(number, LEN, "map", repeated=True)


NET = "io.linkerd.proxy.net."
META = "io.linkerd.proxy.meta."
HT = "io.linkerd.proxy.http_types."
HR = "io.linkerd.proxy.http_route."
GR = "io.linkerd.proxy.grpc_route."
ID = "io.linkerd.proxy.identity."
DST = "io.linkerd.proxy.destination."
IN = "io.linkerd.proxy.inbound."
DURATION = "msg:google.protobuf.Duration"
TIMESTAMP = "msg:google.protobuf.Timestamp"

# Well-known types used by the protos; checked on the wire, not part of our files.
EXTERNAL: dict[str, dict[str, F]] = {
    "google.protobuf.Duration": {"seconds": f(1, VARINT, "int64"), "nanos": f(2, VARINT, "int32")},
    "google.protobuf.Timestamp": {
        "seconds": f(1, VARINT, "int64"),
        "nanos": f(2, VARINT, "int32"),
    },
}

TABLE: dict[str, dict[str, F]] = {
    # net.proto
    NET + "IPAddress": {"ipv4": f(1, I32, "fixed32"), "ipv6": f(2, LEN, f"msg:{NET}IPv6")},
    NET + "IPNetwork": {
        "ip": f(1, LEN, f"msg:{NET}IPAddress"),
        "prefix_len": f(2, VARINT, "uint32"),
    },
    NET + "IPv6": {"first": f(1, I64, "fixed64"), "last": f(2, I64, "fixed64")},
    NET + "TcpAddress": {"ip": f(1, LEN, f"msg:{NET}IPAddress"), "port": f(2, VARINT, "uint32")},
    # meta.proto
    META + "Metadata": {
        "default": f(1, LEN, "string"),
        "resource": f(2, LEN, f"msg:{META}Resource"),
    },
    META + "Resource": {
        "group": f(1, LEN, "string"),
        "kind": f(2, LEN, "string"),
        "name": f(3, LEN, "string"),
        "namespace": f(4, LEN, "string"),
        "section": f(5, LEN, "string"),
        "port": f(6, VARINT, "uint32"),
    },
    # http_types.proto
    HT + "HttpMethod": {
        "registered": f(1, VARINT, f"enum:{HT}HttpMethod.Registered"),
        "unregistered": f(2, LEN, "string"),
    },
    HT + "Scheme": {
        "registered": f(1, VARINT, f"enum:{HT}Scheme.Registered"),
        "unregistered": f(2, LEN, "string"),
    },
    HT + "Headers": {"headers": rep(1, LEN, f"msg:{HT}Headers.Header")},
    HT + "Headers.Header": {"name": f(1, LEN, "string"), "value": f(2, LEN, "bytes")},
    # identity.proto
    ID + "CertifyRequest": {
        "identity": f(1, LEN, "string"),
        "token": f(2, LEN, "bytes"),
        "certificate_signing_request": f(3, LEN, "bytes"),
    },
    ID + "CertifyResponse": {
        "leaf_certificate": f(1, LEN, "bytes"),
        "intermediate_certificates": rep(2, LEN, "bytes"),
        "valid_until": f(3, LEN, TIMESTAMP),
    },
    # destination.proto
    DST + "GetDestination": {
        "scheme": f(1, LEN, "string"),
        "path": f(2, LEN, "string"),
        "context_token": f(3, LEN, "string"),
    },
    DST + "Update": {
        "add": f(1, LEN, f"msg:{DST}WeightedAddrSet"),
        "remove": f(2, LEN, f"msg:{DST}AddrSet"),
        "no_endpoints": f(3, LEN, f"msg:{DST}NoEndpoints"),
    },
    DST + "AddrSet": {"addrs": rep(1, LEN, f"msg:{NET}TcpAddress")},
    DST + "WeightedAddrSet": {
        "addrs": rep(1, LEN, f"msg:{DST}WeightedAddr"),
        "metric_labels": string_map(2),
    },
    DST + "WeightedAddr": {
        "addr": f(1, LEN, f"msg:{NET}TcpAddress"),
        "weight": f(3, VARINT, "uint32"),
        "metric_labels": string_map(4),
        "tls_identity": f(5, LEN, f"msg:{DST}TlsIdentity"),
        "protocol_hint": f(6, LEN, f"msg:{DST}ProtocolHint"),
        "authority_override": f(7, LEN, f"msg:{DST}AuthorityOverride"),
        "http2": f(8, LEN, f"msg:{DST}Http2ClientParams"),
        "resource_ref": f(9, LEN, f"msg:{META}Metadata"),
    },
    DST + "TlsIdentity": {
        "dns_like_identity": f(1, LEN, f"msg:{DST}TlsIdentity.DnsLikeIdentity"),
        "uri_like_identity": f(3, LEN, f"msg:{DST}TlsIdentity.UriLikeIdentity"),
        "server_name": f(4, LEN, f"msg:{DST}TlsIdentity.DnsLikeIdentity"),
    },
    DST + "TlsIdentity.DnsLikeIdentity": {"name": f(1, LEN, "string")},
    DST + "TlsIdentity.UriLikeIdentity": {"uri": f(1, LEN, "string")},
    DST + "AuthorityOverride": {"authority_override": f(1, LEN, "string")},
    DST + "NoEndpoints": {"exists": f(1, VARINT, "bool")},
    DST + "ProtocolHint": {
        "h2": f(1, LEN, f"msg:{DST}ProtocolHint.H2"),
        "opaque": f(3, LEN, f"msg:{DST}ProtocolHint.Opaque"),
        "opaque_transport": f(2, LEN, f"msg:{DST}ProtocolHint.OpaqueTransport"),
    },
    DST + "ProtocolHint.H2": {},
    DST + "ProtocolHint.Opaque": {},
    DST + "ProtocolHint.OpaqueTransport": {"inbound_port": f(1, VARINT, "uint32")},
    DST + "Http2ClientParams": {
        "flow_control": f(1, LEN, f"msg:{DST}Http2ClientParams.FlowControl"),
        "keep_alive": f(2, LEN, f"msg:{DST}Http2ClientParams.KeepAlive"),
        "internals": f(3, LEN, f"msg:{DST}Http2ClientParams.Internals"),
    },
    DST + "Http2ClientParams.FlowControl": {
        "initial_connection_window_size": f(1, VARINT, "uint32"),
        "initial_stream_window_size": f(2, VARINT, "uint32"),
        "adaptive_flow_control": f(3, VARINT, "bool"),
    },
    DST + "Http2ClientParams.KeepAlive": {
        "interval": f(1, LEN, DURATION),
        "timeout": f(2, LEN, DURATION),
        "while_idle": f(3, VARINT, "bool"),
    },
    DST + "Http2ClientParams.Internals": {
        "max_concurrent_reset_streams": f(1, VARINT, "uint32"),
        "max_frame_size": f(2, VARINT, "uint32"),
        "max_send_buf_size": f(3, VARINT, "uint32"),
    },
    DST + "DestinationProfile": {
        "routes": rep(1, LEN, f"msg:{DST}Route"),
        "retry_budget": f(2, LEN, f"msg:{DST}RetryBudget"),
        "dst_overrides": rep(3, LEN, f"msg:{DST}WeightedDst"),
        "opaque_protocol": f(4, VARINT, "bool"),
        "fully_qualified_name": f(5, LEN, "string"),
        "endpoint": f(6, LEN, f"msg:{DST}WeightedAddr"),
        "parent_ref": f(7, LEN, f"msg:{META}Metadata"),
        "profile_ref": f(8, LEN, f"msg:{META}Metadata"),
    },
    DST + "Route": {
        "condition": f(1, LEN, f"msg:{DST}RequestMatch"),
        "response_classes": rep(2, LEN, f"msg:{DST}ResponseClass"),
        "metrics_labels": string_map(3),
        "is_retryable": f(4, VARINT, "bool"),
        "timeout": f(5, LEN, DURATION),
    },
    DST + "RetryBudget": {
        "retry_ratio": f(1, I32, "float"),
        "min_retries_per_second": f(2, VARINT, "uint32"),
        "ttl": f(3, LEN, DURATION),
    },
    DST + "ResponseClass": {
        "condition": f(1, LEN, f"msg:{DST}ResponseMatch"),
        "is_failure": f(2, VARINT, "bool"),
    },
    DST + "RequestMatch": {
        "all": f(1, LEN, f"msg:{DST}RequestMatch.Seq"),
        "any": f(2, LEN, f"msg:{DST}RequestMatch.Seq"),
        "not": f(3, LEN, f"msg:{DST}RequestMatch"),
        "path": f(4, LEN, f"msg:{DST}PathMatch"),
        "method": f(5, LEN, f"msg:{HT}HttpMethod"),
    },
    DST + "RequestMatch.Seq": {"matches": rep(1, LEN, f"msg:{DST}RequestMatch")},
    DST + "PathMatch": {"regex": f(1, LEN, "string")},
    DST + "ResponseMatch": {
        "all": f(1, LEN, f"msg:{DST}ResponseMatch.Seq"),
        "any": f(2, LEN, f"msg:{DST}ResponseMatch.Seq"),
        "not": f(3, LEN, f"msg:{DST}ResponseMatch"),
        "status": f(4, LEN, f"msg:{DST}HttpStatusRange"),
    },
    DST + "ResponseMatch.Seq": {"matches": rep(1, LEN, f"msg:{DST}ResponseMatch")},
    DST + "HttpStatusRange": {"min": f(1, VARINT, "uint32"), "max": f(2, VARINT, "uint32")},
    DST + "WeightedDst": {
        "authority": f(1, LEN, "string"),
        "weight": f(2, VARINT, "uint32"),
        "backend_ref": f(3, LEN, f"msg:{META}Metadata"),
    },
    # http_route.proto
    HR + "HostMatch": {
        "exact": f(1, LEN, "string"),
        "suffix": f(2, LEN, f"msg:{HR}HostMatch.Suffix"),
    },
    HR + "HostMatch.Suffix": {"reverse_labels": rep(1, LEN, "string")},
    HR + "HttpRouteMatch": {
        "path": f(1, LEN, f"msg:{HR}PathMatch"),
        "headers": rep(2, LEN, f"msg:{HR}HeaderMatch"),
        "query_params": rep(3, LEN, f"msg:{HR}QueryParamMatch"),
        "method": f(4, LEN, f"msg:{HT}HttpMethod"),
    },
    HR + "PathMatch": {
        "exact": f(1, LEN, "string"),
        "prefix": f(2, LEN, "string"),
        "regex": f(3, LEN, "string"),
    },
    HR + "HeaderMatch": {
        "name": f(1, LEN, "string"),
        "exact": f(2, LEN, "bytes"),
        "regex": f(3, LEN, "string"),
    },
    HR + "QueryParamMatch": {
        "name": f(1, LEN, "string"),
        "exact": f(2, LEN, "string"),
        "regex": f(3, LEN, "string"),
    },
    HR + "RequestHeaderModifier": {
        "add": f(1, LEN, f"msg:{HT}Headers"),
        "set": f(2, LEN, f"msg:{HT}Headers"),
        "remove": rep(3, LEN, "string"),
    },
    HR + "ResponseHeaderModifier": {
        "add": f(1, LEN, f"msg:{HT}Headers"),
        "set": f(2, LEN, f"msg:{HT}Headers"),
        "remove": rep(3, LEN, "string"),
    },
    HR + "RequestRedirect": {
        "scheme": f(1, LEN, f"msg:{HT}Scheme"),
        "host": f(2, LEN, "string"),
        "path": f(3, LEN, f"msg:{HR}PathModifier"),
        "port": f(4, VARINT, "uint32"),
        "status": f(5, VARINT, "uint32"),
    },
    HR + "PathModifier": {"full": f(1, LEN, "string"), "prefix": f(2, LEN, "string")},
    HR + "HttpFailureInjector": {
        "status": f(1, VARINT, "uint32"),
        "message": f(2, LEN, "string"),
        "ratio": f(3, LEN, f"msg:{HR}Ratio"),
    },
    HR + "Ratio": {"numerator": f(1, VARINT, "uint32"), "denominator": f(2, VARINT, "uint32")},
    HR + "Timeouts": {
        "response": f(1, LEN, DURATION),
        "request": f(2, LEN, DURATION),
        "idle": f(3, LEN, DURATION),
    },
    # grpc_route.proto
    GR + "GrpcRouteMatch": {
        "rpc": f(1, LEN, f"msg:{GR}GrpcRpcMatch"),
        "headers": rep(2, LEN, f"msg:{HR}HeaderMatch"),
    },
    GR + "GrpcRpcMatch": {"service": f(1, LEN, "string"), "method": f(2, LEN, "string")},
    GR + "GrpcFailureInjector": {
        "code": f(1, VARINT, "uint32"),
        "message": f(2, LEN, "string"),
        "ratio": f(3, LEN, f"msg:{HR}Ratio"),
    },
    # inbound.proto
    IN + "PortSpec": {"workload": f(1, LEN, "string"), "port": f(2, VARINT, "uint32")},
    IN + "Server": {
        "protocol": f(1, LEN, f"msg:{IN}ProxyProtocol"),
        "server_ips": rep(2, LEN, f"msg:{NET}IPAddress"),
        "authorizations": rep(3, LEN, f"msg:{IN}Authz"),
        "labels": string_map(4),
    },
    IN + "ProxyProtocol": {
        "detect": f(1, LEN, f"msg:{IN}ProxyProtocol.Detect"),
        "opaque": f(2, LEN, f"msg:{IN}ProxyProtocol.Opaque"),
        "tls": f(3, LEN, f"msg:{IN}ProxyProtocol.Tls"),
        "http1": f(4, LEN, f"msg:{IN}ProxyProtocol.Http1"),
        "http2": f(5, LEN, f"msg:{IN}ProxyProtocol.Http2"),
        "grpc": f(6, LEN, f"msg:{IN}ProxyProtocol.Grpc"),
    },
    IN + "ProxyProtocol.Detect": {
        "timeout": f(1, LEN, DURATION),
        "http_routes": rep(3, LEN, f"msg:{IN}HttpRoute"),
        "http_local_rate_limit": f(4, LEN, f"msg:{IN}HttpLocalRateLimit"),
    },
    IN + "ProxyProtocol.Http1": {
        "routes": rep(2, LEN, f"msg:{IN}HttpRoute"),
        "local_rate_limit": f(3, LEN, f"msg:{IN}HttpLocalRateLimit"),
    },
    IN + "ProxyProtocol.Http2": {
        "routes": rep(2, LEN, f"msg:{IN}HttpRoute"),
        "local_rate_limit": f(3, LEN, f"msg:{IN}HttpLocalRateLimit"),
    },
    IN + "ProxyProtocol.Grpc": {"routes": rep(2, LEN, f"msg:{IN}GrpcRoute")},
    IN + "ProxyProtocol.Opaque": {},
    IN + "ProxyProtocol.Tls": {},
    IN + "Authz": {
        "networks": rep(1, LEN, f"msg:{IN}Network"),
        "authentication": f(2, LEN, f"msg:{IN}Authn"),
        "labels": string_map(3),
        "metadata": f(4, LEN, f"msg:{META}Metadata"),
    },
    IN + "Network": {
        "net": f(1, LEN, f"msg:{NET}IPNetwork"),
        "except": rep(2, LEN, f"msg:{NET}IPNetwork"),
    },
    IN + "Authn": {
        "unauthenticated": f(1, LEN, f"msg:{IN}Authn.PermitUnauthenticated"),
        "meshTLS": f(2, LEN, f"msg:{IN}Authn.PermitMeshTLS"),
    },
    IN + "Authn.PermitUnauthenticated": {},
    IN + "Authn.PermitMeshTLS": {
        "unauthenticated": f(1, LEN, f"msg:{IN}Authn.PermitUnauthenticated"),
        "identities": f(2, LEN, f"msg:{IN}Authn.PermitMeshTLS.PermitClientIdentities"),
    },
    IN + "Authn.PermitMeshTLS.PermitClientIdentities": {
        "identities": rep(1, LEN, f"msg:{IN}Identity"),
        "suffixes": rep(2, LEN, f"msg:{IN}IdentitySuffix"),
    },
    IN + "Identity": {"name": f(1, LEN, "string")},
    IN + "IdentitySuffix": {"parts": rep(1, LEN, "string")},
    IN + "HttpRoute": {
        "metadata": f(1, LEN, f"msg:{META}Metadata"),
        "hosts": rep(2, LEN, f"msg:{HR}HostMatch"),
        "authorizations": rep(3, LEN, f"msg:{IN}Authz"),
        "rules": rep(4, LEN, f"msg:{IN}HttpRoute.Rule"),
    },
    IN + "HttpRoute.Rule": {
        "matches": rep(1, LEN, f"msg:{HR}HttpRouteMatch"),
        "filters": rep(2, LEN, f"msg:{IN}HttpRoute.Filter"),
    },
    IN + "HttpRoute.Filter": {
        "failure_injector": f(1, LEN, f"msg:{HR}HttpFailureInjector"),
        "request_header_modifier": f(2, LEN, f"msg:{HR}RequestHeaderModifier"),
        "redirect": f(3, LEN, f"msg:{HR}RequestRedirect"),
    },
    IN + "GrpcRoute": {
        "metadata": f(1, LEN, f"msg:{META}Metadata"),
        "hosts": rep(2, LEN, f"msg:{HR}HostMatch"),
        "authorizations": rep(3, LEN, f"msg:{IN}Authz"),
        "rules": rep(4, LEN, f"msg:{IN}GrpcRoute.Rule"),
    },
    IN + "GrpcRoute.Rule": {
        "matches": rep(1, LEN, f"msg:{GR}GrpcRouteMatch"),
        "filters": rep(2, LEN, f"msg:{IN}GrpcRoute.Filter"),
    },
    IN + "GrpcRoute.Filter": {
        "failure_injector": f(1, LEN, f"msg:{GR}GrpcFailureInjector"),
        "request_header_modifier": f(2, LEN, f"msg:{HR}RequestHeaderModifier"),
    },
    IN + "HttpLocalRateLimit": {
        "metadata": f(1, LEN, f"msg:{META}Metadata"),
        "total": f(2, LEN, f"msg:{IN}HttpLocalRateLimit.Limit"),
        "identity": f(3, LEN, f"msg:{IN}HttpLocalRateLimit.Limit"),
        "overrides": rep(4, LEN, f"msg:{IN}HttpLocalRateLimit.Override"),
    },
    IN + "HttpLocalRateLimit.Override": {
        "limit": f(1, LEN, f"msg:{IN}HttpLocalRateLimit.Limit"),
        "clients": f(2, LEN, f"msg:{IN}HttpLocalRateLimit.Override.ClientIdentities"),
    },
    IN + "HttpLocalRateLimit.Override.ClientIdentities": {
        "identities": rep(1, LEN, f"msg:{IN}Identity"),
    },
    IN + "HttpLocalRateLimit.Limit": {"requestsPerSecond": f(1, VARINT, "uint32")},
}

ONEOFS: dict[str, dict[str, set[str]]] = {
    NET + "IPAddress": {"ip": {"ipv4", "ipv6"}},
    META + "Metadata": {"kind": {"default", "resource"}},
    HT + "HttpMethod": {"type": {"registered", "unregistered"}},
    HT + "Scheme": {"type": {"registered", "unregistered"}},
    DST + "Update": {"update": {"add", "remove", "no_endpoints"}},
    DST + "TlsIdentity": {"strategy": {"dns_like_identity", "uri_like_identity"}},
    DST + "ProtocolHint": {"protocol": {"h2", "opaque"}},
    DST + "RequestMatch": {"match": {"all", "any", "not", "path", "method"}},
    DST + "ResponseMatch": {"match": {"all", "any", "not", "status"}},
    HR + "HostMatch": {"match": {"exact", "suffix"}},
    HR + "PathMatch": {"kind": {"exact", "prefix", "regex"}},
    HR + "HeaderMatch": {"value": {"exact", "regex"}},
    HR + "QueryParamMatch": {"value": {"exact", "regex"}},
    HR + "PathModifier": {"replace": {"full", "prefix"}},
    IN + "ProxyProtocol": {"kind": {"detect", "opaque", "tls", "http1", "http2", "grpc"}},
    IN + "Authn": {"permit": {"unauthenticated", "meshTLS"}},
    IN + "Authn.PermitMeshTLS": {"clients": {"unauthenticated", "identities"}},
    IN + "HttpRoute.Filter": {"kind": {"failure_injector", "request_header_modifier", "redirect"}},
    IN + "GrpcRoute.Filter": {"kind": {"failure_injector", "request_header_modifier"}},
}

ENUMS: dict[str, dict[str, int]] = {
    HT + "HttpMethod.Registered": {
        "GET": 0,
        "POST": 1,
        "PUT": 2,
        "DELETE": 3,
        "PATCH": 4,
        "OPTIONS": 5,
        "CONNECT": 6,
        "HEAD": 7,
        "TRACE": 8,
    },
    HT + "Scheme.Registered": {"HTTP": 0, "HTTPS": 1},
}

# Field numbers upstream reserves (never to be reused).
RESERVED: dict[str, set[int]] = {
    DST + "TlsIdentity": {2},
    IN + "ProxyProtocol.Detect": {2},
    IN + "ProxyProtocol.Http1": {1},
    IN + "ProxyProtocol.Http2": {1},
    IN + "ProxyProtocol.Grpc": {1},
}

# gRPC path -> (request type, response type, client streaming, server streaming)
SERVICES: dict[str, tuple[str, str, bool, bool]] = {
    "/io.linkerd.proxy.destination.Destination/Get": (
        DST + "GetDestination",
        DST + "Update",
        False,
        True,
    ),
    "/io.linkerd.proxy.destination.Destination/GetProfile": (
        DST + "GetDestination",
        DST + "DestinationProfile",
        False,
        True,
    ),
    "/io.linkerd.proxy.identity.Identity/Certify": (
        ID + "CertifyRequest",
        ID + "CertifyResponse",
        False,
        False,
    ),
    "/io.linkerd.proxy.inbound.InboundServerPolicies/GetPort": (
        IN + "PortSpec",
        IN + "Server",
        False,
        False,
    ),
    "/io.linkerd.proxy.inbound.InboundServerPolicies/WatchPort": (
        IN + "PortSpec",
        IN + "Server",
        False,
        True,
    ),
}

# proto file -> package, as upstream names them.
FILES = {
    "net.proto": "io.linkerd.proxy.net",
    "meta.proto": "io.linkerd.proxy.meta",
    "http_types.proto": "io.linkerd.proxy.http_types",
    "http_route.proto": "io.linkerd.proxy.http_route",
    "grpc_route.proto": "io.linkerd.proxy.grpc_route",
    "identity.proto": "io.linkerd.proxy.identity",
    "destination.proto": "io.linkerd.proxy.destination",
    "inbound.proto": "io.linkerd.proxy.inbound",
}

MODULES = [
    net_pb2,
    meta_pb2,
    http_types_pb2,
    http_route_pb2,
    grpc_route_pb2,
    identity_pb2,
    destination_pb2,
    inbound_pb2,
]

# --- building populated messages with the stubs -----------------------------------

MAX_DEPTH = 3  # nested messages deeper than this are left empty (RequestMatch recurses)


def _walk(cls, into: dict) -> None:
    into[cls.DESCRIPTOR.full_name] = cls
    for nested in cls.DESCRIPTOR.nested_types:
        if not nested.GetOptions().map_entry:
            _walk(getattr(cls, nested.name), into)


def _classes() -> dict:
    classes: dict = {}
    for module in MODULES:
        for desc in module.DESCRIPTOR.message_types_by_name.values():
            _walk(getattr(module, desc.name), classes)
    classes["google.protobuf.Duration"] = duration_pb2.Duration
    classes["google.protobuf.Timestamp"] = timestamp_pb2.Timestamp
    return classes


CLASSES = _classes()
ALL_TYPES = {**TABLE, **EXTERNAL}


def sample(kind: str, spec: F, name: str) -> object:
    """The value a field of this kind is filled with, and expected back on the wire."""
    values: dict[str, object] = {
        "string": f"{name}-é",
        "bytes": b"\x00\xff" + name.encode(),
        "uint32": 150 + 1000 * spec.number,
        "int32": 123_456_789,
        "int64": 2**33 + spec.number,
        "bool": True,
        "fixed32": 0x0A000001,
        "fixed64": 0x20010DB8_00000000 | spec.number,
        "float": 0.25,
    }
    if kind.startswith("enum:"):
        return 1
    return values[kind]


def _first_oneof_members(full_name: str) -> set[str]:
    """Fields left out of a "full" instance: all oneof members but the first."""
    skipped: set[str] = set()
    for members in ONEOFS.get(full_name, {}).values():
        ordered = sorted(members, key=lambda n: TABLE[full_name][n].number)
        skipped.update(ordered[1:])
    return skipped


def build(full_name: str, depth: int = 0):
    """An instance of `full_name` with every field set (first member of each oneof)."""
    msg = CLASSES[full_name]()
    if depth >= MAX_DEPTH:
        return msg
    skipped = _first_oneof_members(full_name) if full_name in TABLE else set()
    for name, spec in ALL_TYPES[full_name].items():
        if name not in skipped:
            set_field(msg, name, spec, depth)
    return msg


def set_field(msg, name: str, spec: F, depth: int) -> None:
    if spec.kind == "map":
        getattr(msg, name)[f"k-{name}"] = f"v-{name}"
    elif spec.kind.startswith("msg:"):
        sub = build(spec.kind[4:], depth + 1)
        if spec.repeated:
            getattr(msg, name).add().CopyFrom(sub)
        else:
            getattr(msg, name).SetInParent()
            getattr(msg, name).CopyFrom(sub)
    elif spec.repeated:
        getattr(msg, name).append(sample(spec.kind, spec, name))
    else:
        setattr(msg, name, sample(spec.kind, spec, name))


# --- checking decoded bytes against the table --------------------------------------


def check_wire(full_name: str, data: bytes, depth: int = 0) -> list[int]:
    """Check every field in `data` against ALL_TYPES[full_name]; return the numbers seen."""
    by_number = {spec.number: (name, spec) for name, spec in ALL_TYPES[full_name].items()}
    seen = []
    for field in decode(data):
        assert field.number in by_number, f"{full_name}: unknown field number {field.number}"
        name, spec = by_number[field.number]
        assert field.wire_type == spec.wire_type, (
            f"{full_name}.{name}: wire type {field.wire_type}, want {spec.wire_type}"
        )
        check_value(full_name, name, spec, field.value, depth)
        seen.append(field.number)
    return seen


def _check_scalar(kind: str, value: int | bytes, expected: object) -> bool:
    if kind in ("string", "bytes"):
        raw = expected.encode() if isinstance(expected, str) else expected
        return value == raw
    if kind == "bool":
        return value == 1
    if kind in ("uint32", "int32", "int64") or kind.startswith("enum:"):
        return value == expected
    assert isinstance(value, bytes)
    if kind in ("fixed32", "fixed64"):
        return int.from_bytes(value, "little") == expected
    if kind == "float":
        return struct.unpack("<f", value)[0] == expected
    raise AssertionError(f"BUG: no check for kind {kind!r}")


def check_value(full_name: str, name: str, spec: F, value: int | bytes, depth: int) -> None:
    where = f"{full_name}.{name}"
    if spec.kind == "map":
        assert isinstance(value, bytes)
        entry = decode(value)
        assert entry == [
            WireField(1, LEN, f"k-{name}".encode()),
            WireField(2, LEN, f"v-{name}".encode()),
        ], f"{where}: map entry {entry}"
    elif spec.kind.startswith("msg:"):
        assert isinstance(value, bytes)
        seen = check_wire(spec.kind[4:], value, depth + 1)
        if depth + 1 >= MAX_DEPTH:
            assert seen == [], f"{where}: expected an empty nested message"
    else:
        expected = sample(spec.kind, spec, name)
        assert _check_scalar(spec.kind, value, expected), f"{where}: {value!r} != {expected!r}"


# --- tests -------------------------------------------------------------------------

FIELDS = [(m, n) for m, fields in TABLE.items() for n in fields]


def test_decoder_reads_known_encodings():
    # field 1 varint 150; field 2 LEN "testing"; field 3 fixed32 1; field 4 fixed64 1
    data = bytes.fromhex("089601120774657374696e671d01000000210100000000000000")
    assert decode(data) == [
        WireField(1, VARINT, 150),
        WireField(2, LEN, b"testing"),
        WireField(3, I32, b"\x01\x00\x00\x00"),
        WireField(4, I64, b"\x01" + 7 * b"\x00"),
    ]


@pytest.mark.parametrize("data", [b"\x08", b"\x12\x05ab", b"\x0b", b"\x00\x01"])
def test_decoder_rejects_malformed_input(data):
    with pytest.raises(ValueError):
        decode(data)


def test_every_generated_message_type_is_in_the_table():
    generated = {name for name in CLASSES if not name.startswith("google.protobuf.")}
    assert generated == set(TABLE)


@pytest.mark.parametrize("full_name", sorted(TABLE))
def test_field_numbers_types_and_labels_match_descriptor(full_name):
    desc = CLASSES[full_name].DESCRIPTOR
    want = TABLE[full_name]
    assert {fd.name: fd.number for fd in desc.fields} == {n: s.number for n, s in want.items()}
    for fd in desc.fields:
        spec = want[fd.name]
        assert fd.is_repeated == spec.repeated, f"{full_name}.{fd.name} repeated"
        if spec.kind == "map":
            assert fd.message_type.GetOptions().map_entry, f"{full_name}.{fd.name} not a map"
            assert [x.type for x in fd.message_type.fields] == [fd.TYPE_STRING, fd.TYPE_STRING]
        elif spec.kind.startswith("msg:"):
            assert fd.type == fd.TYPE_MESSAGE
            assert fd.message_type.full_name == spec.kind[4:], f"{full_name}.{fd.name}"
        elif spec.kind.startswith("enum:"):
            assert fd.type == fd.TYPE_ENUM
            assert fd.enum_type.full_name == spec.kind[5:], f"{full_name}.{fd.name}"
        else:
            assert fd.type == getattr(fd, f"TYPE_{spec.kind.upper()}"), f"{full_name}.{fd.name}"


@pytest.mark.parametrize("full_name", sorted(TABLE))
def test_oneofs_match_upstream(full_name):
    desc = CLASSES[full_name].DESCRIPTOR
    got = {o.name: {fd.name for fd in o.fields} for o in desc.oneofs}
    assert got == ONEOFS.get(full_name, {})


def test_enums_match_upstream():
    got = {}
    for cls in CLASSES.values():
        for enum in cls.DESCRIPTOR.enum_types:
            got[enum.full_name] = {v.name: v.number for v in enum.values}
    assert got == ENUMS


def test_reserved_field_numbers_match_upstream():
    got: dict[str, set[int]] = {}

    def walk(prefix: str, messages) -> None:
        for m in messages:
            name = f"{prefix}.{m.name}"
            numbers = {n for r in m.reserved_range for n in range(r.start, r.end)}
            if numbers:
                got[name] = numbers
            walk(name, m.nested_type)

    for module in MODULES:
        fdp = descriptor_pb2.FileDescriptorProto.FromString(module.DESCRIPTOR.serialized_pb)
        walk(fdp.package, fdp.message_type)
    assert got == RESERVED
    assert "k8s_pod_identity" in _reserved_names(destination_pb2, "TlsIdentity")


def _reserved_names(module, message: str) -> list[str]:
    fdp = descriptor_pb2.FileDescriptorProto.FromString(module.DESCRIPTOR.serialized_pb)
    (msg,) = [m for m in fdp.message_type if m.name == message]
    return list(msg.reserved_name)


def test_files_keep_upstream_names_and_packages():
    assert {m.DESCRIPTOR.name: m.DESCRIPTOR.package for m in MODULES} == FILES


@pytest.mark.parametrize(("full_name", "field"), FIELDS, ids=[f"{m}.{n}" for m, n in FIELDS])
def test_single_field_has_upstream_number_and_wire_type(full_name, field):
    spec = TABLE[full_name][field]
    msg = CLASSES[full_name]()
    set_field(msg, field, spec, depth=0)
    data = msg.SerializeToString()
    assert check_wire(full_name, data) == [spec.number]


@pytest.mark.parametrize("full_name", sorted(TABLE))
def test_populated_message_decodes_against_table(full_name):
    msg = build(full_name)
    data = msg.SerializeToString()
    want = sorted(
        s.number for n, s in TABLE[full_name].items() if n not in _first_oneof_members(full_name)
    )
    assert sorted(check_wire(full_name, data)) == want
    assert CLASSES[full_name].FromString(data) == msg


@pytest.mark.parametrize("path", sorted(SERVICES))
def test_service_method_paths_and_streaming_kinds(path):
    request, response, client_streaming, server_streaming = SERVICES[path]
    _, service_name, method_name = path.split("/")
    package, _, service = service_name.rpartition(".")
    (module,) = [m for m in MODULES if m.DESCRIPTOR.package == package]
    method = module.DESCRIPTOR.services_by_name[service].methods_by_name[method_name]
    assert method.full_name == f"{service_name}.{method_name}"
    assert method.input_type.full_name == request
    assert method.output_type.full_name == response
    assert method.client_streaming is client_streaming
    assert method.server_streaming is server_streaming


def test_services_are_exactly_the_three_upstream_ones():
    got = {
        f"/{svc.full_name}/{m.name}"
        for module in MODULES
        for svc in module.DESCRIPTOR.services_by_name.values()
        for m in svc.methods
    }
    assert got == set(SERVICES)
