"""With no inference server running, inference answers 503 with retry-after (clients come back later),
and the rest of the API keeps working."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from core.local_services import EmbeddedRedis
from tests.integration.api_inference.deployment import deploy
from tests.services import S3Service

pytestmark = pytest.mark.slow


def test_no_replica_means_503_with_retry_after(
    tmp_path: Path, redis_service: EmbeddedRedis, s3_service: S3Service, tiny_model_dir: Path
) -> None:
    deployment = deploy(tmp_path, redis_service.url, s3_service, tiny_model_dir)
    try:
        client = deployment.make_tenant().openai()
        for stream in (False, True):
            with pytest.raises(openai.InternalServerError) as exc:
                client.completions.create(model=deployment.base_model, prompt="hi", max_tokens=2, stream=stream)
            assert (exc.value.status_code, exc.value.code) == (503, "no_replica")
            assert int(exc.value.response.headers["retry-after"]) >= 1
        assert [m.id for m in client.models.list()] == [deployment.base_model]
    finally:
        deployment.stop()
