"""NATS users for the mesh: one for the services, one per tenant, confined to its own subjects.

A tenant's user may publish only to ``rmesh.req.<tenant>`` (submissions, cancels, replay
requests) and subscribe only to ``rmesh.tokens.<tenant>.>`` and its own inbox prefix
``_INBOX_<tenant>`` (where the acks of its own publishes come back). It gets no JetStream API
at all: a client reads its tokens through a core subscription, and when it misses some (a
reconnect to another node) it asks the ingress, on its own request subject, to publish them
again (`ReplayTokens`). The services share one user with every permission. Subscribers
(ripplemesh/subscriber.py) get one of their own: they may read the lifecycle events through
their own durable consumers (``sub-*`` on LIFECYCLE), dead-letter to ``rmesh.dlq.LIFECYCLE`` and
put tenant throttles (the control subject admission honours), and nothing of any tenant's
requests or token streams.

The server stores only bcrypt hashes; the clear passwords live in credential files (mode 0600)
that `ripplemesh up` writes under ``<data_dir>/credentials/``. A tenant may instead bring its own
password, configured as a bcrypt hash (`TenantConfig.nats_password_bcrypt`); then no file is
written for it.
"""

from __future__ import annotations

import os
import re
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from schemas.subjects import LEDGER_CONSUMER, request_subject, tenant_inbox_prefix, tenant_tokens_filter
from services.mesh.config import MeshConfig

SERVICE_USER = "ripplemesh"
ROUTE_USER = "ripplemesh-route"
SUBSCRIBER_USER = "ripplemesh-subscribers"
SUBSCRIBER_INBOX = "_INBOX_subscribers"
# Generated secrets carry 256 bits of entropy, so bcrypt's work factor protects nothing that
# brute force could reach; a low cost keeps each connect (the server checks the hash) cheap.
GENERATED_BCRYPT_COST = 6
_SUBJECT_TOKEN = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
_BCRYPT = re.compile(r"^\$2[abxy]\$\d{2}\$[./A-Za-z0-9]{53}$")


class CredentialsError(ValueError):
    pass


class NatsCredentials(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What one client connects with: a user, its clear password, and its inbox prefix."""

    user: str
    password: str
    # The tenant this user acts for; None for the services' user.
    tenant: str | None = None
    inbox_prefix: str = "_INBOX"
    # Where the mesh's NATS listens (written by `ripplemesh up`), so a client needs only this file.
    servers: list[str] = []

    def connect_options(self) -> dict[str, Any]:
        """Keyword arguments for `nats.connect`."""
        return {"user": self.user, "password": self.password, "inbox_prefix": self.inbox_prefix}

    def __repr__(self) -> str:  # never print a password by accident
        return f"NatsCredentials(user={self.user!r}, tenant={self.tenant!r})"


@dataclass(frozen=True)
class NatsUser:
    """One entry of the server's ``authorization.users``: never a clear password."""

    user: str
    password_bcrypt: str
    # None: every subject (the services); else {"publish": [...], "subscribe": [...]} allow-lists
    # (and "deny_publish": exceptions to the publish list).
    allow: dict[str, list[str]] | None = None

    def server_entry(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"user": self.user, "password": self.password_bcrypt}
        if self.allow is not None:
            publish: dict[str, list[str]] = {"allow": self.allow["publish"]}
            if self.allow.get("deny_publish"):
                publish["deny"] = self.allow["deny_publish"]
            entry["permissions"] = {"publish": publish, "subscribe": {"allow": self.allow["subscribe"]}}
        return entry


@dataclass
class NatsAuth:
    """Everything a NATS server (or cluster) of the mesh needs, and what its clients connect with."""

    users: list[NatsUser]
    service: NatsCredentials
    subscribers: NatsCredentials | None = None
    # Clear credentials of each tenant whose password was generated here.
    tenants: dict[str, NatsCredentials] = field(default_factory=dict)
    # Cluster routes authenticate with this user (a route is trusted with every subject).
    route: NatsCredentials = field(
        default_factory=lambda: NatsCredentials(user=ROUTE_USER, password=_secret())
    )
    route_password_bcrypt: str = ""

    def __post_init__(self) -> None:
        if not self.route_password_bcrypt:
            self.route_password_bcrypt = hash_password(self.route.password)

    def credentials(self, tenant: str) -> NatsCredentials:
        found = self.tenants.get(tenant)
        if found is None:
            raise CredentialsError(
                f"no clear credentials for tenant {tenant!r}: unknown, or its password is configured "
                "as a bcrypt hash (the tenant holds the password)"
            )
        return found

    def write(self, directory: Path, servers: list[str] | None = None) -> dict[str, Path]:
        """Write each clear credential to ``<directory>/<name>.json`` (0600); return the paths
        by name ("services", or the tenant's)."""
        directory.mkdir(parents=True, exist_ok=True)
        directory.chmod(0o700)
        files = {"services": (self.service, directory / "services.json")}
        if self.subscribers is not None:
            files["subscribers"] = (self.subscribers, directory / "subscribers.json")
        for tenant, creds in self.tenants.items():
            files[tenant] = (creds, tenant_credentials_path(directory, tenant))
        return {
            name: save_credentials(msgspec.structs.replace(creds, servers=servers or []), path)
            for name, (creds, path) in files.items()
        }


def tenant_credentials_path(directory: Path, tenant: str) -> Path:
    return directory / f"tenant-{tenant}.json"


def tenant_permissions(tenant: str) -> dict[str, list[str]]:
    """Publish and subscribe allow-lists of a tenant's user (everything else is denied)."""
    return {
        "publish": [request_subject(tenant)],
        "subscribe": [tenant_tokens_filter(tenant), f"{tenant_inbox_prefix(tenant)}.>"],
    }


def subscriber_permissions(read_tokens_of: tuple[str, ...] = ()) -> dict[str, list[str]]:
    """The subscribers' user: consumers on LIFECYCLE (create, fetch, ack) but not the mesh's own
    (the ledger's), dead letters, the TENANT_THROTTLES control bucket, replies to its own
    inbox; no tenant subject, except the token streams of the tenants in `read_tokens_of`
    (their config's `subscribers_read_tokens`). (NATS matches whole subject tokens, so "consumers named
    sub-*" cannot be said; the ledger's durable is denied by name instead.)"""
    api = "$JS.API"
    ledger = LEDGER_CONSUMER.durable
    return {
        "publish": [
            f"{api}.INFO",
            f"{api}.STREAM.INFO.LIFECYCLE",
            f"{api}.CONSUMER.CREATE.LIFECYCLE.>",
            f"{api}.CONSUMER.DURABLE.CREATE.LIFECYCLE.*",
            f"{api}.CONSUMER.INFO.LIFECYCLE.*",
            f"{api}.CONSUMER.MSG.NEXT.LIFECYCLE.*",
            "$JS.ACK.LIFECYCLE.>",
            "rmesh.dlq.LIFECYCLE",
            f"{api}.STREAM.INFO.KV_TENANT_THROTTLES",
            f"{api}.DIRECT.GET.KV_TENANT_THROTTLES.>",
            "$KV.TENANT_THROTTLES.>",
        ],
        "subscribe": [
            f"{SUBSCRIBER_INBOX}.>",
            "$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.LIFECYCLE.*",
            *(tenant_tokens_filter(tenant) for tenant in read_tokens_of),
        ],
        "deny_publish": [
            f"{api}.CONSUMER.CREATE.LIFECYCLE.{ledger}",
            f"{api}.CONSUMER.CREATE.LIFECYCLE.{ledger}.>",
            f"{api}.CONSUMER.DURABLE.CREATE.LIFECYCLE.{ledger}",
            f"{api}.CONSUMER.MSG.NEXT.LIFECYCLE.{ledger}",
            f"$JS.ACK.LIFECYCLE.{ledger}.>",
        ],
    }


def tenant_credentials(tenant: str, password: str) -> NatsCredentials:
    return NatsCredentials(
        user=tenant, password=password, tenant=tenant, inbox_prefix=tenant_inbox_prefix(tenant)
    )


def hash_password(password: str, cost: int = GENERATED_BCRYPT_COST) -> str:
    import bcrypt

    return bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds=cost)).decode()


