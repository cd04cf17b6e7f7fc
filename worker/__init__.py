"""Celery training workers: the job lifecycle around ``trainer/`` (claim, heartbeat, cancel, upload, record)."""
