"""`EpisodeStore.heldout_prompts`: the prompts of held-out logged traffic that the gate's traffic
suite replays (deployer/traffic.py, docs/gate.md): the eval bucket only, settled or not, never a
claimed or quarantined episode, each episode's first segment, one per prompt text, newest first."""

from __future__ import annotations

from factories import HOLDOUT_KEY, Feeder, at, feedback, interaction
from sqlalchemy import update

from store import Store
from store.models import Episode
from store.settle import eval_bucket

PERCENT = 50


def ids(held_out: bool, n: int) -> list[str]:
    """`n` episode ids inside (or outside) the held-out buckets below PERCENT under the tests' key."""
    found = [f"h{i}" for i in range(200) if (eval_bucket(f"h{i}", HOLDOUT_KEY) < PERCENT) == held_out]
    assert len(found) >= n
    return found[:n]


def test_held_out_prompts_newest_first_settled_or_not_first_segment_deduped(any_store: Store) -> None:
    store = any_store
    held = ids(True, 8)
    trained = ids(False, 1)[0]
    feeder = Feeder(store)
    feeder.send(
        # held[0]: two calls; the first one's prompt is the episode's
        interaction(held[0], 0, prompt="first call", created_at=at(10)),
        interaction(held[0], 1, prompt="second call", created_at=at(11)),
        feedback(f"r-{held[0]}-1", "thumbs_up"),
        # held[1]: open, no feedback yet: replayed all the same
        interaction(held[1], prompt="open episode", created_at=at(20)),
        # held[2] and held[3]: the same prompt; held[3] is newer and is the one kept
        interaction(held[2], prompt="same prompt", created_at=at(30)),
        interaction(held[3], prompt="same prompt", created_at=at(40)),
        # held[4]: quarantined; held[5]: claimed by a cycle; held[6]: a tenant switched off
        interaction(held[4], prompt="quarantined", created_at=at(50)),
        interaction(held[5], prompt="claimed", created_at=at(60)),
        interaction(held[6], prompt="tenant off", tenant="quiet", created_at=at(70)),
        interaction(held[7], prompt="newest", tenant="acme", created_at=at(80)),
        # outside the held-out buckets: trains, never replayed
        interaction(trained, prompt="trainable", created_at=at(90)),
    )
    store.set_tenant("quiet", trains=False)
    with store.transaction() as session:
        session.execute(update(Episode).where(Episode.episode_id == held[4]).values(quarantined_at=at(100)))
        session.execute(update(Episode).where(Episode.episode_id == held[5]).values(used_in_cycle=1))

    prompts = store.heldout_prompts(100, holdout_percent=PERCENT)
    assert [(p.episode_id, p.prompt) for p in prompts] == [
        (held[7], "newest"),
        (held[3], "same prompt"),
        (held[1], "open episode"),
        (held[0], "first call"),
    ]
    assert prompts[0].tenant == "acme" and prompts[0].created_at == at(80)
    assert prompts[-1].tenant == "default" and prompts[-1].created_at == at(10)
    assert [p.episode_id for p in store.heldout_prompts(2, holdout_percent=PERCENT)] == [held[7], held[3]]
    assert store.heldout_prompts(100, holdout_percent=0) == []  # no held-out slice, nothing to replay
    assert store.heldout_prompts(0, holdout_percent=PERCENT) == []
    everything = store.heldout_prompts(100, holdout_percent=100)
    assert trained in {p.episode_id for p in everything}  # every bucket is below 100


def test_the_limit_counts_distinct_prompts_past_repeated_ones(any_store: Store) -> None:
    """Many episodes with one prompt do not crowd the distinct ones out of the limit."""
    held = ids(True, 30)
    Feeder(any_store).send(
        *[interaction(e, prompt="hello", created_at=at(100 + i)) for i, e in enumerate(held[:25])],
        *[interaction(e, prompt=f"question {i}", created_at=at(i)) for i, e in enumerate(held[25:])],
    )
    prompts = any_store.heldout_prompts(4, holdout_percent=PERCENT)
    assert [p.prompt for p in prompts] == ["hello", "question 4", "question 3", "question 2"]
    assert prompts[0].episode_id == held[24]  # the newest of the repeated prompt's episodes
