"""Whose a request is and how urgent, as the scheduler sees it (set by the platform API per request)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum


class Priority(IntEnum):
    """Scheduling classes, most urgent first. ``BATCH`` is OpenAI's ``service_tier: "flex"``."""

    INTERACTIVE = 0
    BATCH = 1


@dataclass(frozen=True)
class Tenancy:
    """A request's tenant, its weight among busy tenants, and its class. Callers that do not come through the
    platform API are all the one tenant ``""`` (:data:`DIRECT`)."""

    tenant: str = ""
    weight: float = 1.0
    priority: Priority = Priority.INTERACTIVE


DIRECT = Tenancy()


@dataclass
class TenantLoad:
    """One tenant's share of a server at a moment: its sequences queued and running, and the KV pages they
    hold (a prefix page shared by several sequences counts for each), and its scheduling weight."""

    waiting: int = 0
    running: int = 0
    kv_pages: int = 0
    weight: float = 1.0

    def add(self, other: TenantLoad) -> None:
        self.waiting += other.waiting
        self.running += other.running
        self.kv_pages += other.kv_pages
