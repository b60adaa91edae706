"""tenant_adapters: a tenant's switch for a LoRA adapter of its own, and the line each cycle trained
(docs/lora.md, An adapter per tenant)

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-07
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0016'
down_revision: str | None = '0015'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # false on every existing tenant: until switched on, a tenant shares the global adapter as before.
    op.add_column(
        'tenants', sa.Column('adapter', sa.Boolean(), server_default=sa.text('false'), nullable=False)
    )
    # NULL on every existing cycle: they all trained the global line.
    op.add_column('cycles', sa.Column('line', sa.String(length=64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('cycles') as batch:
        batch.drop_column('line')
    with op.batch_alter_table('tenants') as batch:
        batch.drop_column('adapter')
