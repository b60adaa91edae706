"""Forged events through `Labeler.step` without a broker (docs/security.md, Forged events): where the
labeler's vocabulary comes from (`feedback.records.vocab_size`), the one-line error when nothing
gives it, and the defaults (refuse unknown tenants, check token ids) wired from the settings; the
caps per episode and the held-out key (docs/security.md, Caps per episode and held-out membership)."""

from __future__ import annotations

import json
import stat
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from factories import T0, feedback, interaction, wire
from kafka.structs import TopicPartition

from feedback import metrics
from feedback.labeler import Labeler, prepare_store
from feedback.records import VocabularyUnknown, holdout_key, vocab_size
from schemas.errors import OperatorError
from schemas.events import DeadLetterRecord
from schemas.settings import (
    GatewaySettings,
    LabelerSettings,
    ServicesSettings,
    Settings,
    StoreSettings,
    VllmSettings,
)
from store import Store

pytestmark = pytest.mark.unit


def settings_with(model_dir: Path, vocab: int | None = None, **labeler: Any) -> Settings:
    return Settings(
        vllm=VllmSettings(model_dir=model_dir),
        labeler=LabelerSettings(vocab_size=vocab, **labeler),
        store=StoreSettings(url="sqlite://"),
        services=ServicesSettings(run_dir=model_dir / "run"),
    )


def test_the_vocabulary_is_the_setting_else_the_models_config(tmp_path: Path) -> None:
    assert vocab_size(settings_with(tmp_path / "absent", vocab=1000)) == 1000
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 384}))
    assert vocab_size(settings_with(tmp_path)) == 384
    assert vocab_size(settings_with(tmp_path, vocab=512)) == 512  # the setting wins
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"vocab_size": 262_208}}))
    assert vocab_size(settings_with(tmp_path)) == 262_208  # a multimodal config nests it


@pytest.mark.parametrize(
    ("config", "says"),
    [
        (None, "cannot read the serving model's vocabulary size"),
        ("{not json", "cannot read the serving model's vocabulary size"),
        (json.dumps({"model_type": "llama"}), "has no vocab_size"),
        (json.dumps({"vocab_size": "384"}), "has no vocab_size"),
    ],
)
def test_nothing_giving_a_vocabulary_is_a_one_line_operator_error(
    tmp_path: Path, config: str | None, says: str
) -> None:
    if config is not None:
        (tmp_path / "config.json").write_text(config)
    with pytest.raises(VocabularyUnknown) as caught:
        vocab_size(settings_with(tmp_path))
    message = str(caught.value)
    assert isinstance(caught.value, OperatorError) and "\n" not in message
    assert says in message and "RTRL_LABELER__VOCAB_SIZE" in message


def test_a_labeler_without_a_vocabulary_does_not_start(tmp_path: Path, store: Store) -> None:
    with pytest.raises(VocabularyUnknown):
        Labeler(settings_with(tmp_path / "absent"), store, FakeConsumer([]), FakeProducer())  # type: ignore[arg-type]


class FakeRecord:
    def __init__(self, topic: str, offset: int, value: bytes) -> None:
        self.topic, self.partition, self.offset, self.value = topic, 0, offset, value


class FakeConsumer:
    """Hands out one batch, then nothing; keeps the commits."""

    def __init__(self, records: list[FakeRecord]) -> None:
        by_topic: dict[Any, list[FakeRecord]] = {}
        for r in records:
            by_topic.setdefault(TopicPartition(r.topic, 0), []).append(r)
        self.batches: list[dict[Any, list[FakeRecord]]] = [by_topic]
        self.committed: list[dict[Any, Any]] = []

    def poll(self, timeout_ms: int, max_records: int) -> dict[Any, list[FakeRecord]]:
        return self.batches.pop(0) if self.batches else {}

    def commit(self, offsets: dict[Any, Any]) -> None:
        self.committed.append(offsets)

    def assignment(self) -> set[Any]:
        return set()


