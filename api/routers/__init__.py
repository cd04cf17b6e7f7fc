"""One router per resource, each with its pydantic schemas beside it (``<resource>_schemas.py``).

The app mounts them from :data:`api.app.ROUTERS`; a new resource (part 2: inference, usage, dashboard)
adds its router there. This package imports nothing itself, so schemas can be imported on their own.
"""
