"""The ``/admin`` dashboard: server-rendered HTML with inline SVG charts (no scripts, no CDNs)."""
