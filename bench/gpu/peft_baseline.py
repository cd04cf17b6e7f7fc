"""transformers + PEFT on a device: every adapter loaded into one model, generating one request or a mixed batch.

``bench.common.load_peft`` builds the model on the CPU and lets PEFT initialise each adapter's layers before
loading them (a minute for 64 adapters on a 1B model) and upcasts bf16 adapters to fp32; here the base loads
straight onto the device and adapters load without the throwaway init (``low_cpu_mem_usage``) and in the
model's dtype, so PEFT computes LoRA in bf16 as our engine does: its best showing, not a handicapped one.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import torch

Request = tuple[list[int], str | None, int]  # prompt token ids, adapter name (None: base), output tokens


def load_peft_on(
    model_dir: Path, adapters: dict[str, Path], dtype: torch.dtype, device: str, attn: str = "sdpa"
) -> Any:
    """A ``PeftModel`` on ``device`` in ``dtype`` holding every adapter of ``adapters`` under its name, in eval mode.
    ``attn``: transformers' attention implementation (``eager`` is the plain reference, ``sdpa`` the fast one)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation=attn).to(device)
    kwargs = {"autocast_adapter_dtype": False}
    if "low_cpu_mem_usage" in inspect.signature(PeftModel.load_adapter).parameters:  # PEFT >= 0.13
        kwargs["low_cpu_mem_usage"] = True
    (first, path), *rest = adapters.items()
    model = PeftModel.from_pretrained(base, path, adapter_name=first, **kwargs)
    for name, path in rest:
        model.load_adapter(path, adapter_name=name, **kwargs)
    # Adapters loaded with low_cpu_mem_usage land where their tensors were read (the CPU): follow the base.
    return model.to(device).eval()


def generate_one(model: Any, prompt: list[int], adapter: str | None, max_tokens: int, **generate: Any) -> list[int]:
    """Greedy tokens of one request alone (no padding): the reference a parity check compares against (also the
    engine parity suite's, ``tests/integration/engine/test_peft_parity.py``); ``generate``: more of its options."""
    ids = torch.tensor([prompt], device=model.device)
    # eos_token_id None: run to max_tokens without masking EOS (min_new_tokens would), as ignore_eos does in ours.
    kwargs = {"max_new_tokens": max_tokens, "eos_token_id": None, "do_sample": False, "pad_token_id": 0, **generate}
    with torch.inference_mode():
        if adapter is None:
            with model.disable_adapter():
                out = model.generate(ids, **kwargs)
        else:
            model.set_adapter(adapter)
            out = model.generate(ids, **kwargs)
    return out[0, len(prompt) :].tolist()


def generate_mixed_batch(model: Any, requests: list[Request]) -> int:
    """One left-padded ``generate(adapter_names=...)`` over every request (PEFT's mixed-adapter batch), run to the
    longest output; returns the useful tokens: each request's own output length ("__base__": no adapter)."""
    longest_prompt = max(len(p) for p, _, _ in requests)
    ids = torch.zeros(len(requests), longest_prompt, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, (prompt, _, _) in enumerate(requests):
        ids[row, longest_prompt - len(prompt) :] = torch.tensor(prompt)
        mask[row, longest_prompt - len(prompt) :] = 1
    longest = max(n for _, _, n in requests)
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids.to(model.device),
            attention_mask=mask.to(model.device),
            adapter_names=[adapter or "__base__" for _, adapter, _ in requests],
            max_new_tokens=longest,
            eos_token_id=None,
            do_sample=False,
            pad_token_id=0,
        )
    produced = out.shape[1] - longest_prompt  # reading the shape needs no sync; the caller syncs before timing
    return sum(min(n, produced) for _, _, n in requests)
