"""Compile every Triton kernel for CUDA targets without a GPU and report what the PTX does.

Run as ``TRITON_INTERPRET=0 python -m tests.unit.kernels.compile_cuda [--full]`` (the kernels must be
decorated as real JIT functions, so never import this where the interpreter is on). Prints one JSON
object: for each (kernel, dtype, arch, row_align) whether it uses tensor cores, how many 16-byte
async copies it issues and how many scalar 16-bit global loads remain.
"""

from __future__ import annotations

import json
import re
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from loraplex_kernels import triton_attention, triton_prefill, triton_sgmv

# Arguments that are unit strides in practice: triton specialises those to the constant 1.
UNIT = {"stride_xk", "stride_vr", "stride_ar", "stride_rp", "stride_yn", "stride_br", "stride_sp", "stride_qd"}
UNIT |= {"stride_kd", "stride_vd", "stride_od", "stride_tn", "stride_pp"}
FP32_POINTERS = {"v_ptr", "scales_ptr", "part_m_ptr", "part_l_ptr", "part_o_ptr"}
INT_POINTERS = {"a_rows_ptr": "*i64", "b_rows_ptr": "*i64", "token_index_ptr": "*i64", "ranks_ptr": "*i32"}
INT_POINTERS |= {"starts_ptr": "*i32", "lengths_ptr": "*i32", "slots_ptr": "*i32", "block_tables_ptr": "*i32"}
INT_POINTERS |= {"context_lens_ptr": "*i32", "query_starts_ptr": "*i32", "query_lens_ptr": "*i32"}
FP32_SCALARS = {"scale_log2", "softcap_log2"}


def _compile(fn, dtype: str, arch: int, constexprs: dict, num_warps: int, num_stages: int) -> dict:
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs or name in UNIT:
            signature[name] = "constexpr"
            constexprs.setdefault(name, 1)
        elif name.endswith("_ptr"):
            signature[name] = INT_POINTERS.get(name, "*fp32" if name in FP32_POINTERS else f"*{dtype}")
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in FP32_SCALARS:
            signature[name] = "fp32"
        else:
            # Widths, strides and offsets of real models are multiples of 16; triton specialises on that.
            signature[name] = "i32"
            attrs[(i,)] = [["tt.divisibility", 16]]
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    options = {"num_warps": num_warps, "num_stages": num_stages}
    ptx = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options).asm["ptx"]
    return {
        "tensor_cores": bool(re.search(r"\b(?:wg|w)?mma\.", ptx)),  # mma.sync (sm_80), wgmma (sm_90)
        "cp_async_16": len(re.findall(r"cp\.async\.\w+\.shared\.global\s+\[[^\]]*\],\s*\[[^\]]*\],\s*0x10", ptx)),
        "scalar_16bit_loads": len(re.findall(r"ld\.global(?:\.\w+)*\.b16\b", ptx)),
    }


def main(full: bool) -> None:
    """Compile for sm_90 with bf16 and aligned rows (plus fp32, sm_80 and unaligned rows when ``full``)."""
    report = {}
    for dtype in ("bf16", "fp32") if full else ("bf16",):
        for arch in (80, 90) if full else (90,):
            for align in (1, 8) if full else (8,):
                common = {"HAS_INDEX": True, "ROW_ALIGN": align, "INTERPRET": False, "BLOCK_M": 16, "BLOCK_R": 64}
                shrink = {**common, "BLOCK_K": 128, "SPLIT_K": 4}
                report[f"shrink/{dtype}/sm{arch}/align{align}"] = _compile(
                    triton_sgmv._shrink_kernel, dtype, arch, shrink, num_warps=4, num_stages=3
                )
                report[f"expand/{dtype}/sm{arch}/align{align}"] = _compile(
                    triton_sgmv._expand_kernel, dtype, arch, {**common, "BLOCK_N": 128}, num_warps=4, num_stages=2
                )
            decode = {"BLOCK_SIZE": 16, "BLOCK_G": 16, "BLOCK_D": 128, "BLOCK_N": 64, "SPLIT": True, "INTERPRET": False}
            report[f"decode/{dtype}/sm{arch}"] = _compile(
                triton_attention._decode_kernel, dtype, arch, decode, num_warps=4, num_stages=2
            )
            prefill = {"BLOCK_SIZE": 16, "BLOCK_Q": 32, "BLOCK_G": 4, "BLOCK_D": 128, "BLOCK_N": 64}
            report[f"prefill/{dtype}/sm{arch}"] = _compile(
                triton_prefill._prefill_kernel,
                dtype,
                arch,
                {**prefill, "SOFTCAP": False, "INTERPRET": False},
                num_warps=4,
                num_stages=2,
            )
            report[f"merge/{dtype}/sm{arch}"] = _compile(
                triton_attention._merge_kernel, dtype, arch, {"BLOCK_P": 32, "BLOCK_D": 128}, num_warps=4, num_stages=1
            )
    json.dump(report, sys.stdout)


if __name__ == "__main__":
    main(full="--full" in sys.argv[1:])
