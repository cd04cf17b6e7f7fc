"""What ``loraplex up`` prints while a job trains: its status changes, its step, loss and ETA at most every few
seconds, and the model name once it succeeded."""

from __future__ import annotations

from pathlib import Path

from core import db
from core.accounts import create_tenant
from core.job_progress import JobProgress
from core.jobs import record_event
from core.models import FineTuneJob, JobStatus


def test_a_training_job_is_followed_from_queued_to_the_model_to_call(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'loraplex.db'}"
    db.upgrade(url)
    engine = db.make_engine(url)
    with db.session_scope(engine) as session:
        tenant, _ = create_tenant(session, "acme")
        job = FineTuneJob(id="ftjob-1", tenant_id=tenant.id, base_model="tiny", training_file="file-1")
        job.status = JobStatus.QUEUED
        session.add(job)
    progress = JobProgress(engine, every_s=10.0)

    def update(**fields: object) -> None:
        with db.session_scope(engine) as session:
            row = session.get(FineTuneJob, "ftjob-1")
            assert row is not None
            for name, value in fields.items():
                setattr(row, name, value)
            session.add(row)

    def step(n: int, loss: float, eta: float) -> None:
        with db.session_scope(engine) as session:
            row = session.get(FineTuneJob, "ftjob-1")
            assert row is not None
            data = {"step": n, "total_steps": 48, "train_loss": loss, "eta_seconds": eta}
            record_event(session, row, f"Step {n}/48: training loss={loss:.4f}", type="metrics", data=data)

    assert progress.poll(now=0.0) == ["job ftjob-1: queued"]
    assert progress.poll(now=1.0) == []
    update(status=JobStatus.RUNNING)
    step(1, 5.5, 94.0)
    assert progress.poll(now=2.0) == ["job ftjob-1: running", "job ftjob-1: step 1/48 (2%), loss 5.5000, ETA 1m34s"]
    step(2, 5.1, 90.0)
    assert progress.poll(now=5.0) == []  # within 10 s of the last line
    step(12, 2.25, 36.0)
    assert progress.poll(now=12.5) == ["job ftjob-1: step 12/48 (25%), loss 2.2500, ETA 36s"]
    assert progress.poll(now=30.0) == []  # no new step, nothing to say
    update(status=JobStatus.SUCCEEDED, fine_tuned_model="ft:tiny:acme::ftjob-1")
    assert progress.poll(now=31.0) == ["job ftjob-1: succeeded; call it as model ft:tiny:acme::ftjob-1"]
    assert progress.poll(now=60.0) == []  # a finished job is no longer watched
