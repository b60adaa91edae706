"""deploy state in the store: recorded weight digests per version, the holders of the deploy locks

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-03
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0008'
down_revision: str | None = '0007'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        'recorded_digests',
        sa.Column('model', sa.String(length=200), nullable=False),
        sa.Column('version', sa.Integer(), nullable=False),
        sa.Column('digests', sa.JSON(), nullable=False),
        sa.Column('recorded_at', sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint('model', 'version'),
    )
    op.create_table(
        'deploy_locks',
        sa.Column('name', sa.String(length=64), nullable=False),
        sa.Column('holder', sa.String(length=300), nullable=False),
        sa.Column('purpose', sa.String(length=500), nullable=False),
        sa.Column('acquired_at', sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint('name'),
    )


def downgrade() -> None:
    op.drop_table('deploy_locks')
    op.drop_table('recorded_digests')
