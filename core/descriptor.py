"""What the control plane tells an inference server about an adapter, and where adapters are stored.

The server trusts only this descriptor (sent under the internal token): it never reads the database,
so everything it needs to fetch and verify an adapter is here.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_MANIFEST = "manifest.json"


def adapter_prefix(tenant_id: str, adapter_id: str) -> str:
    """Object-store prefix of an adapter's files (ends with '/')."""
    return f"tenants/{tenant_id}/adapters/{adapter_id}/"


def file_key(tenant_id: str, file_id: str) -> str:
    """Object-store key of an uploaded training file."""
    return f"tenants/{tenant_id}/files/{file_id}"


class AdapterDescriptor(BaseModel):
    """Enough to fetch, verify and place an adapter: where it is and what its bytes hash to."""

    id: str = Field(description="Adapter id (adapter-...): the server's cache key.")
    name: str = Field(description="The public model name clients use (ft:...).")
    base_model: str
    storage_prefix: str = Field(description="Object-store prefix holding the PEFT files.")
    sha256: str = Field(description="sha256 of adapter_model.safetensors.")
    config_sha256: str = Field(description="sha256 of adapter_config.json.")
    rank: int = Field(ge=1)
    base_fingerprint: str | None = Field(
        default=None, max_length=80, description="Fingerprint of the base it was made on (core.base_fingerprint)."
    )

    @property
    def weights_key(self) -> str:
        return self.storage_prefix + ADAPTER_WEIGHTS

    @property
    def config_key(self) -> str:
        return self.storage_prefix + ADAPTER_CONFIG
