"""Where a server's time goes under a load: py-spy samples of the server and its child processes, each sample
put in one bucket (GEMM, attention, LoRA, ...) by the innermost Python frame that names one.

Used by ``bench/adapter_scale.py --profile`` to set our engine's step beside vLLM's worker on the same load. The
profiler costs time (it pauses the process to read native stacks), so a profiled run's tok/s are not the
benchmark's figures: its shares and per-token milliseconds are what it is for.

Python frames decide, not native ones: vLLM's CPU LoRA ops end in the same BLAS GEMM as its projections, so a
native leaf cannot tell them apart, while the Python frame above it (``bgmv_shrink`` against
``dispatch_cpu_unquantized_gemm``) can.
"""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

# Checked in this order on each Python frame ("function file.py", no directories: the project's own name has "lora"
# in it), innermost first; the first pattern that matches names the bucket.
BUCKETS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("LoRA", re.compile(r"lora|sgmv|bgmv|punica", re.IGNORECASE)),
    ("attention", re.compile(r"attention|attn|sdpa|kv_cache|paged", re.IGNORECASE)),
    ("GEMM", re.compile(r"gemm|linear|matmul|onednn|\bmm\b|lm_head|logits_processor", re.IGNORECASE)),
    ("norm/rope/act", re.compile(r"norm|rotary|rope|silu|activation|act_fn|gelu|softcap", re.IGNORECASE)),
    ("sampler", re.compile(r"sampl|penalt|logprob|grammar", re.IGNORECASE)),
)
# A thread blocked in (or spinning on) one of these is waiting, whatever called it. py-spy's own idle test does not
# hold with --native, and a spin (vLLM's busy loop yields the core between polls) burns a core doing no work.
WAITING = re.compile(
    r"^(wait|_recv|recv|recv_bytes|_recv_bytes|select|poll|sched_yield|_worker|get|acquire|sleep|run|_run_once"
    r"|dequeue|read|readinto|accept)$"
)
WAIT, OTHER = "waiting", "other"
ORDER = [name for name, _ in BUCKETS] + [OTHER]
_PROCESS = re.compile(r'^process (\d+):"(.*)"$')
_PYTHON_FRAME = re.compile(r"^(?P<func>.+) \((?P<path>[^()]*\.py)(?::\d+)?\)$")


@dataclass
class ProcessProfile:
    """Samples of one process, by bucket, and the innermost Python frames of the unbucketed ones."""

    pid: int
    command: str
    buckets: Counter[str] = field(default_factory=Counter)
    unbucketed: Counter[str] = field(default_factory=Counter)

    @property
    def samples(self) -> int:
        """Samples of work: all but the waiting ones."""
        return sum(n for name, n in self.buckets.items() if name != WAIT)

    @property
    def label(self) -> str:
        """A short name: vLLM titles its processes (``VLLM::Worker``); ours are told apart by their command."""
        if self.command.startswith("VLLM::"):
            return self.command.split()[0]
        if "multiprocessing" in self.command:
            return "engine process"
        return Path(self.command.split()[0]).name if self.command else str(self.pid)


def bucket_of(frames: list[str]) -> tuple[str, str]:
    """The bucket of one stack (outermost frame first) and its innermost Python frame."""
    python = [(m["func"], Path(m["path"]).name) for f in reversed(frames) if (m := _PYTHON_FRAME.match(f))]
    if not python:
        return OTHER, frames[-1] if frames else ""
    innermost = f"{python[0][0]} ({python[0][1]})"
    if WAITING.match(python[0][0].rpartition(".")[2]):
        return WAIT, innermost
    for func, file in python:
        for name, pattern in BUCKETS:
            if pattern.search(f"{func} {file}"):
                return name, innermost
    return OTHER, innermost


