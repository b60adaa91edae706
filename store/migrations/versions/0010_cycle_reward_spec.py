"""the reward spec each training cycle trained under: what a PARL spec's λ schedule counts

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-03
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0010'
down_revision: str | None = '0009'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# A cycle of before this revision trained under the spec of the episodes it claimed, when they are
# still there and share one spec (a failed cycle released its episodes: it stays NULL, and counts
# for no spec, as it trained nothing).
CLAIMED = "FROM episodes WHERE episodes.status = 'settled' AND episodes.used_in_cycle = cycles.id"


def upgrade() -> None:
    op.add_column('cycles', sa.Column('reward_spec', sa.String(length=120), nullable=True))
    op.execute(f"UPDATE cycles SET reward_spec = (SELECT MIN(episodes.reward_spec) {CLAIMED}) "
               f"WHERE (SELECT COUNT(DISTINCT episodes.reward_spec) {CLAIMED}) = 1")


def downgrade() -> None:
    op.drop_column('cycles', 'reward_spec')
