"""Tenant isolation: a tenant cannot read another tenant's tokens or submit as another tenant.

On NATS the server refuses it (each tenant's user may publish only to its own request subject
and subscribe only to its own token subjects and inbox; it has no JetStream API). On HTTP the
API key alone decides the tenant.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import AsyncIterator

import httpx
import nats
import nats.errors
import pytest
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from ripplemesh.client import MeshClient
from ripplemesh.launcher import Mesh
from schemas.events import ReplayTokens, SubmitRequest, encode_event, new_event_id
from schemas.subjects import TOKENS, request_subject, tokens_subject
from services.mesh.bus import Bus
from services.mesh.embedded_nats import EmbeddedNats
from services.mesh.nats_auth import NatsAuth, NatsCredentials
from tests.conftest import TEST_KEY, async_wait_until

pytestmark = pytest.mark.timeout(120)

QUIET_S = 1.0  # long enough for a message that was going to arrive on loopback


class Connection:
    """A NATS connection that keeps the asynchronous errors the server sends it."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.nc: NatsClient | None = None

    async def open(self, servers: list[str], credentials: NatsCredentials) -> NatsClient:
        async def on_error(exc: Exception) -> None:
            self.errors.append(str(exc))

        self.nc = await nats.connect(
            servers, error_cb=on_error, allow_reconnect=False, **credentials.connect_options()
        )
        return self.nc

    def violations(self) -> list[str]:
        return [e.lower() for e in self.errors if "permissions violation" in e.lower()]


@pytest.fixture
async def acme(nats_server: EmbeddedNats, nats_auth: NatsAuth) -> AsyncIterator[Connection]:
    connection = Connection()
    await connection.open(nats_server.urls, nats_auth.credentials("acme"))
    yield connection
    assert connection.nc is not None
    await connection.nc.close()


@pytest.fixture
async def services(bus: Bus) -> AsyncIterator[NatsClient]:
    """The services' user, on a server whose streams are provisioned."""
    nc = bus.nc
    yield nc


async def _collect(nc: NatsClient, subject: str) -> tuple[list[Msg], object]:
    received: list[Msg] = []

    async def keep(msg: Msg) -> None:
        received.append(msg)

    sub = await nc.subscribe(subject, cb=keep)
    await nc.flush()
    return received, sub


# ---------------------------------------------------------------- NATS: the server refuses


async def test_a_tenant_submits_only_on_its_own_subject(acme: Connection, services: NatsClient) -> None:
    assert acme.nc is not None
    seen_by_services, _ = await _collect(services, request_subject("tiny"))
    # (A replay request for nothing: harmless to the mesh, and stored like a submission.)
    event = ReplayTokens(event_id=new_event_id(), occurred_at=time.time(), request_id=uuid.uuid4().hex)
    # Its own subject: stored, acknowledged.
    ack = await acme.nc.jetstream().publish(
        request_subject("acme"), encode_event(event), headers={"Nats-Msg-Id": event.event_id}
    )
    assert ack.stream == "REQUESTS"

    # Another tenant's subject: refused by the server; no one receives it, nothing is stored.
    await acme.nc.publish(request_subject("tiny"), encode_event(event))
    await acme.nc.flush()
    await async_wait_until(lambda: acme.violations())
    assert f'publish to "{request_subject("tiny")}"' in acme.violations()[0]
    with pytest.raises(nats.errors.Error):  # no ack: the message never reached the stream
        await acme.nc.jetstream().publish(request_subject("tiny"), b"{}", timeout=1)
    await asyncio.sleep(QUIET_S)
    assert seen_by_services == []


