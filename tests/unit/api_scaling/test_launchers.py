"""Which launcher the settings pick, and the Kubernetes launcher's settings."""

from __future__ import annotations

from pathlib import Path

import pytest

from api.base_model import BaseModelInfo, BaseModels
from api.scaling.kubernetes import parse_deployments
from api.scaling.launchers import make_launcher
from api.scaling.local import LocalLauncher
from core.adapter_format import BaseShapes
from core.errors import ConfigError
from core.settings import Settings


def bases(*names: str) -> BaseModels:
    shapes = BaseShapes(num_layers=1, hidden_size=8, intermediate_size=16, q_size=8, kv_size=8)
    return BaseModels([BaseModelInfo(n, Path("/models") / n, {}, shapes, 0) for n in names])


def test_a_ttl_without_a_launcher_is_refused_saying_what_to_set(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path, replica_idle_ttl=60)
    with pytest.raises(ConfigError, match="LORAPLEX_REPLICA_LAUNCHER"):
        make_launcher(settings, bases("tiny"))
    assert make_launcher(Settings(data_dir=tmp_path), bases("tiny")) is None
    local = make_launcher(Settings(data_dir=tmp_path, replica_launcher="local", replica_args="--threads 2"), bases("t"))
    assert isinstance(local, LocalLauncher) and local.extra_args == ["--threads", "2"]


def test_every_base_needs_a_deployment() -> None:
    served = bases("tiny", "qwen")
    assert parse_deployments(" tiny=srv-tiny , qwen=srv-qwen,", served) == {"tiny": "srv-tiny", "qwen": "srv-qwen"}
    with pytest.raises(ConfigError, match="no server Deployment for 'qwen'"):
        parse_deployments("tiny=srv-tiny", served)
    with pytest.raises(ConfigError, match="'tiny' is not BASE=DEPLOYMENT"):
        parse_deployments("tiny", served)
