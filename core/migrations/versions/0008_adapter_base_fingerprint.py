"""adapters keep the fingerprint of the base model they were made on

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-07 05:10:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("adapter", schema=None) as batch_op:
        batch_op.add_column(sa.Column("base_fingerprint", sa.String(length=80), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("adapter", schema=None) as batch_op:
        batch_op.drop_column("base_fingerprint")
