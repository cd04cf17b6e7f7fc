"""The control plane: an OpenAI-compatible FastAPI app for tenants, files, fine-tuning jobs, adapters, models.

Layout: ``app.create_app(settings)`` builds the app; ``context.ApiContext`` holds its clients (database,
object store, job queue, base model) and ``deps`` hands them, the calling tenant and admin access to
handlers; ``errors`` maps every failure to OpenAI's error shape once. ``routers/`` has one router per
resource with its schemas beside it; flows that outgrow a handler live next to the app
(``job_submission``, ``adapter_lifecycle``, streaming uploads in ``multipart`` and ``spools``).
"""
