"""served versions: the deployer announces the weight version each serving server serves

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0004'
down_revision: str | None = '0003'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('server_rotation') as batch:
        batch.add_column(sa.Column('serving_version', sa.Integer(), nullable=True))
        batch.add_column(sa.Column('version_epoch', sa.Integer(), server_default='0', nullable=False))


def downgrade() -> None:
    with op.batch_alter_table('server_rotation') as batch:
        batch.drop_column('version_epoch')
        batch.drop_column('serving_version')