async def test_a_tenant_reads_only_its_own_tokens(acme: Connection, services: NatsClient) -> None:
    assert acme.nc is not None
    request_id = uuid.uuid4().hex
    own, _ = await _collect(acme.nc, tokens_subject("acme", request_id))
    theirs, _ = await _collect(acme.nc, tokens_subject("tiny", request_id))
    everyone, _ = await _collect(acme.nc, "rmesh.tokens.>")
    inboxes, _ = await _collect(acme.nc, "_INBOX.>")  # the services' replies
    tiny_inboxes, _ = await _collect(acme.nc, "_INBOX_tiny.>")
    await async_wait_until(lambda: len(acme.violations()) >= 4)
    refused = " ".join(acme.violations())
    for subject in (tokens_subject("tiny", request_id), "rmesh.tokens.>", "_INBOX.>", "_INBOX_tiny.>"):
        assert f'subscription to "{subject}"'.lower() in refused  # (nats-py lowercases errors)

    await services.publish(tokens_subject("acme", request_id), b"acme's token")
    await services.publish(tokens_subject("tiny", request_id), b"tiny's token")
    await services.publish("_INBOX.someone.1", b"a service's reply")
    await services.publish("_INBOX_tiny.someone.1", b"tiny's reply")
    await services.flush()
    await async_wait_until(lambda: len(own) == 1)
    await asyncio.sleep(QUIET_S)
    assert [m.data for m in own] == [b"acme's token"]
    assert theirs == everyone == inboxes == tiny_inboxes == []


async def test_a_tenant_has_no_jetstream_api(acme: Connection, services: NatsClient) -> None:
    """No stream to read back another tenant's tokens from, no consumer to create, no bucket."""
    assert acme.nc is not None
    js = acme.nc.jetstream(timeout=1)
    with pytest.raises(nats.errors.Error):
        await js.stream_info(TOKENS.name)
    with pytest.raises(nats.errors.Error):
        await js.subscribe(tokens_subject("tiny", "x"), stream=TOKENS.name, ordered_consumer=True)
    with pytest.raises(nats.errors.Error):
        await js.key_value("WORKERS")
    await async_wait_until(lambda: any("$js.api" in v.lower() for v in acme.violations()))


async def test_a_tenant_needs_its_own_password(nats_server: EmbeddedNats, nats_auth: NatsAuth) -> None:
    tiny = nats_auth.credentials("tiny")
    for options in (
        {"user": "acme", "password": tiny.password},  # another tenant's password
        {"user": "acme", "password": "guess"},
        {},  # no credentials at all
    ):
        with pytest.raises(nats.errors.Error, match="Authorization Violation"):
            await nats.connect(nats_server.urls, allow_reconnect=False, max_reconnect_attempts=0, **options)


def test_the_server_stores_only_password_hashes(nats_server: EmbeddedNats, nats_auth: NatsAuth) -> None:
    config = nats_server.nodes[0].config_path.read_text()
    assert oct(nats_server.nodes[0].config_path.stat().st_mode & 0o777) == "0o600"
    for creds in (nats_auth.service, *nats_auth.tenants.values()):
        assert creds.password not in config
    routes = 1 if len(nats_server.nodes) > 1 else 0  # a cluster's route user
    assert config.count('"$2b$') == len(nats_auth.users) + routes


# ---------------------------------------------------------------- through the mesh


async def test_a_tenant_streams_its_requests_and_replays_only_its_own(mesh: Mesh) -> None:
    acme = mesh.credentials("acme")
    tiny = mesh.credentials("tiny")
    async with MeshClient(mesh.url, "acme", credentials=acme) as client:
        result = await client.complete(prompt="only mine", max_tokens=6)
        assert result.usage.completion_tokens == 6
        # A replay of its own request: every event of it, published again to its subscription.
        subject = tokens_subject("acme", result.request_id)
        again, _ = await _collect(client.nc, subject)
        replay = ReplayTokens(
            event_id=new_event_id(), occurred_at=time.time(), request_id=result.request_id, from_seq=0
        )
        await client.nc.jetstream().publish(
            request_subject("acme"), encode_event(replay), headers={"Nats-Msg-Id": replay.event_id}
        )
        await async_wait_until(lambda: len(again) == result.chunks + 1, timeout_s=10)
        assert sorted(json.loads(m.data)["seq"] for m in again) == list(range(result.chunks + 1))

        # Another tenant asks for the same request's replay: on its own subject, which names
        # only its own streams: nothing reaches acme's subject, nor tiny.
        async with MeshClient(mesh.url, "tiny", credentials=tiny) as other:
            leaked, _ = await _collect(other.nc, tokens_subject("tiny", result.request_id))
            again.clear()
            replay = ReplayTokens(
                event_id=new_event_id(), occurred_at=time.time(), request_id=result.request_id, from_seq=0
            )
            await other.nc.jetstream().publish(
                request_subject("tiny"), encode_event(replay), headers={"Nats-Msg-Id": replay.event_id}
            )
            await asyncio.sleep(2.0)
            assert again == [] and leaked == []