class FakeDelivery:
    def get(self, timeout: float) -> None:
        return None


class FakeProducer:
    """The DLQ producer: keeps what was produced."""

    def __init__(self) -> None:
        self.sent: list[DeadLetterRecord] = []

    def send(self, topic: str, key: bytes, value: bytes, schema: str) -> FakeDelivery:
        self.sent.append(DeadLetterRecord.model_validate_json(value))
        return FakeDelivery()

    def flush(self, timeout: float) -> None:
        return None


def test_the_labeler_refuses_forged_tenants_and_token_ids_by_default(tmp_path: Path, store: Store) -> None:
    """Defaults: unknown tenants refused; the vocabulary read from vllm.model_dir's config.json."""
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 384}))
    settings = settings_with(tmp_path)
    assert settings.labeler.unknown_tenants == "refuse"
    store.set_tenant("acme")
    events = [
        interaction("a1", tenant="acme"),
        interaction("g1", tenant="ghost"),
        interaction("a2", tenant="acme", completion_token_ids=[4, 2**31 - 1]),
    ]
    records = [FakeRecord(settings.kafka.interactions_topic, i, wire(e)) for i, e in enumerate(events)]
    records.append(
        FakeRecord(settings.kafka.feedback_topic, 0, wire(feedback("r-a1-0", "accepted", tenant="ghost")))
    )
    consumer, producer = FakeConsumer(records), FakeProducer()
    labeler = Labeler(settings, store, consumer, producer, clock=lambda: T0)  # type: ignore[arg-type]
    report = labeler.step()
    assert report is not None and (report.interactions, report.dead_lettered) == (1, 3)
    assert sorted(d.reason for d in producer.sent) == [
        "content: token id outside the vocabulary (2147483647 >= 384)",
        "unknown tenant: ghost",
        "unknown tenant: ghost",
    ]
    assert len(consumer.committed) == 1  # the batch, dead letters included, is done
    assert store.stats()["dead_letters"] == 3
    # rtrl_labeler_dead_letters_total{reason=...}: its own series, which RtrlDeadLettersGrowing watches
    assert [metrics.reason_label(d.reason) for d in producer.sent].count("unknown tenant") == 2


def test_accept_lets_an_unknown_tenant_through(tmp_path: Path, store: Store) -> None:
    settings = settings_with(tmp_path, vocab=384, unknown_tenants="accept")
    records = [FakeRecord(settings.kafka.interactions_topic, 0, wire(interaction("g1", tenant="ghost")))]
    producer = FakeProducer()
    labeler = Labeler(settings, store, FakeConsumer(records), producer, clock=lambda: T0)  # type: ignore[arg-type]
    report = labeler.step()
    assert report is not None and (report.interactions, report.dead_lettered, producer.sent) == (1, 0, [])


@pytest.mark.parametrize(("auth", "tenants"), [("open", ["default"]), ("keys", [])])
def test_an_open_gateways_tenant_has_a_row(tmp_path: Path, auth: str, tenants: list[str]) -> None:
    """Under gateway.auth=open every call is tenant `default`: the labeler creates its row at start-up,
    so the local loop without keys is not refused; with keys, tenants come from the keys only."""
    store = Store(f"sqlite:///{tmp_path / 'rtrl.db'}")
    try:
        prepare_store(Settings(gateway=GatewaySettings(auth=auth)), store)  # type: ignore[arg-type]
        assert [t.tenant for t in store.tenants()] == tenants
    finally:
        store.close()


