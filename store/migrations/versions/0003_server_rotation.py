"""server rotation: which vLLM servers the gateways route users to (the deployer drains one before a swap)

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0003'
down_revision: str | None = '0002'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('server_rotation',
    sa.Column('url', sa.String(length=500), nullable=False),
    sa.Column('in_rotation', sa.Boolean(), nullable=False),
    sa.Column('reason', sa.String(length=500), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('url')
    )


def downgrade() -> None:
    op.drop_table('server_rotation')
