"""The bench's manifests: what `meshagent run` and the control plane read about bench pods."""

from __future__ import annotations

import socket

from agent.bench import mesh
from agent.controlplane import manifests


def test_pod_manifest_is_a_meshed_running_pod_on_its_node():
    pod = mesh.BenchPod(role="srv2", node="b", ip="10.200.1.2", ports=(8080, 5201))
    doc = mesh.pod_manifest(pod)
    assert doc["metadata"]["uid"] == mesh.pod_uid("srv2")
    assert doc["metadata"]["annotations"]["linkerd.io/inject"] == "enabled"
    assert doc["spec"]["nodeName"] == "b"
    assert doc["status"]["podIP"] == "10.200.1.2"
    ports = doc["spec"]["containers"][0]["ports"]
    assert [p["containerPort"] for p in ports] == [8080, 5201]
    assert doc["spec"]["serviceAccountName"] == "srv2"


def test_pod_annotations_go_beside_the_inject_annotation():
    skip = (("config.linkerd.io/skip-inbound-ports", "8081"),)
    pod = mesh.BenchPod(role="srv", node="a", ip="10.200.0.3", annotations=skip)
    assert mesh.pod_manifest(pod)["metadata"]["annotations"] == {
        "linkerd.io/inject": "enabled",
        "config.linkerd.io/skip-inbound-ports": "8081",
    }


def test_lab_name_carries_the_uid_discovery_looks_for():
    assert mesh.lab_name("cli") == f"pod{mesh.pod_uid('cli')}"
    assert mesh.pod_uid("cli") != mesh.pod_uid("srv")
    assert mesh.pod_uid("cli") == mesh.pod_uid("cli")


def test_control_plane_parses_the_manifests_without_errors():
    pod = mesh.BenchPod(role="srv", node="a", ip="10.200.0.3", ports=(8080,))
    idle = mesh.BenchPod(role="idle7", node="a", ip="10.200.0.9")
    docs = [
        mesh.namespace_manifest(),
        mesh.pod_manifest(pod),
        mesh.pod_manifest(idle),
        mesh.service_manifest(pod),
    ]
    objects, errors = manifests.parse_text(mesh.dump(docs))
    assert errors == []
    kinds = sorted(type(o).__name__ for o in objects)
    assert kinds == ["Namespace", "Pod", "Pod", "Service"]


def test_the_bench_waits_as_long_as_a_worker_takes_to_report_its_counts():
    from agent.admin import observe  # noqa: PLC0415

    assert mesh.REPORT_S == observe.REPORT_S


def _scrape(stamps: dict[str, float], desired: int | None) -> dict:
    from agent.admin import stat  # noqa: PLC0415

    lines = [
        'request_total{direction="outbound",pod="cli"} 7',
        'request_total{direction="outbound",pod="cli2"} 5',
        'request_total{direction="inbound",pod="srv"} 11',
    ]
    lines += [f'{mesh.STAMP}{{process="worker",worker="{w}"}} {t}' for w, t in stamps.items()]
    if desired is not None:
        lines.append(f'meshagent_workers{{state="desired"}} {desired}')
    return stat.parse("\n".join(lines) + "\n", 0.0).samples


def test_a_scrape_is_settled_once_every_wanted_worker_reported_after_the_moment():
    assert mesh.settled(_scrape({"0": 100.5, "1": 100.2}, 2), 100.0)
    assert mesh.settled(_scrape({"0": 100.0, "1": 101.0}, 2), 100.0)  # at the moment counts
    assert not mesh.settled(_scrape({"0": 100.5, "1": 99.9}, 2), 100.0)  # one is older
    assert not mesh.settled(_scrape({"0": 100.5}, 2), 100.0)  # one never reported
    assert not mesh.settled(_scrape({"0": 100.5, "1": 100.2}, None), 100.0)  # not the agent's


def test_counted_sums_one_direction_of_a_scrape():
    samples = _scrape({}, 1)
    assert mesh.counted(samples, "outbound") == 12
    assert mesh.counted(samples, "inbound") == 11
    assert mesh.counted(samples, "sideways") == 0


def test_ports_handed_out_lie_below_the_ephemeral_range():
    ports = mesh.listen_ports((32768, 60999))
    assert ports.stop == 32768
    assert ports.start >= 1024


def test_ports_handed_out_lie_above_an_ephemeral_range_that_starts_low():
    ports = mesh.listen_ports((2000, 50000))
    assert (ports.start, ports.stop) == (50001, 50001 + mesh.FREE_PORT_SPAN)


def test_an_ephemeral_range_of_every_unprivileged_port_leaves_none_to_hand_out():
    assert not mesh.listen_ports((1024, 65535))


def test_a_free_port_is_bindable_and_outside_the_ephemeral_range():
    port = mesh.free_port()
    low, high = (int(x) for x in mesh.EPHEMERAL_RANGE.read_text().split())
    assert not low <= port <= high
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_free_ports_asked_for_together_differ():
    ports = [mesh.free_port() for _ in range(500)]
    assert len(set(ports)) == len(ports)
