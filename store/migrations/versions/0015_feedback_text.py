"""feedback_text: the text a correction (or an edit) carries, for the trainer's hindsight hints

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-07
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0015'
down_revision: str | None = '0014'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # NULL on every existing row: feedback before this revision carried no text.
    op.add_column('feedback', sa.Column('text', sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('feedback') as batch:
        batch.drop_column('text')
