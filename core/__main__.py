"""`python -m core` is the `loraplex` command (used by `loraplex up` to start its children)."""

from core.cli import main

main()
