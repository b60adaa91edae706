"""canaries: the live canary's runs, their decisions and stop requests (one running at a time)

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-05
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0013'
down_revision: str | None = '0012'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        'canaries',
        sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
        sa.Column('model', sa.String(length=200), nullable=False),
        sa.Column('challenger_version', sa.Integer(), nullable=False),
        sa.Column('champion_version', sa.Integer(), nullable=False),
        sa.Column('server', sa.String(length=500), nullable=False),
        sa.Column('share', sa.Float(), nullable=False),
        sa.Column('cycle_id', sa.Integer(), nullable=True),
        sa.Column('state', sa.String(length=16), nullable=False),
        sa.Column('reason', sa.Text(), nullable=False),
        sa.Column('decision', sa.JSON(), nullable=True),
        sa.Column('started_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('ended_at', sa.DateTime(timezone=True), nullable=True),
        sa.Column('stop_requested_at', sa.DateTime(timezone=True), nullable=True),
        sa.Column('stop_requested_by', sa.String(length=300), nullable=True),
        # 1 while running, NULL once ended: at most one running canary, enforced by the database.
        sa.Column('running_slot', sa.Integer(), nullable=True),
        sa.PrimaryKeyConstraint('id'),
        sa.UniqueConstraint('running_slot'),
    )


def downgrade() -> None:
    op.drop_table('canaries')
