"""Files the local services read from the checkout are found where the code looks for them.

A machine with a warm Maven cache never reads the Kafka POM, so a wrong path passes every service test
there and fails on the first fresh machine: this test needs no cache.
"""

import pytest

from services import kafka

pytestmark = pytest.mark.unit


def test_the_kafka_pom_is_read_from_this_checkout() -> None:
    assert kafka.POM.is_file(), f"{kafka.POM} does not exist: REPO_ROOT is {kafka.REPO_ROOT}"
    assert (kafka.REPO_ROOT / "pyproject.toml").is_file()
