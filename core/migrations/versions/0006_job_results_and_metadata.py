"""fine-tuning jobs carry result files (their step metrics) and the client's metadata

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-06 20:10:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("fine_tune_job", schema=None) as batch_op:
        batch_op.add_column(sa.Column("result_files", sa.JSON(), nullable=False, server_default="[]"))
        batch_op.add_column(sa.Column("metadata", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("fine_tune_job", schema=None) as batch_op:
        batch_op.drop_column("metadata")
        batch_op.drop_column("result_files")
