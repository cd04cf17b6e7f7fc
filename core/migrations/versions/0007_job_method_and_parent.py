"""fine-tuning jobs name their method (supervised or dpo) and the fine-tuned model they continue, if any

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-06 23:10:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("fine_tune_job", schema=None) as batch_op:
        batch_op.add_column(sa.Column("method", sa.String(length=16), nullable=False, server_default="supervised"))
        batch_op.add_column(sa.Column("parent_model", sa.String(length=512), nullable=True))
        batch_op.add_column(sa.Column("parent_adapter_id", sa.String(length=40), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("fine_tune_job", schema=None) as batch_op:
        batch_op.drop_column("parent_adapter_id")
        batch_op.drop_column("parent_model")
        batch_op.drop_column("method")
