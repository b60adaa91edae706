"""initial schema

Revision ID: 0001
Revises:
Create Date: 2026-11-30
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0001'
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('cycles',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('owner', sa.String(length=200), nullable=False),
    sa.Column('lease_expires_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('champion_version', sa.String(length=200), nullable=False),
    sa.Column('challenger_version', sa.String(length=200), nullable=True),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('episode_ids', sa.JSON(), nullable=True),
    sa.Column('metrics', sa.JSON(), nullable=True),
    sa.Column('error', sa.Text(), nullable=True),
    sa.Column('active_slot', sa.Integer(), nullable=True),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('active_slot')
    )
    op.create_table('dead_letters',
    sa.Column('event_id', sa.String(length=200), nullable=False),
    sa.Column('source', sa.String(length=300), nullable=False),
    sa.Column('original_event_id', sa.String(length=200), nullable=True),
    sa.Column('reason', sa.Text(), nullable=False),
    sa.Column('payload', sa.LargeBinary(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('source_topic', sa.String(length=249), nullable=True),
    sa.Column('source_partition', sa.Integer(), nullable=True),
    sa.Column('source_offset', sa.BigInteger(), nullable=True),
    sa.PrimaryKeyConstraint('event_id')
    )
    op.create_index('ix_dead_letters_source', 'dead_letters', ['source_topic', 'source_partition', 'source_offset'], unique=False)

    op.create_table('episodes',
    sa.Column('episode_id', sa.String(length=200), nullable=False),
    sa.Column('tenant', sa.String(length=200), nullable=False),
    sa.Column('policy_version', sa.String(length=200), nullable=False),
    sa.Column('policy_number', sa.Integer(), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('first_event_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('last_event_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('settled_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('settle_reason', sa.String(length=32), nullable=True),
    sa.Column('reward', sa.Float(), nullable=True),
    sa.Column('reward_components', sa.JSON(), nullable=True),
    sa.Column('reward_spec', sa.String(length=120), nullable=True),
    sa.Column('used_in_cycle', sa.Integer(), nullable=True),
    sa.PrimaryKeyConstraint('episode_id')
    )
    op.create_index('ix_episodes_open', 'episodes', ['status', 'last_event_at'], unique=False)
    op.create_index('ix_episodes_trainable', 'episodes', ['status', 'used_in_cycle', 'policy_number', 'first_event_at'], unique=False)

    op.create_table('feedback',
    sa.Column('event_id', sa.String(length=200), nullable=False),
    sa.Column('request_id', sa.String(length=200), nullable=False),
    sa.Column('episode_id', sa.String(length=200), nullable=True),
    sa.Column('tenant', sa.String(length=200), nullable=False),
    sa.Column('kind', sa.String(length=32), nullable=False),
    sa.Column('value', sa.Float(), nullable=False),
    sa.Column('joined_episode_id', sa.String(length=200), nullable=True),
    sa.Column('late', sa.Boolean(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('ingested_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('source_topic', sa.String(length=249), nullable=False),
    sa.Column('source_partition', sa.Integer(), nullable=False),
    sa.Column('source_offset', sa.BigInteger(), nullable=False),
    sa.PrimaryKeyConstraint('event_id')
    )
    op.create_index('ix_feedback_episode_id', 'feedback', ['episode_id'], unique=False)
    op.create_index('ix_feedback_joined_episode_id', 'feedback', ['joined_episode_id'], unique=False)
    op.create_index('ix_feedback_request_id', 'feedback', ['request_id'], unique=False)
    op.create_index('ix_feedback_source', 'feedback', ['source_topic', 'source_partition', 'source_offset'], unique=False)

    op.create_table('interactions',
    sa.Column('event_id', sa.String(length=200), nullable=False),
    sa.Column('request_id', sa.String(length=200), nullable=False),
    sa.Column('episode_id', sa.String(length=200), nullable=False),
    sa.Column('segment_index', sa.Integer(), nullable=False),
    sa.Column('tenant', sa.String(length=200), nullable=False),
    sa.Column('session_id', sa.String(length=200), nullable=True),
    sa.Column('model', sa.String(length=200), nullable=False),
    sa.Column('policy_version', sa.String(length=200), nullable=False),
    sa.Column('policy_number', sa.Integer(), nullable=False),
    sa.Column('prompt', sa.Text(), nullable=False),
    sa.Column('prompt_token_ids', sa.JSON(), nullable=False),
    sa.Column('completion', sa.Text(), nullable=False),
    sa.Column('completion_token_ids', sa.JSON(), nullable=False),
    sa.Column('completion_logprobs', sa.JSON(), nullable=False),
    sa.Column('finish_reason', sa.String(length=32), nullable=True),
    sa.Column('sampling', sa.JSON(), nullable=False),
    sa.Column('role', sa.String(length=32), nullable=False),
    sa.Column('trainable', sa.Boolean(), nullable=False),
    sa.Column('late', sa.Boolean(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('ingested_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('source_topic', sa.String(length=249), nullable=False),
    sa.Column('source_partition', sa.Integer(), nullable=False),
    sa.Column('source_offset', sa.BigInteger(), nullable=False),
    sa.PrimaryKeyConstraint('event_id')
    )
    op.create_index('ix_interactions_request_id', 'interactions', ['request_id'], unique=False)
    op.create_index('ix_interactions_source', 'interactions', ['source_topic', 'source_partition', 'source_offset'], unique=False)
    op.create_index('uq_interactions_episode_segment', 'interactions', ['episode_id', 'segment_index'], unique=True)



def downgrade() -> None:
    op.drop_index('uq_interactions_episode_segment', table_name='interactions')
    op.drop_index('ix_interactions_source', table_name='interactions')
    op.drop_index('ix_interactions_request_id', table_name='interactions')

    op.drop_table('interactions')
    op.drop_index('ix_feedback_source', table_name='feedback')
    op.drop_index('ix_feedback_request_id', table_name='feedback')
    op.drop_index('ix_feedback_joined_episode_id', table_name='feedback')
    op.drop_index('ix_feedback_episode_id', table_name='feedback')

    op.drop_table('feedback')
    op.drop_index('ix_episodes_trainable', table_name='episodes')
    op.drop_index('ix_episodes_open', table_name='episodes')

    op.drop_table('episodes')
    op.drop_index('ix_dead_letters_source', table_name='dead_letters')

    op.drop_table('dead_letters')
    op.drop_table('cycles')
