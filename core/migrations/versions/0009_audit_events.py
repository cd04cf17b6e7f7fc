"""the audit trail: every adapter load, verification, refusal, eviction and deletion

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-07 05:40:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "audit_event",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("at", sa.Float(), nullable=False),
        sa.Column("action", sa.String(length=16), nullable=False),
        sa.Column("tenant_id", sa.String(length=40), nullable=True),
        sa.Column("adapter_id", sa.String(length=40), nullable=True),
        sa.Column("adapter_name", sa.String(length=512), nullable=True),
        sa.Column("replica", sa.String(length=255), nullable=True),
        sa.Column("sha256", sa.String(length=64), nullable=True),
        sa.Column("tier", sa.String(length=16), nullable=True),
        sa.Column("reason", sa.String(length=64), nullable=True),
        sa.Column("cause", sa.String(length=128), nullable=True),
        sa.Column("detail", sa.String(length=1000), nullable=True),
        sa.Column("created_at", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("audit_event", schema=None) as batch_op:
        batch_op.create_index("ix_audit_tenant_id", ["tenant_id", "id"], unique=False)
        batch_op.create_index("ix_audit_adapter_id", ["adapter_id", "id"], unique=False)
        batch_op.create_index("ix_audit_at", ["at"], unique=False)


def downgrade() -> None:
    op.drop_table("audit_event")
