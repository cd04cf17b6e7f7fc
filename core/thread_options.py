"""The thread options of the commands that run torch: one definition each, so `loraplex up`, `server`, `worker`
and `train` read the same variables (the split itself is ``core.cpu_share``)."""

from __future__ import annotations

from typing import Annotated

import typer

ServerThreads = Annotated[
    int | None,
    typer.Option(
        min=1,
        envvar="LORAPLEX_SERVER_THREADS",
        help="CPU threads for the inference server's torch (default: one per core; `loraplex up` gives it the "
        "cores training does not take).",
    ),
]
TrainThreads = Annotated[
    int | None,
    typer.Option(
        min=1,
        envvar="LORAPLEX_TRAIN_THREADS",
        help="CPU threads a training job's torch uses (default: one per core; `loraplex up` gives it 1 up to 4 "
        "cores, then a quarter of them).",
    ),
]
