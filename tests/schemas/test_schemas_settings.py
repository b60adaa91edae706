"""Settings: nested environment variables, one-line errors that name the variable, Kafka security,
and handing a configuration to a child process."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import SecretStr, ValidationError

from schemas.errors import OperatorError
from schemas.settings import (
    KafkaSettings,
    ServicesSettings,
    Settings,
    SettingsError,
    VllmSettings,
    load_settings,
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


def test_a_bad_setting_is_one_line_naming_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RTRL_TRAINER__LOSS__TYPE", "reinforce")
    monkeypatch.setenv("RTRL_TRAINER__MIN_SAMPLES", "0")
    with pytest.raises(SettingsError) as caught:
        load_settings()
    message = str(caught.value)
    assert isinstance(caught.value, OperatorError) and "\n" not in message
    assert ("RTRL_TRAINER__LOSS__TYPE: Input should be one of 'cispo', 'ppo', 'grpo', 'dapo', 'dr_grpo', 'gspo' "
            "(got 'reinforce')") in message
    assert "RTRL_TRAINER__MIN_SAMPLES: Input should be greater than or equal to 1" in message
    assert message.endswith("(fix the environment or .env)")


def test_kafka_security_settings_are_complete_or_refused() -> None:
    sasl = KafkaSettings(
        security_protocol="SASL_SSL", sasl_mechanism="SCRAM-SHA-512", sasl_username="rtrl",
        sasl_password=SecretStr("s3cret"), ssl_cafile=Path("/etc/ca.pem"),
    )  # fmt: skip
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
            security_protocol="SASL_PLAINTEXT", sasl_mechanism="PLAIN", sasl_username="u",
            sasl_password=SecretStr("p@ss"),
        ),  # fmt: skip
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