def test_the_labeler_dead_letters_what_is_past_a_cap_and_counts_it(tmp_path: Path, store: Store) -> None:
    """limits.max_segments_per_episode / max_feedback_per_episode / max_prompt_bytes, wired from the
    settings: each refused record reaches the DLQ topic with its reason and rtrl_labeler_dead_letters_total{reason="cap"}."""
    settings = settings_with(tmp_path, vocab=384)
    limits = settings.limits.model_copy(
        update={"max_segments_per_episode": 2, "max_feedback_per_episode": 1, "max_prompt_bytes": 1024}
    )
    settings = settings.model_copy(update={"limits": limits})
    store.set_tenant("default")
    events = [
        interaction("e1", 0),
        interaction("e1", 1),
        interaction("e1", 2),
        interaction("e2", prompt="é" * 513),  # 1026 bytes in UTF-8, 513 characters
        feedback("r-e1-0", "edited", 0.5),
        feedback("r-e1-1", "edited", 0.5),
    ]
    records = [
        FakeRecord(settings.kafka.interactions_topic if i < 4 else settings.kafka.feedback_topic, i, wire(e))
        for i, e in enumerate(events)
    ]
    before = metrics.DEAD_LETTERS.labels("cap")._value.get()
    producer = FakeProducer()
    labeler = Labeler(settings, store, FakeConsumer(records), producer, clock=lambda: T0)  # type: ignore[arg-type]
    report = labeler.step()
    assert report is not None and (report.interactions, report.feedback, report.dead_lettered) == (2, 1, 3)
    assert sorted(d.reason for d in producer.sent) == [
        "cap: episode e1 has its 1 feedback (limits.max_feedback_per_episode)",
        "cap: episode e1 has its 2 segments (limits.max_segments_per_episode)",
        "cap: prompt of 1026 bytes over limits.max_prompt_bytes (1024)",
    ]
    assert metrics.DEAD_LETTERS.labels("cap")._value.get() == before + 3
    assert store.stats()["dead_letters"] == 3


def test_the_held_out_key_is_the_setting_else_one_kept_in_the_run_dir(tmp_path: Path) -> None:
    settings = settings_with(tmp_path, vocab=384)
    key = holdout_key(settings)
    path = tmp_path / "run" / "labeler.holdout_secret"
    assert len(key) == 64 and path.read_bytes().strip() == key
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # readable by the labeler's user only
    assert holdout_key(settings) == key  # made once: every labeler on the host shares it
    assert holdout_key(settings_with(tmp_path, vocab=384, holdout_secret="s3cret")) == b"s3cret"


def test_an_episode_that_settling_fails_on_is_closed_and_quarantined_not_a_crash_loop(
    tmp_path: Path, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The window pass is under the error policy: settling fails -> one episode at a time; the one
    that fails alone is closed without a reward and quarantined, the others settle."""
    from schemas.episodes import episode_metrics as real

    def breaks_on_boom(segments: Any) -> Any:
        if any(s.prompt.startswith("boom") for s in segments):
            raise RuntimeError("boom")
        return real(segments)

    monkeypatch.setattr("store.settle.episode_metrics", breaks_on_boom)
    settings = settings_with(tmp_path, vocab=384)
    store.set_tenant("default")
    events = [interaction("ok", 0), interaction("ok", 1), interaction("bad", 0, prompt="boom")]
    events.append(interaction("bad", 1, prompt="boom again"))
    records = [FakeRecord(settings.kafka.interactions_topic, i, wire(e)) for i, e in enumerate(events)]
    now = [T0]
    labeler = Labeler(settings, store, FakeConsumer(records), FakeProducer(), clock=lambda: now[0])  # type: ignore[arg-type]
    labeler.step()
    now[0] = T0 + timedelta(seconds=settings.labeler.settle_window_s + 5)
    report = labeler.step()
    assert report is not None and report.settled_window == 1
    quarantined = store.quarantined(10)
    assert [(q.episode_id, q.reason) for q in quarantined] == [("bad", "settle: RuntimeError: boom")]
    stats = store.stats()
    assert (stats["episodes_open"], stats["episodes_settled"]) == (0, 2)
    now[0] += timedelta(seconds=2)
    assert labeler.step() is not None  # nothing left to fail on
