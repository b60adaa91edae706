"""version history: every weight version a serving server was announced on, and when last

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0005'
down_revision: str | None = '0004'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        'version_history',
        sa.Column('version', sa.Integer(), nullable=False),
        sa.Column('first_served_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('last_served_at', sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint('version'),
    )


def downgrade() -> None:
    op.drop_table('version_history')
