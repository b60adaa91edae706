"""The feedback labeler: Kafka consumer group -> validation -> store -> join/settle -> dead letters.

Started with ``rtrl labeler`` (`feedback.labeler.run`). Modules: `labeler` (the consumer loop and
its error policy), `records` (validation of one record), `reconcile` (produced = stored +
dead-lettered, ``rtrl labeler reconcile``). The tables, the idempotent writes and the join/settle
rules live in the store package (store/events.py, store/settle.py); reward specs in
schemas/rewards.py.
"""
