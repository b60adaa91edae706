"""failed cycles per episode, and the quarantine of an episode that failed too many

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-05
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0012'
down_revision: str | None = '0011'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Existing episodes start with no failure counted: the failed cycles before this revision did
    # not record which episodes they had claimed once they released them.
    op.add_column('episodes', sa.Column('failed_cycles', sa.Integer(), server_default='0', nullable=False))
    op.add_column('episodes', sa.Column('quarantined_at', sa.DateTime(timezone=True), nullable=True))
    op.add_column('episodes', sa.Column('quarantine_reason', sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('episodes') as batch:
        batch.drop_column('quarantine_reason')
        batch.drop_column('quarantined_at')
        batch.drop_column('failed_cycles')