def is_bcrypt_hash(value: str) -> bool:
    return bool(_BCRYPT.match(value))


def generate_auth(
    tenants: dict[str, str | None], subscribers_read_tokens_of: tuple[str, ...] = ()
) -> NatsAuth:
    """Users for the services and for each tenant (name -> its configured bcrypt hash or None).

    A tenant without a configured hash gets a fresh random password. The subscribers' user may
    read the token streams of the tenants in `subscribers_read_tokens_of`, and no other's.
    """
    service = NatsCredentials(user=SERVICE_USER, password=_secret())
    subscribers = NatsCredentials(user=SUBSCRIBER_USER, password=_secret(), inbox_prefix=SUBSCRIBER_INBOX)
    users = [
        NatsUser(SERVICE_USER, hash_password(service.password)),
        NatsUser(
            SUBSCRIBER_USER,
            hash_password(subscribers.password),
            subscriber_permissions(tuple(sorted(subscribers_read_tokens_of))),
        ),
    ]
    clear: dict[str, NatsCredentials] = {}
    for tenant, configured_hash in sorted(tenants.items()):
        if not _SUBJECT_TOKEN.match(tenant):
            raise CredentialsError(f"tenant name {tenant!r} must be letters, digits, '_' or '-'")
        if tenant in (SERVICE_USER, ROUTE_USER, SUBSCRIBER_USER):
            raise CredentialsError(f"tenant name {tenant!r} is reserved for the mesh's own NATS users")
        if configured_hash is not None:
            if not is_bcrypt_hash(configured_hash):
                raise CredentialsError(f"tenant {tenant!r}: nats_password_bcrypt is not a bcrypt hash")
            digest = configured_hash
        else:
            creds = tenant_credentials(tenant, _secret())
            clear[tenant] = creds
            digest = hash_password(creds.password)
        users.append(NatsUser(tenant, digest, tenant_permissions(tenant)))
    return NatsAuth(users=users, service=service, subscribers=subscribers, tenants=clear)


def save_credentials(creds: NatsCredentials, path: Path) -> Path:
    """Write credentials readable by their owner only."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(msgspec.json.format(msgspec.json.encode(creds)) + b"\n")
    path.chmod(0o600)
    return path


def load_credentials(path: str | Path) -> NatsCredentials:
    source = Path(path)
    try:
        return msgspec.json.decode(source.read_bytes(), type=NatsCredentials)
    except FileNotFoundError as exc:
        raise CredentialsError(f"credentials file not found: {source}") from exc
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise CredentialsError(f"{source}: not a ripplemesh credentials file: {exc}") from exc


def _secret() -> str:
    return secrets.token_urlsafe(32)


def auth_for_config(config: MeshConfig) -> NatsAuth:
    """Users for the services and every tenant of a mesh configuration."""
    return generate_auth(
        {name: t.nats_password_bcrypt for name, t in config.tenants.items()},
        tuple(name for name, t in config.tenants.items() if t.subscribers_read_tokens),
    )
