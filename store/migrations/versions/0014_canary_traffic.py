"""canary_traffic: each gateway's cumulative requests, errors and latency per arm of a live canary

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-06
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0014'
down_revision: str | None = '0013'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        'canary_traffic',
        # One gateway process (a new id per start), the canary's version, and the arm: canary | fleet.
        sa.Column('instance', sa.String(length=64), nullable=False),
        sa.Column('version', sa.Integer(), nullable=False),
        sa.Column('arm', sa.String(length=16), nullable=False),
        # Cumulative since the process started: a flush overwrites, so a repeated one never double-counts.
        sa.Column('requests', sa.BigInteger(), nullable=False),
        sa.Column('errors', sa.BigInteger(), nullable=False),
        sa.Column('latency_buckets', sa.JSON(), nullable=False),
        sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint('instance', 'version', 'arm'),
    )


def downgrade() -> None:
    op.drop_table('canary_traffic')
