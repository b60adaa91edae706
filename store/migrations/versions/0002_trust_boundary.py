"""trust boundary: tenants, API keys, redacted segments, dead-letter replays, labeler progress

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0002'
down_revision: str | None = '0001'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('tenants',
    sa.Column('tenant', sa.String(length=64), nullable=False),
    sa.Column('trains', sa.Boolean(), nullable=False),
    sa.Column('train_redacted', sa.Boolean(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('tenant')
    )
    op.create_table('api_keys',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('key_hash', sa.String(length=64), nullable=False),
    sa.Column('prefix', sa.String(length=32), nullable=False),
    sa.Column('role', sa.String(length=16), nullable=False),
    sa.Column('tenant', sa.String(length=64), nullable=True),
    sa.Column('name', sa.String(length=200), nullable=False),
    sa.Column('rate_per_s', sa.Float(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('revoked_at', sa.DateTime(timezone=True), nullable=True),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('key_hash')
    )
    op.create_table('labeler_progress',
    sa.Column('topic', sa.String(length=249), nullable=False),
    sa.Column('partition', sa.Integer(), nullable=False),
    sa.Column('offset', sa.BigInteger(), nullable=False),
    sa.Column('mode', sa.String(length=8), nullable=False),
    sa.Column('attempts', sa.Integer(), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('topic', 'partition')
    )
    with op.batch_alter_table('interactions') as batch:
        batch.add_column(sa.Column('redacted', sa.JSON(), nullable=True))
    with op.batch_alter_table('dead_letters') as batch:
        batch.add_column(sa.Column('replayed_at', sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('dead_letters') as batch:
        batch.drop_column('replayed_at')
    with op.batch_alter_table('interactions') as batch:
        batch.drop_column('redacted')
    op.drop_table('labeler_progress')
    op.drop_table('api_keys')
    op.drop_table('tenants')
