"""bench/model_profile.py: py-spy's raw stacks sorted into buckets per process."""

from __future__ import annotations

from bench.model_profile import OTHER, WAIT, breakdown_lines, bucket_of, parse_raw

SERVER = 'process 10:"/venv/bin/python3 /venv/bin/loraplex server --model /m"'
ENGINE = 'process 11:"/venv/bin/python3 -B -c from multiprocessing.spawn import spawn_main; spawn_main(pipe_handle=6)"'
WORKER = 'process 20:"VLLM::Worker"'


def stack(*frames: str, count: int) -> str:
    return ";".join(frames) + f" {count}"


RAW = "\n".join(
    [
        # our engine: the GEMM under a path with "lora" in it (the project's name) is still GEMM
        stack(
            SERVER,
            ENGINE,
            "LlamaModel._layer (/work/loraplex/server/model/llama.py)",
            "panel_linear (/work/loraplex/loraplex_kernels/cpu_linear.py)",
            "panel_block (cpu_loops.so)",
            count=6,
        ),
        stack(
            SERVER,
            ENGINE,
            "LlamaModel._layer (/w/server/model/llama.py)",
            "add_lora_planned (/w/loraplex_kernels/torch_ops.py)",
            "lora_work (cpu_loops.so)",
            count=2,
        ),
        stack(
            SERVER, ENGINE, "LlamaModel._layer (/w/server/model/llama.py)", "paged_attention (/w/attention.py)", count=1
        ),
        stack(SERVER, ENGINE, "Connection._recv (/py/multiprocessing/connection.py)", "read (libc.so.6)", count=5),
        stack(SERVER, "RequestResponseCycle.send (/site/uvicorn/httptools_impl.py)", count=1),
        # vLLM's LoRA ends in the same BLAS as its projections: the Python frame above decides
        stack(
            WORKER,
            "apply (/v/vllm/lora/layers/base_linear.py)",
            "bgmv_shrink (/v/vllm/lora/ops/torch_ops/lora_ops.py)",
            "mkl_sgemm (libtorch_cpu.so)",
            count=3,
        ),
        stack(
            WORKER,
            "apply (/v/vllm/lora/layers/base_linear.py)",
            "dispatch_cpu_unquantized_gemm (/v/vllm/model_executor/layers/utils.py)",
            "OpOverloadPacket.__call__ (/t/torch/_ops.py)",
            "0x7f00 (?)",
            count=4,
        ),
        stack(WORKER, "MessageQueue.dequeue (/v/shm_broadcast.py)", "sched_yield (/v/vllm/utils.py)", count=7),
    ]
)


def test_each_process_gets_its_own_buckets() -> None:
    profiles = {p.label: p for p in parse_raw(RAW)}
    assert set(profiles) == {"engine process", "VLLM::Worker", "python3"}
    engine = profiles["engine process"]
    assert dict(engine.buckets) == {"GEMM": 6, "LoRA": 2, "attention": 1, WAIT: 5}
    assert engine.samples == 9  # waiting is not work
    worker = profiles["VLLM::Worker"]
    assert dict(worker.buckets) == {"LoRA": 3, "GEMM": 4, WAIT: 7}
    server = profiles["python3"]
    assert dict(server.buckets) == {OTHER: 1}
    assert server.unbucketed == {"RequestResponseCycle.send (httptools_impl.py)": 1}


def test_a_wait_is_judged_on_the_innermost_python_frame_only() -> None:
    """A model step is not waiting because an outer frame (the engine loop's ``run``) has a waiting name."""
    assert bucket_of(["EngineLoop.run (/w/loop.py)", "panel_linear (/w/cpu_linear.py)"])[0] == "GEMM"
    assert bucket_of(["EngineLoop.run (/w/loop.py)", "Condition.wait (/py/threading.py)"])[0] == WAIT
    assert bucket_of(["0x1 (libc.so.6)"]) == (OTHER, "0x1 (libc.so.6)")


def test_breakdown_gives_shares_and_milliseconds_per_output_token() -> None:
    lines = breakdown_lines("base / ours", parse_raw(RAW), rate=100, output_tokens=10)
    assert lines[0] == "base / ours"
    engine = next(line for line in lines if "engine process" in line)
    # 9 working samples at 100 Hz over 10 tokens: 9 ms per token; GEMM 6 of them
    assert "9.00 ms/token" in engine and "GEMM 67% (6.00)" in engine and "waiting 5.00 ms/token" in engine
    shares_only = breakdown_lines("saved", parse_raw(RAW), rate=1, output_tokens=0)
    assert any("9 samples" in line and "GEMM 67%" in line for line in shares_only)
