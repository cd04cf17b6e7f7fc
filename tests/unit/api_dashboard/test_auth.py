"""Dashboard sessions and login links: signed expiries under the admin key."""

from __future__ import annotations

from api.dashboard.auth import sign, verify
from core.settings import load_settings


def test_a_signed_token_verifies_until_it_expires_and_only_for_its_purpose() -> None:
    settings = load_settings(admin_key="adm-secret")
    token = sign(settings, "login", 60, at=1000.0)
    assert verify(settings, "login", token, at=1059.0)
    assert not verify(settings, "login", token, at=1061.0)
    assert not verify(settings, "session", token, at=1000.0)


def test_changing_the_admin_key_invalidates_tokens_and_forgeries_fail() -> None:
    settings = load_settings(admin_key="adm-secret")
    token = sign(settings, "session", 60, at=1000.0)
    assert token is not None
    assert not verify(load_settings(admin_key="adm-other"), "session", token, at=1000.0)
    expires, mac = token.split(".")
    assert not verify(settings, "session", f"{int(expires) + 3600}.{mac}", at=1000.0)
    assert not verify(settings, "session", "garbage", at=1000.0)


def test_no_admin_key_means_no_tokens() -> None:
    settings = load_settings(admin_key=None)
    assert sign(settings, "session", 60) is None
    assert not verify(settings, "session", "1.abc")
