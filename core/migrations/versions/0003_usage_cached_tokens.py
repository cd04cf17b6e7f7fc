"""usage records count prompt tokens served from the prefix cache

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-05 14:20:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("usage_record", schema=None) as batch_op:
        batch_op.add_column(sa.Column("cached_tokens", sa.Integer(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("usage_record", schema=None) as batch_op:
        batch_op.drop_column("cached_tokens")
