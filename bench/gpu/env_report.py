"""Print the GPU (nvidia-smi) and the versions that matter, and write them as JSON for the lease's summary.

Run: ``python bench/gpu/env_report.py env.json``.
"""

from __future__ import annotations

import json
import platform
import shutil
import subprocess
import sys
from pathlib import Path


def versions() -> dict[str, str]:
    """The device torch sees, and the versions of python, torch, CUDA, triton, transformers and peft."""
    import peft
    import torch
    import transformers

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "absent"
    return {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
        "triton": triton_version,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
    }


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if shutil.which("nvidia-smi"):
        subprocess.run(["nvidia-smi"], check=False)
    env = versions()
    print(json.dumps(env, indent=1))
    if args:
        Path(args[0]).write_text(json.dumps(env) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
