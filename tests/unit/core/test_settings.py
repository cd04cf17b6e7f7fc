from __future__ import annotations

from pathlib import Path

import pytest

from core.errors import ConfigError
from core.settings import load_settings


def test_defaults_are_embedded(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LORAPLEX_DATA_DIR", str(tmp_path))
    s = load_settings()
    assert s.db_url == f"sqlite:///{tmp_path / 'loraplex.db'}"
    assert s.storage_backend == "local" and s.objects_dir == tmp_path / "objects"
    assert s.redis_url is None


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("LORAPLEX_API_PORT", "not-a-port"),
        ("LORAPLEX_API_PORT", "70000"),
        ("LORAPLEX_STORAGE_BACKEND", "ftp"),
        ("LORAPLEX_S3_ENDPOINT", "http://minio:9000"),
        ("LORAPLEX_S3_BUCKET", "Bad_Bucket"),
        ("LORAPLEX_MAX_LORA_RANK", "0"),
        ("LORAPLEX_S3_SECURE", "maybe"),
    ],
)
def test_bad_value_names_the_variable(monkeypatch: pytest.MonkeyPatch, var: str, value: str) -> None:
    monkeypatch.setenv(var, value)
    with pytest.raises(ConfigError) as exc:
        load_settings()
    assert var in str(exc.value)


def test_s3_needs_endpoint_and_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORAPLEX_STORAGE_BACKEND", "s3")
    with pytest.raises(ConfigError, match="LORAPLEX_S3_ENDPOINT"):
        load_settings()
    monkeypatch.setenv("LORAPLEX_S3_ENDPOINT", "127.0.0.1:9000")
    with pytest.raises(ConfigError, match="LORAPLEX_S3_ACCESS_KEY"):
        load_settings()
    monkeypatch.setenv("LORAPLEX_S3_ACCESS_KEY", "a")
    monkeypatch.setenv("LORAPLEX_S3_SECRET_KEY", "b")
    assert load_settings().s3_endpoint == "127.0.0.1:9000"


def test_cli_reports_bad_setting(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import subprocess
    import sys

    env = {"PATH": str(Path(sys.executable).parent), "LORAPLEX_DATA_DIR": str(tmp_path), "LORAPLEX_API_PORT": "x"}
    out = subprocess.run(["loraplex", "db", "current"], env=env, capture_output=True, text=True)
    assert out.returncode == 2
    assert "LORAPLEX_API_PORT" in out.stderr
