"""Serving a non-loopback address without a bearer token is refused unless ``insecure`` says otherwise."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from raas.api.app import check_exposure, is_loopback
from raas.errors import RaasError
from raas.pipeline.config import ServiceConfig

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("host", ["127.0.0.1", "127.8.0.1", "localhost", "LOCALHOST", "::1", "[::1]"])
def test_loopback_addresses(host: str) -> None:
    assert is_loopback(host)


@pytest.mark.parametrize(
    "host", ["0.0.0.0", "::", "10.1.2.3", "192.168.0.1", "my-node", "", "::ffff:1.2.3.4"]
)
def test_other_addresses(host: str) -> None:
    assert not is_loopback(host)


def config(tmp_path: Path, **kw: object) -> ServiceConfig:
    return ServiceConfig(state_dir=tmp_path, **kw)  # type: ignore[arg-type]


def test_public_without_token_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAAS_API_TOKEN", raising=False)
    with pytest.raises(RaasError) as caught:
        check_exposure(config(tmp_path), "0.0.0.0")
    assert caught.value.kind == "bad_request"
    assert "Set RAAS_API_TOKEN" in caught.value.message and "--insecure" in caught.value.message


def test_a_token_or_loopback_needs_no_flag(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAAS_API_TOKEN", raising=False)
    check_exposure(config(tmp_path), "127.0.0.1")
    check_exposure(config(tmp_path, api_token="t"), "0.0.0.0")
    monkeypatch.setenv("RAAS_API_TOKEN", "t")
    check_exposure(config(tmp_path), "10.0.0.1")


def test_insecure_serves_with_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("RAAS_API_TOKEN", raising=False)
    with caplog.at_level(logging.WARNING, logger="raas.api"):
        check_exposure(config(tmp_path, insecure=True), "0.0.0.0")
    assert "WITHOUT an API token" in caplog.text