async def test_a_tenant_cannot_submit_as_another(mesh: Mesh) -> None:
    tiny = mesh.credentials("tiny")
    # Refused by the client...
    with pytest.raises(ValueError, match="cannot act for"):
        MeshClient(mesh.url, "acme", credentials=tiny)
    # ... and, for a client that tries anyway, by the server: the request never enters the mesh.
    request_id = uuid.uuid4().hex
    services = await nats.connect(mesh.servers, **mesh.connect_options())
    forged = Connection()
    nc = await forged.open(mesh.servers, tiny)
    try:
        tokens, _ = await _collect(services, tokens_subject("acme", request_id))
        submission = SubmitRequest(
            event_id=new_event_id(),
            occurred_at=time.time(),
            request_id=request_id,
            model="llama-3-8b",
            prompt="as acme",
            max_tokens=4,
        )
        await nc.publish(request_subject("acme"), encode_event(submission))
        await nc.flush()
        await async_wait_until(lambda: forged.violations())
        await asyncio.sleep(3.0)
        assert tokens == []
        assert _ledger_row(mesh, request_id) is None
    finally:
        await nc.close()
        await services.close()


# ---------------------------------------------------------------- HTTP: the key decides


async def test_an_api_key_acts_only_for_its_own_tenant(mesh: Mesh) -> None:
    """acme's key with every way a client might claim tiny: served, and accounted, as acme."""
    url = f"http://127.0.0.1:{mesh.http_port}/v1/chat/completions"
    async with httpx.AsyncClient(timeout=30) as http:
        response = await http.post(
            url,
            headers={
                "Authorization": f"Bearer {TEST_KEY}",
                "OpenAI-Organization": "tiny",
                "x-ripple-tenant": "tiny",
            },
            json={
                "model": "llama-3-8b",
                "messages": [{"role": "user", "content": "whose am I"}],
                "max_tokens": 3,
                "user": "tiny",
                "tenant": "tiny",
            },
        )
        assert response.status_code == 200, response.text
        request_id = response.json()["id"].removeprefix("chatcmpl-")
        # No key, a wrong key, a tenant's name, another tenant's NATS password: not an API key.
        for headers in (
            {},
            {"Authorization": "Bearer rm-not-a-key"},
            {"Authorization": "Bearer tiny"},
            {"Authorization": f"Bearer {mesh.credentials('tiny').password}"},
        ):
            refused = await http.post(url, headers=headers, json={})
            assert refused.status_code == 401
    deadline = time.monotonic() + 15
    row = None
    while row is None and time.monotonic() < deadline:
        row = await asyncio.to_thread(_ledger_row, mesh, request_id)
        await asyncio.sleep(0.2)
    assert row is not None and row["tenant"] == "acme"


def _ledger_row(mesh: Mesh, request_id: str) -> dict | None:  # type: ignore[type-arg]
    try:
        with urllib.request.urlopen(f"{mesh.child('ledger').url}/v1/ledger/requests/{request_id}") as r:
            return json.loads(r.read())  # type: ignore[no-any-return]
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return None
        raise


def test_users_from_the_config() -> None:
    """A tenant with a configured bcrypt hash gets no generated password; names are checked."""
    from services.mesh.nats_auth import CredentialsError, generate_auth, hash_password

    configured = hash_password("the tenant's own secret", cost=4)
    auth = generate_auth({"acme": None, "byo": configured})
    assert set(auth.tenants) == {"acme"}
    byo = next(u for u in auth.users if u.user == "byo")
    assert byo.password_bcrypt == configured
    assert byo.allow == {"publish": ["rmesh.req.byo"], "subscribe": ["rmesh.tokens.byo.>", "_INBOX_byo.>"]}
    services = next(u for u in auth.users if u.user == "ripplemesh")
    assert services.allow is None
    for bad in ({"a.b": None}, {"*": None}, {"ripplemesh": None}, {"x": "not-a-hash"}):
        with pytest.raises(CredentialsError):
            generate_auth(bad)
