"""fine-tuning jobs keep epoch checkpoints (servable adapters that also resume training)

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-06 19:40:00
"""

from __future__ import annotations

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "fine_tuning_checkpoint",
        sa.Column("id", sqlmodel.sql.sqltypes.AutoString(length=40), nullable=False),
        sa.Column("job_id", sqlmodel.sql.sqltypes.AutoString(length=40), nullable=False),
        sa.Column("tenant_id", sqlmodel.sql.sqltypes.AutoString(length=40), nullable=False),
        sa.Column("adapter_id", sqlmodel.sql.sqltypes.AutoString(length=40), nullable=False),
        sa.Column("step_number", sa.Integer(), nullable=False),
        sa.Column("epoch", sa.Integer(), nullable=False),
        sa.Column("metrics", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["fine_tune_job.id"]),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("fine_tuning_checkpoint", schema=None) as batch_op:
        batch_op.create_index("ix_checkpoint_job_step", ["job_id", "step_number"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("fine_tuning_checkpoint", schema=None) as batch_op:
        batch_op.drop_index("ix_checkpoint_job_step")
    op.drop_table("fine_tuning_checkpoint")