def parse_raw(text: str) -> list[ProcessProfile]:
    """py-spy's ``--format raw`` output (``-s``: stacks start with one ``process PID:"cmd"`` frame per level)."""
    profiles: dict[int, ProcessProfile] = {}
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = _frames(stack)
        owner = None
        while frames and (match := _PROCESS.match(frames[0])):
            owner = (int(match[1]), match[2])
            frames = frames[1:]
        if owner is None:
            continue
        profile = profiles.setdefault(owner[0], ProcessProfile(*owner))
        name, innermost = bucket_of(frames)
        profile.buckets[name] += int(count)
        if name == OTHER:
            profile.unbucketed[innermost] += int(count)
    return sorted(profiles.values(), key=lambda p: p.samples, reverse=True)


def _frames(stack: str) -> list[str]:
    """A raw stack's frames. A process frame quotes its command line, which may hold ";" itself (our engine
    process is ``python -c "from multiprocessing.spawn import spawn_main; spawn_main(...)"``)."""
    frames: list[str] = []
    for piece in stack.split(";"):
        if frames and frames[-1].startswith("process ") and not _PROCESS.match(frames[-1]):
            frames[-1] += ";" + piece
        else:
            frames.append(piece)
    return frames


class Sampler:
    """py-spy recording a process tree until ``stop``."""

    def __init__(self, pid: int, output: Path, rate: int) -> None:
        self.output, self.rate = output, rate
        exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
        argv = [exe, "record", "--pid", str(pid), "--subprocesses", "--native", "--full-filenames",
                "--nolineno", "--rate", str(rate), "--format", "raw", "--output", str(output)]  # fmt: skip
        self._process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def cancel(self) -> None:
        """Stop sampling and drop what was sampled."""
        self._process.send_signal(signal.SIGINT)
        try:
            self._process.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            self._process.kill()

    def stop(self) -> list[ProcessProfile]:
        """Stop sampling (py-spy writes its file on SIGINT) and read what it wrote."""
        self._process.send_signal(signal.SIGINT)
        _, errors = self._process.communicate(timeout=60)
        if not self.output.exists():
            raise RuntimeError(f"py-spy wrote no profile (exit {self._process.returncode}): {errors.strip()[-500:]}")
        return parse_raw(self.output.read_text())


def require_py_spy() -> None:
    """Fail early, with the fix, where py-spy is missing."""
    if not (shutil.which("py-spy") or Path(sys.executable).with_name("py-spy").exists()):
        raise SystemExit("--profile needs py-spy: pip install -e '.[bench]'")


def breakdown_lines(title: str, profiles: list[ProcessProfile], rate: int, output_tokens: int) -> list[str]:
    """Per process with at least 2% of the working samples: each bucket's share of them and its ms per output
    token (``output_tokens`` 0: shares only), then the time spent waiting or spinning."""
    total = sum(p.samples for p in profiles) or 1
    per_token = 1000 / rate / output_tokens if output_tokens else 0.0
    lines = [title]
    for profile in profiles:
        if profile.samples < 0.02 * total:
            continue
        cells = []
        for name in ORDER:
            n = profile.buckets.get(name, 0)
            if n:
                cells.append(f"{name} {n / profile.samples:.0%}" + (f" ({n * per_token:.2f})" if per_token else ""))
        head = f"{profile.samples * per_token:6.2f} ms/token" if per_token else f"{profile.samples:6d} samples"
        waiting = profile.buckets.get(WAIT, 0)
        tail = f"; waiting {waiting * per_token:.2f} ms/token" if per_token else f"; waiting {waiting} samples"
        lines.append(f"  {profile.label:<16} {head}: " + ", ".join(cells) + tail)
        top = ", ".join(f"{frame} {n / profile.samples:.0%}" for frame, n in profile.unbucketed.most_common(4))
        if top:
            lines.append(f"  {'':<16} other, innermost frames: {top}")
    return lines


def main() -> None:
    """Shares by bucket of saved raw profiles: ``python bench/model_profile.py DIR/*.raw``."""
    for path in sys.argv[1:]:
        for line in breakdown_lines(Path(path).name, parse_raw(Path(path).read_text()), rate=1, output_tokens=0):
            print(line)


if __name__ == "__main__":
    main()
