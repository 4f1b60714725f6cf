"""Generated protobuf and gRPC modules for Linkerd's proxy API. Do not edit.

Written by `scripts/gen-protos` from `protos/*.proto` (wire-compatible with
linkerd/linkerd2-proxy-api v0.20.0). Only `agent.control` and
`agent.controlplane` import these modules; domain types never hold them.

    from agent._proto import destination_pb2, destination_pb2_grpc
    from agent._proto import identity_pb2, identity_pb2_grpc
    from agent._proto import inbound_pb2, inbound_pb2_grpc
    from agent._proto import net_pb2, meta_pb2, http_types_pb2, http_route_pb2, grpc_route_pb2
"""
