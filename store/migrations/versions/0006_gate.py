"""eval gate: held-out buckets of episodes and the gate's decision records

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0006'
down_revision: str | None = '0005'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column('episodes', sa.Column('eval_bucket', sa.Integer(), nullable=True))
    op.create_table(
        'gate_decisions',
        sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
        sa.Column('challenger_version', sa.Integer(), nullable=False),
        sa.Column('champion_version', sa.Integer(), nullable=False),
        sa.Column('passed', sa.Boolean(), nullable=False),
        sa.Column('reason', sa.Text(), nullable=False),
        sa.Column('record', sa.JSON(), nullable=False),
        sa.Column('decided_at', sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint('id'),
    )
    op.create_index('ix_gate_decisions_challenger_version', 'gate_decisions', ['challenger_version'])


def downgrade() -> None:
    op.drop_index('ix_gate_decisions_challenger_version', table_name='gate_decisions')
    op.drop_table('gate_decisions')
    op.drop_column('episodes', 'eval_bucket')
