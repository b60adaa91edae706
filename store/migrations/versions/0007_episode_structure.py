"""multi-segment episodes: the agent of each segment, the measurements of each episode

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-02
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0007'
down_revision: str | None = '0006'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column('interactions', sa.Column('agent', sa.String(length=200), nullable=True))
    op.add_column('episodes', sa.Column('metrics', sa.JSON(), nullable=True))


def downgrade() -> None:
    op.drop_column('episodes', 'metrics')
    op.drop_column('interactions', 'agent')
