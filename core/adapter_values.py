"""An adapter's weight values, checked where torch is not loaded (the API): NaN and inf are found by
their bits, so an adapter that no server would load is refused at upload rather than on every request.

A float is NaN or infinite exactly when all its exponent bits are set; that test reads the safetensors
data as unsigned integers, in chunks, for F32, F16 and BF16 alike.
"""

from __future__ import annotations

import json

from core.adapter_format import ADAPTER_WEIGHTS_FILE, AdapterShapeError, AdapterSpec, module_name

CHUNK_BYTES = 4 << 20  # a multiple of every element size
EXPONENT_BITS = {"F32": ("<u4", 0x7F800000), "F16": ("<u2", 0x7C00), "BF16": ("<u2", 0x7F80)}


def check_finite_weights(spec: AdapterSpec) -> None:
    """Raise ``AdapterShapeError`` naming the first adapted module whose A or B holds NaN or inf."""
    import numpy as np

    path = spec.path / ADAPTER_WEIGHTS_FILE
    with path.open("rb") as f:
        header_bytes = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_bytes))  # already parsed and checked by inspect_adapter
        data_start = 8 + header_bytes
        for module in spec.modules:
            for key in (module.a_key, module.b_key):
                info = header[key]
                layout, mask = EXPONENT_BITS[info["dtype"]]
                begin, end = info["data_offsets"]
                f.seek(data_start + begin)
                while begin < end:
                    chunk = f.read(min(CHUNK_BYTES, end - begin))
                    begin += len(chunk)
                    if (np.frombuffer(chunk, dtype=layout) & mask == mask).any():
                        name = module_name(module.layer, module.projection)
                        raise AdapterShapeError(f"{name} holds NaN or inf", param=key)
