"""an index of unjoined feedback that names an episode, for the window pass's join of stranded feedback

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-02
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0009'
down_revision: str | None = '0008'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

NAMED_UNJOINED = sa.text('joined_episode_id IS NULL AND episode_id IS NOT NULL')


def upgrade() -> None:
    op.create_index('ix_feedback_named_unjoined', 'feedback', ['ingested_at'],
                    postgresql_where=NAMED_UNJOINED, sqlite_where=NAMED_UNJOINED)


def downgrade() -> None:
    op.drop_index('ix_feedback_named_unjoined', table_name='feedback')
