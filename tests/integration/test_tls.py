"""mTLS over real sockets on 127.0.0.1 with contexts from agent.identity.tls."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from agent.identity import ca
from agent.identity.names import Identity
from agent.identity.tls import client_context, peer_identity, server_context

pytestmark = pytest.mark.privileged

CLIENT = Identity(sa="web", ns="shop")
SERVER = Identity(sa="db", ns="shop")


@pytest.fixture
def now():
    return datetime.now(UTC)


@pytest.fixture
def issuer(tmp_path, now):
    return ca.create_mesh(tmp_path / "mesh", now=now)


@pytest.fixture
async def server(issuer, now):
    """A TLS server: records the peer identity or the handshake error, echoes the identity."""
    chain, key, _ = issuer.workload(SERVER, now=now)
    ctx = server_context(chain, key, issuer.bundle.pem)
    seen: list[str | None] = []
    errors: list[BaseException] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await writer.start_tls(ctx)
        except (ssl.SSLError, OSError) as exc:
            errors.append(exc)
            writer.close()
            return
        ident = peer_identity(writer.get_extra_info("ssl_object"))
        seen.append(ident)
        writer.write(f"{ident}\n".encode())
        await writer.drain()
        writer.close()
        with contextlib.suppress(ssl.SSLError, OSError):
            await writer.wait_closed()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    yield {"port": port, "seen": seen, "errors": errors}
    srv.close()
    await srv.wait_closed()


async def _exchange(port: int, ctx: ssl.SSLContext) -> tuple[str, str | None]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=ctx)
    try:
        line = await asyncio.wait_for(reader.readline(), 5)
        return line.decode().strip(), peer_identity(writer.get_extra_info("ssl_object"))
    finally:
        writer.close()
        with contextlib.suppress(ssl.SSLError, OSError):
            await writer.wait_closed()


async def _exchange_or_raise(port: int, ctx: ssl.SSLContext) -> None:
    line, _ = await _exchange(port, ctx)
    if not line:  # closed without answering
        raise ConnectionError("closed without an answer")


async def _refused(port: int, ctx: ssl.SSLContext, server) -> BaseException:
    """The exchange fails on the client side and the server saw no identity."""
    with pytest.raises((ssl.SSLError, ConnectionError, asyncio.IncompleteReadError)) as info:
        await _exchange_or_raise(port, ctx)
    await asyncio.sleep(0.05)
    assert server["seen"] == []
    return info.value


async def test_mtls_works_and_each_side_sees_the_others_identity(issuer, server, now):
    chain, key, _ = issuer.workload(CLIENT, now=now)
    ctx = client_context(chain, key, issuer.bundle.pem)
    echoed, server_ident = await _exchange(server["port"], ctx)
    assert echoed == CLIENT.dns_name
    assert server["seen"] == [CLIENT.dns_name]
    assert server_ident == SERVER.dns_name


async def test_the_negotiated_protocol_is_tls_1_3(issuer, server, now):
    chain, key, _ = issuer.workload(CLIENT, now=now)
    reader, writer = await asyncio.open_connection(
        "127.0.0.1", server["port"], ssl=client_context(chain, key, issuer.bundle.pem)
    )
    assert writer.get_extra_info("ssl_object").version() == "TLSv1.3"
    await reader.readline()
    writer.close()
    await writer.wait_closed()


async def test_client_cert_from_a_foreign_ca_is_refused(issuer, server, tmp_path, now):
    foreign = ca.create_mesh(tmp_path / "foreign", now=now)
    chain, key, _ = foreign.workload(CLIENT, now=now)
    # the client trusts our bundle, so only the server's check can fail
    await _refused(server["port"], client_context(chain, key, issuer.bundle.pem), server)
    assert any("certificate verify failed" in str(e) for e in server["errors"])


async def test_server_from_a_foreign_ca_is_refused_by_the_client(issuer, server, tmp_path, now):
    foreign = ca.create_mesh(tmp_path / "foreign", now=now)
    chain, key, _ = foreign.workload(CLIENT, now=now)
    exc = await _refused(server["port"], client_context(chain, key, foreign.bundle.pem), server)
    assert isinstance(exc, ssl.SSLCertVerificationError)


async def test_expired_client_cert_is_refused(issuer, server, now):
    chain, key, _ = issuer.workload(CLIENT, now=now - timedelta(hours=48))
    await _refused(server["port"], client_context(chain, key, issuer.bundle.pem), server)
    assert any("expired" in str(e) for e in server["errors"])


async def test_missing_client_cert_is_refused(issuer, server):
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.check_hostname = False
    ctx.load_verify_locations(cadata=issuer.bundle.pem.decode())
    await _refused(server["port"], ctx, server)
    assert any("certificate" in str(e).lower() for e in server["errors"])


async def test_tls_1_2_client_is_refused(issuer, server, now):
    chain, key, _ = issuer.workload(CLIENT, now=now)
    ctx = client_context(chain, key, issuer.bundle.pem)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.maximum_version = ssl.TLSVersion.TLSv1_2
    await _refused(server["port"], ctx, server)
    assert any("UNSUPPORTED_PROTOCOL" in str(e) for e in server["errors"])


def test_building_contexts_leaves_no_descriptor_and_no_file(issuer, tmp_path, now):
    chain, key, _ = issuer.workload(CLIENT, now=now)
    fds = Path("/proc/self/fd")
    before = {p.name for p in fds.iterdir()}
    for _ in range(5):
        client_context(chain, key, issuer.bundle.pem)
        server_context(chain, key, issuer.bundle.pem)
    assert {p.name for p in fds.iterdir()} <= before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mesh"]


def test_peer_identity_is_none_without_a_verified_peer():
    class NoPeer:
        def getpeercert(self):
            return {}

    class TwoNames:
        def getpeercert(self):
            return {"subjectAltName": (("DNS", "a.example"), ("DNS", "b.example"))}

    assert peer_identity(NoPeer()) is None  # type: ignore[arg-type]
    assert peer_identity(TwoNames()) is None  # type: ignore[arg-type]
