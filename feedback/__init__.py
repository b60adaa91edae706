"""The feedback labeler: Kafka consumer group, SQL store and migrations, join/settle, reward specs.

Started with ``rtrl labeler`` (``feedback.labeler.run(settings)``). The trainer reads the store
through ``feedback.store.Store``; the eval gate scores with ``feedback.rewards``. Importing this
package imports neither Kafka nor SQLAlchemy.
"""
