"""The tenants' quotas shared by admission replicas: each tenant's `TenantUsage` (bucket levels,
concurrency leases) is one entry of the ADMISSION_QUOTAS KV bucket, charged with compare-and-set
(read, charge, update at the revision read; another replica's write in between means read
again). A tenant without a concurrency cap is charged to this replica's lease of its buckets: a
slice taken in advance, spent request by request without a shared write, topped up before it
runs out and given back once the tenant goes quiet. What to charge is the policy's
(services/admission/policy/quota.py); this is the I/O around it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

import msgspec
from nats.js.errors import KeyDeletedError, KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue
from prometheus_client import Counter

from services.admission.policy import (
    AdmissionLimits,
    AdmissionRequest,
    QuotaLease,
    Reject,
    TenantQuota,
    TenantUsage,
    charge_quota,
    leasable,
    lease_slice,
    release_quota,
    return_lease,
    take_lease,
)

log = logging.getLogger(__name__)

QUOTA_CONFLICTS = Counter(
    "ripplemesh_admission_quota_conflicts_total",
    "Compare-and-set conflicts on the shared quota state (another replica wrote first).",
)
CAS_ATTEMPTS = 8
# A replica leases this many seconds of a tenant's rates at a time (see QuotaLease), and gives
# back what it holds once the tenant has sent it nothing for LEASE_IDLE_S.
LEASE_S = 0.2
LEASE_IDLE_S = 1.0

_usage_decoder = msgspec.json.Decoder(TenantUsage)
_encoder = msgspec.json.Encoder()

Spawn = Callable[[Coroutine[Any, Any, None], str], object]


class SharedQuota:
    def __init__(
        self, kv: KeyValue, quotas: dict[str, TenantQuota], limits: AdmissionLimits, spawn: Spawn
    ) -> None:
        self._kv = kv
        self._quotas = quotas
        self._limits = limits
        self._spawn = spawn
        # tenant -> (revision, value) of its quota entry as last read or written.
        self._usage: dict[str, tuple[int, bytes]] = {}
        # One charge at a time per tenant in this replica: its own handlers never race each other
        # for the entry (compare-and-set settles the races between replicas).
        self._tenant_locks: dict[str, asyncio.Lock] = {}
        # tenant -> this replica's lease of its buckets (tenants without a concurrency cap).
        self._leases: dict[str, QuotaLease] = {}
        self._topping_up: set[str] = set()

    @property
    def tenants_tracked(self) -> int:
        return len(self._usage)

    # ------------------------------------------------------------ charging

    async def charge(self, admission: AdmissionRequest, quota: TenantQuota, now: float) -> Reject | None:
        """The tenant's shared buckets and leases, charged with compare-and-set; for a tenant
        without a concurrency cap, charged to this replica's lease of its buckets."""
        tenant = admission.tenant
        if leasable(quota):
            lease = self._leases.get(tenant)
            if lease is None or not lease.spend(admission, now):
                async with self._lock(tenant):
                    lease = self._leases.setdefault(tenant, QuotaLease())
                    if not lease.spend(admission, now):
                        rejected = await self._take_lease(admission, quota, now)
                        if rejected is not None:
                            return rejected
                        spent = lease.spend(admission, now)
                        assert spent, "a lease taken for a request holds what it asks"
            if lease.running_low(lease_slice(quota, LEASE_S)) and tenant not in self._topping_up:
                self._topping_up.add(tenant)
                self._spawn(self._top_up(admission, quota, now), f"lease-{tenant}")
            return None
        async with self._lock(tenant):
            for _ in range(CAS_ATTEMPTS):
                revision, usage = await self._current(tenant)
                rejected = charge_quota(usage, quota, admission, self._limits, now)
                if rejected is not None:
                    return rejected
                if await self._write(tenant, revision, usage):
                    return None
        return _contended(tenant)

    async def give_back(self, admission: AdmissionRequest) -> None:
        """A request that was charged and then not admitted gives its concurrency lease back."""
        quota = self._quotas.get(admission.tenant)
        if quota is None or quota.max_concurrency is None:
            return
        try:
            await self.release(admission.tenant, admission.request_id)
        except Exception as exc:  # the lease lapses instead
            log.warning("lease not released", extra={"request_id": admission.request_id, "error": repr(exc)})

    async def release(self, tenant: str, request_id: str) -> None:
        """Give a request's concurrency lease back (compare-and-set; nothing when it holds none)."""
        async with self._lock(tenant):
            for _ in range(CAS_ATTEMPTS):
                cached = self._usage.get(tenant)
                revision, usage = await self._current(tenant)
                if not release_quota(usage, request_id):
                    if cached is None:
                        return
                    self._usage.pop(tenant, None)  # our copy may be stale: look again
                    continue
                if await self._write(tenant, revision, usage):
                    return

    # ------------------------------------------------------------ leases

    async def _take_lease(self, admission: AdmissionRequest, quota: TenantQuota, now: float) -> Reject | None:
        """Take a slice of the tenant's shared buckets into its lease (compare-and-set, locked):
        at least what `admission` asks, or the quota's rejection."""
        tenant = admission.tenant
        want = lease_slice(quota, LEASE_S)
        for _ in range(CAS_ATTEMPTS):
            revision, usage = await self._current(tenant)
            taken = take_lease(usage, quota, admission, want, now)
            if isinstance(taken, Reject):
                return taken
            if await self._write(tenant, revision, usage):
                self._leases.setdefault(tenant, QuotaLease()).add(taken)
                return None
        return _contended(tenant)

    async def _top_up(self, admission: AdmissionRequest, quota: TenantQuota, now: float) -> None:
        """In the background, before the lease runs out: another slice (nothing if none is left),
        taken as of `now`, the time the request that ran it low was charged at. Not the clock's:
        a backlog charged as it arrived (back-dated) would find the buckets' time moved past
        its next requests', and their refill gone."""
        try:
            async with self._lock(admission.tenant):
                lease = self._leases.get(admission.tenant)
                if lease is not None and lease.running_low(lease_slice(quota, LEASE_S)):
                    await self._take_lease(admission, quota, now)
        except Exception as exc:  # the next request takes its slice on its own path
            log.warning("quota lease not topped up", extra={"tenant": admission.tenant, "error": repr(exc)})
        finally:
            self._topping_up.discard(admission.tenant)

    async def return_lease(self, tenant: str) -> None:
        """Give the lease's unspent remainder back to the tenant's shared buckets."""
        quota = self._quotas.get(tenant)
        async with self._lock(tenant):
            lease = self._leases.pop(tenant, None)
            if lease is None or quota is None or not any(lease.amounts.values()):
                return
            amounts = lease.take_all()
            for _ in range(CAS_ATTEMPTS):
                revision, usage = await self._current(tenant)
                return_lease(usage, quota, amounts, time.time())
                if await self._write(tenant, revision, usage):
                    return

    async def return_all(self, timeout_s: float = 2.0) -> None:
        """On shutdown: every lease back, each within `timeout_s`."""
        for tenant in list(self._leases):
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.return_lease(tenant), timeout=timeout_s)

    async def lease_loop(self) -> None:
        """Leases of tenants that went quiet go back, so other replicas can use them."""
        while True:
            await asyncio.sleep(LEASE_IDLE_S / 2)
            now = time.time()
            for tenant, lease in list(self._leases.items()):
                if now - lease.spent_at >= LEASE_IDLE_S and tenant not in self._topping_up:
                    try:
                        await self.return_lease(tenant)
                    except Exception as exc:  # kept as consumed: the quota errs on the strict side
                        log.warning("quota lease not returned", extra={"tenant": tenant, "error": repr(exc)})

    # ------------------------------------------------------------ the KV entry

    def _lock(self, tenant: str) -> asyncio.Lock:
        lock = self._tenant_locks.get(tenant)
        if lock is None:
            lock = self._tenant_locks[tenant] = asyncio.Lock()
        return lock

    async def _current(self, tenant: str) -> tuple[int | None, TenantUsage]:
        """The tenant's usage as last read or written here (else read now), with its revision."""
        cached = self._usage.get(tenant)
        revision, value = cached if cached is not None else await self._read(tenant)
        return revision, self._decoded(value)

    async def _read(self, tenant: str) -> tuple[int | None, bytes | None]:
        try:
            entry = await self._kv.get(tenant)
        except (KeyNotFoundError, KeyDeletedError):
            return None, None
        if entry.value is None or entry.revision is None:
            return None, None
        return entry.revision, entry.value

    async def _write(self, tenant: str, revision: int | None, usage: TenantUsage) -> bool:
        """Compare-and-set: False when another replica wrote since `revision`."""
        value = _encoder.encode(usage)
        try:
            if revision is None:
                written = await self._kv.create(tenant, value)
            else:
                written = await self._kv.update(tenant, value, last=revision)
        except KeyWrongLastSequenceError:
            QUOTA_CONFLICTS.inc()
            self._usage.pop(tenant, None)
            return False
        self._usage[tenant] = (written, value)
        return True

    @staticmethod
    def _decoded(value: bytes | None) -> TenantUsage:
        if value is None:
            return TenantUsage()
        try:
            return _usage_decoder.decode(value)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("bad quota state replaced", extra={"error": str(exc)})
            return TenantUsage()


def _contended(tenant: str) -> Reject:
    return Reject("capacity", f"tenant {tenant!r}'s quota state is contended; try again", 0.5)
