"""job requeue bookkeeping: when a job's queue message was sent, and its outage retries

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-02 14:10:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("fine_tune_job", schema=None) as batch_op:
        batch_op.add_column(sa.Column("transient_failures", sa.Integer(), nullable=False, server_default="0"))
        batch_op.add_column(sa.Column("queued_at", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("fine_tune_job", schema=None) as batch_op:
        batch_op.drop_column("queued_at")
        batch_op.drop_column("transient_failures")
