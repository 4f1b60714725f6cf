"""Linkerd documents -> kinds_linkerd objects: fully typed, Linkerd and Gateway API defaults."""

from __future__ import annotations

import ipaddress

from agent.controlplane import kinds
from agent.controlplane import kinds_linkerd as l5d
from agent.controlplane import resources as r
from agent.controlplane.documents import parse_text


def _one(text: str) -> kinds.Resource:
    objects, errors = parse_text(text, file="t.yaml")
    assert errors == []
    assert len(objects) == 1
    return objects[0]


def test_service_profile_is_fully_typed():
    profile = _one("""\
apiVersion: linkerd.io/v1alpha2
kind: ServiceProfile
metadata: {name: api.shop.svc.cluster.local, namespace: shop}
spec:
  opaquePorts: ["5432", "6000-6002"]
  dstOverrides:
    - {authority: api-v2.shop.svc.cluster.local:8080, weight: 500m}
  routes:
    - name: tree
      condition:
        all:
          - method: GET
          - any:
              - pathRegex: /a
              - not: {pathRegex: /b}
      responseClasses:
        - condition: {not: {status: {min: 200, max: 399}}}
          isFailure: true
      timeout: 1m30s
  retryBudget: {retryRatio: 0.2, minRetriesPerSecond: 10, ttl: 10s}
""")
    assert isinstance(profile, l5d.ServiceProfile)
    route = profile.routes[0]
    assert route.timeout == 90.0
    inner = route.condition.all[1].any[1]
    assert inner.not_ == l5d.RequestMatch(path_regex="/b")
    rc = route.response_classes[0]
    assert rc.is_failure
    assert rc.condition.not_ is not None
    assert rc.condition.not_.status == l5d.StatusRange(min=200, max=399)
    assert profile.retry_budget == l5d.RetryBudget(
        retry_ratio=0.2, min_retries_per_second=10, ttl=10.0
    )
    assert profile.opaque_ports == (r.PortRange(5432, 5432), r.PortRange(6000, 6002))
    assert profile.dst_overrides == (
        l5d.WeightedDst(authority="api-v2.shop.svc.cluster.local:8080", weight=0.5),
    )


def test_policy_objects_are_typed_with_linkerd_defaults():
    objects, errors = parse_text("""\
apiVersion: policy.linkerd.io/v1beta3
kind: Server
metadata: {name: srv, namespace: shop}
spec:
  podSelector:
    matchExpressions: [{key: app, operator: In, values: [api, web]}]
  port: 8080
---
apiVersion: policy.linkerd.io/v1beta1
kind: ServerAuthorization
metadata: {name: saz, namespace: shop}
spec:
  server: {selector: {matchLabels: {tier: back}}}
  client:
    networks: [{cidr: 10.0.0.0/8, except: [10.1.0.0/16, 10.2.3.4]}]
    meshTLS:
      identities: ["*.shop.serviceaccount.identity.linkerd.cluster.local"]
      serviceAccounts: [{name: web}, {name: load, namespace: other}]
---
apiVersion: policy.linkerd.io/v1alpha1
kind: NetworkAuthentication
metadata: {name: nets, namespace: shop}
spec:
  networks: [{cidr: 192.168.0.0/16}, {cidr: "fd00::/8"}]
""")
    assert errors == []
    srv, saz, nets = objects
    assert isinstance(srv, l5d.Server)
    assert srv.port == 8080
    assert srv.proxy_protocol is l5d.ProxyProtocol.UNKNOWN
    assert srv.access_policy is l5d.AccessPolicy.DENY
    assert srv.pod_selector.matches({"app": "web"})
    assert not srv.pod_selector.matches({"app": "db"})
    assert isinstance(saz, l5d.ServerAuthorization)
    assert saz.server_name == ""
    assert saz.networks[0].contains("10.9.9.9")
    assert not saz.networks[0].contains("10.1.2.3")
    assert not saz.networks[0].contains("10.2.3.4")
    assert saz.mesh_tls is not None
    assert saz.mesh_tls.service_accounts[1] == l5d.ServiceAccountRef(name="load", namespace="other")
    assert isinstance(nets, l5d.NetworkAuthentication)
    assert nets.networks[1].cidr == ipaddress.ip_network("fd00::/8")


def test_http_routes_of_both_groups_get_gateway_defaults():
    objects, errors = parse_text("""\
apiVersion: policy.linkerd.io/v1beta3
kind: HTTPRoute
metadata: {name: r, namespace: shop}
spec:
  parentRefs: [{name: api-http, kind: Server}]
  rules:
    - matches:
        - path: {value: /retry}
          method: GET
          headers: [{name: x-user, value: "a.*", type: RegularExpression}]
      timeouts: {request: 2s}
---
apiVersion: gateway.networking.k8s.io/v1
kind: HTTPRoute
metadata: {name: r, namespace: shop}
spec:
  parentRefs: [{name: api, kind: Service, group: core, port: 8080}]
""")
    assert errors == []
    policy, gateway = objects
    assert isinstance(policy, l5d.HTTPRoute)
    assert isinstance(gateway, l5d.HTTPRoute)
    assert policy.key != gateway.key  # same name, different API groups
    assert policy.parent_refs[0].group == "policy.linkerd.io"
    match = policy.rules[0].matches[0]
    assert match.path == l5d.PathMatch(type=l5d.PathMatchType.PATH_PREFIX, value="/retry")
    assert match.headers[0].type is l5d.ValueMatchType.REGULAR_EXPRESSION
    assert policy.rules[0].timeout == 2.0
    assert gateway.rules == (l5d.RouteRule(),)  # default: PathPrefix "/"
    assert gateway.rules[0].matches[0].path == l5d.PathMatch()
