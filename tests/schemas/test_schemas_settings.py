"""Settings: nested environment variables, one-line errors that name the variable, Kafka security,
handing a configuration to a child process, and the default databases (the local PostgreSQL's,
or SQLite files for the demo)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import SecretStr, ValidationError

from schemas.errors import OperatorError
from schemas.settings import (
    KafkaSettings,
    MlflowSettings,
    PostgresSettings,
    ServicesSettings,
    Settings,
    SettingsError,
    StoreSettings,
    VllmSettings,
    embedded_databases,
    load_settings,
    local_postgres_url,
    to_env,
)

pytestmark = pytest.mark.unit


def test_settings_read_nested_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RTRL_KAFKA__BOOTSTRAP_SERVERS", "broker-a:9092,broker-b:9092")
    monkeypatch.setenv("RTRL_TRAINER__LOSS__TYPE", "ppo")
    monkeypatch.setenv("RTRL_VLLM__SERVERS", '["http://a:8000", "http://b:8000"]')
    settings = load_settings()
    assert settings.kafka.bootstrap_servers == "broker-a:9092,broker-b:9092"
    assert settings.trainer.loss.type == "ppo" and settings.trainer.loss.eps_low == 0.2  # PPO's own defaults
    assert settings.vllm.servers == ("http://a:8000", "http://b:8000")


def test_the_kl_penalty_to_the_base_is_off_by_default_and_set_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from schemas.settings import LOSS_TYPES, TrainerSettings

    for loss in LOSS_TYPES:  # every loss has it, off, with the champion's estimator
        assert TrainerSettings.model_validate({"loss": {"type": loss}}).loss.ref_kl_coef == 0.0
    assert TrainerSettings().reference == "base"
    monkeypatch.setenv("RTRL_TRAINER__LOSS__REF_KL_COEF", "0.1")
    monkeypatch.setenv("RTRL_TRAINER__REFERENCE", "3")
    trainer = load_settings().trainer
    # The default loss keeps its own penalty to the champion beside the new one.
    assert (trainer.loss.type, trainer.loss.kl_coef, trainer.loss.ref_kl_coef) == ("cispo", 0.5, 0.1)
    assert trainer.reference == "3"
    for bad in ("v3", "0", "champion", "none"):
        with pytest.raises(ValidationError):
            TrainerSettings(reference=bad)
    with pytest.raises(ValidationError):
        TrainerSettings.model_validate({"loss": {"ref_kl_coef": -0.1}})


def test_a_bad_setting_is_one_line_naming_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RTRL_TRAINER__LOSS__TYPE", "reinforce")
    monkeypatch.setenv("RTRL_TRAINER__MIN_SAMPLES", "0")
    with pytest.raises(SettingsError) as caught:
        load_settings()
    message = str(caught.value)
    assert isinstance(caught.value, OperatorError) and "\n" not in message
    assert (
        "RTRL_TRAINER__LOSS__TYPE: Input should be one of 'cispo', 'ppo', 'grpo', 'dapo', 'dr_grpo', 'gspo', 'rft', 'dpo' "
        "(got 'reinforce')"
    ) in message
    assert "RTRL_TRAINER__MIN_SAMPLES: Input should be greater than or equal to 1" in message
    assert message.endswith("(fix the environment or .env)")


def test_kafka_security_settings_are_complete_or_refused() -> None:
    sasl = KafkaSettings(
        security_protocol="SASL_SSL",
        sasl_mechanism="SCRAM-SHA-512",
        sasl_username="rtrl",
        sasl_password=SecretStr("s3cret"),
        ssl_cafile=Path("/etc/ca.pem"),
    )
    assert "s3cret" not in sasl.model_dump_json()  # never printed (`rtrl config show`)
    with pytest.raises(ValidationError, match="needs sasl_mechanism, sasl_username and sasl_password"):
        KafkaSettings(security_protocol="SASL_PLAINTEXT", sasl_mechanism="PLAIN")
    with pytest.raises(ValidationError, match="sasl_mechanism is set but security_protocol is PLAINTEXT"):
        KafkaSettings(sasl_mechanism="PLAIN")
    with pytest.raises(ValidationError, match="ssl_certfile and ssl_keyfile go together"):
        KafkaSettings(security_protocol="SSL", ssl_certfile=Path("/etc/client.pem"))


def test_to_env_hands_settings_to_a_child_process(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = Settings(
        vllm=VllmSettings(servers=("http://a:1", "http://b:2"), staging_server=None),
        services=ServicesSettings(vllm_staging_port=None, kafka_port=1234),
        kafka=KafkaSettings(
            security_protocol="SASL_PLAINTEXT",
            sasl_mechanism="PLAIN",
            sasl_username="u",
            sasl_password=SecretStr("p@ss"),
        ),
    )
    for key, value in to_env(settings).items():
        monkeypatch.setenv(key, value)
    child = load_settings()
    assert child == settings
    assert child.kafka.sasl_password is not None and child.kafka.sasl_password.get_secret_value() == "p@ss"


def test_a_bad_secret_setting_never_prints_the_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RTRL_KAFKA__SECURITY_PROTOCOL", "SASL_SSL")  # without a mechanism: refused
    monkeypatch.setenv("RTRL_KAFKA__SASL_PASSWORD", "hunter2")
    with pytest.raises(SettingsError) as caught:
        load_settings()
    assert "RTRL_KAFKA: Value error, security_protocol SASL_SSL needs sasl_mechanism" in str(caught.value)
    assert "hunter2" not in str(caught.value)


def test_unset_databases_are_the_local_postgres_of_the_services_settings() -> None:
    settings = Settings(
        services=ServicesSettings(host="10.1.2.3", postgres_port=5433),
        postgres=PostgresSettings(user="loop", database="events", mlflow_database="runs"),
    )
    assert settings.store.url == "postgresql+psycopg://loop@10.1.2.3:5433/events"
    assert settings.mlflow.backend_store_uri == "postgresql+psycopg://loop@10.1.2.3:5433/runs"
    assert local_postgres_url(settings, "other") == "postgresql+psycopg://loop@10.1.2.3:5433/other"
    # With the default services and postgres settings: the defaults the fields document.
    plain = Settings(
        services=ServicesSettings(),
        postgres=PostgresSettings(),
        store=StoreSettings(),
        mlflow=MlflowSettings(),
    )
    assert plain.store.url == StoreSettings().url == "postgresql+psycopg://rtrl@127.0.0.1:15432/rtrl"
    assert (
        plain.mlflow.backend_store_uri
        == MlflowSettings().backend_store_uri
        == ("postgresql+psycopg://rtrl@127.0.0.1:15432/mlflow")
    )


def test_a_database_that_is_set_wins(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    given = Settings(
        store=StoreSettings(url=f"sqlite:///{tmp_path}/mine.db"),
        mlflow=MlflowSettings(backend_store_uri="postgresql+psycopg://u@db:5432/ml"),
    )
    assert given.store.url == f"sqlite:///{tmp_path}/mine.db"
    assert given.mlflow.backend_store_uri == "postgresql+psycopg://u@db:5432/ml"
    monkeypatch.setenv("RTRL_SERVICES__POSTGRES_PORT", "5999")
    monkeypatch.setenv("RTRL_STORE__URL", "postgresql+psycopg://rtrl@db.internal:5432/rtrl")
    from_env = load_settings()
    assert from_env.store.url == "postgresql+psycopg://rtrl@db.internal:5432/rtrl"
    assert (
        from_env.mlflow.backend_store_uri == "postgresql+psycopg://rtrl@127.0.0.1:5999/mlflow"
    )  # unset: follows
    assert embedded_databases(from_env).store.url == "postgresql+psycopg://rtrl@db.internal:5432/rtrl"


def test_a_child_process_gets_the_same_databases(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for settings in (
        Settings(services=ServicesSettings(postgres_port=6543, run_dir=tmp_path)),
        embedded_databases(Settings(services=ServicesSettings(run_dir=tmp_path))),
    ):
        for key, value in to_env(settings).items():
            monkeypatch.setenv(key, value)
        child = load_settings()
        assert child == settings
        assert (child.store.url, child.mlflow.backend_store_uri) == (
            settings.store.url,
            settings.mlflow.backend_store_uri,
        )


def test_embedded_databases_are_sqlite_files_in_the_run_dir(tmp_path: Path) -> None:
    settings = Settings(services=ServicesSettings(run_dir=tmp_path / "run"))
    embedded = embedded_databases(settings)
    assert embedded.store.url == f"sqlite:///{tmp_path}/run/rtrl.db"
    assert embedded.mlflow.backend_store_uri == f"sqlite:///{tmp_path}/run/mlflow/mlflow.db"
    assert settings.store.url == local_postgres_url(settings)  # the settings given are left as they were
    relative = embedded_databases(Settings(services=ServicesSettings(run_dir=Path(".rtrl/run"))))
    assert relative.store.url == "sqlite:///.rtrl/run/rtrl.db"  # the demo's files, as before PostgreSQL
    assert relative.mlflow.backend_store_uri == "sqlite:///.rtrl/run/mlflow/mlflow.db"
    mine = Settings(store=StoreSettings(url="postgresql+psycopg://u@db:5432/rtrl"))
    assert embedded_databases(mine).store.url == "postgresql+psycopg://u@db:5432/rtrl"  # set: left alone
    assert embedded_databases(mine).mlflow.backend_store_uri.startswith("sqlite:///")


def test_a_placeholder_secret_is_refused_naming_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CHANGE-ME values of infra/deploy/k8s/secrets.yaml and env.example never run: a secret, or
    a URL with a password in it, that still holds one stops the process at start-up, in one line
    that names the settings and never shows the value."""
    monkeypatch.setenv(
        "RTRL_STORE__URL", "postgresql+psycopg://rtrl_labeler:CHANGE-ME-labeler@postgres:5432/rtrl"
    )
    monkeypatch.setenv("RTRL_KAFKA__SECURITY_PROTOCOL", "SASL_PLAINTEXT")
    monkeypatch.setenv("RTRL_KAFKA__SASL_MECHANISM", "SCRAM-SHA-512")
    monkeypatch.setenv("RTRL_KAFKA__SASL_USERNAME", "rtrl-labeler")
    monkeypatch.setenv("RTRL_KAFKA__SASL_PASSWORD", "change-me-kafka-labeler")
    monkeypatch.setenv("RTRL_METRICS__TOKEN", "a-real-token")
    with pytest.raises(SettingsError) as caught:
        load_settings()
    message = str(caught.value)
    assert isinstance(caught.value, OperatorError) and "\n" not in message
    assert message.startswith(
        "placeholder secret: RTRL_KAFKA__SASL_PASSWORD, RTRL_STORE__URL still hold CHANGE-ME;"
    )
    assert "infra/deploy/k8s/secrets.yaml" in message
    assert "labeler" not in message.split(";")[1]  # no value shown, not even a URL's user
    assert "RTRL_METRICS__TOKEN" not in message

    monkeypatch.setenv("RTRL_STORE__URL", "postgresql+psycopg://rtrl_labeler:s3cret@postgres:5432/rtrl")
    monkeypatch.setenv("RTRL_KAFKA__SASL_PASSWORD", "another-s3cret")
    assert load_settings().kafka.sasl_username == "rtrl-labeler"
