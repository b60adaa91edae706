"""promotions: every move of @champion rtrl made and on what grounds (the registry's trust boundary)

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-05
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0011'
down_revision: str | None = '0010'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Empty on upgrade: the first deployer or reconciler to look adopts the alias it finds then
    # (grounds "adopted"), and from that row on an alias moved outside rtrl is refused.
    op.create_table(
        'promotions',
        sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
        sa.Column('model', sa.String(length=200), nullable=False),
        sa.Column('version', sa.Integer(), nullable=False),
        sa.Column('grounds', sa.String(length=16), nullable=False),
        sa.Column('gate_decision_id', sa.Integer(), nullable=True),
        sa.Column('actor', sa.String(length=300), nullable=False),
        sa.Column('reason', sa.Text(), nullable=False),
        sa.Column('promoted_at', sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint('id'),
    )
    op.create_index(op.f('ix_promotions_model'), 'promotions', ['model'], unique=False)
    # Which registry model a gate decision was about: v2 of another model is another checkpoint.
    op.add_column('gate_decisions', sa.Column('model', sa.String(length=200), nullable=True))


def downgrade() -> None:
    op.drop_column('gate_decisions', 'model')
    op.drop_index(op.f('ix_promotions_model'), table_name='promotions')
    op.drop_table('promotions')
