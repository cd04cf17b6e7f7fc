"""A small random-init Llama-family model and a byte-level tokenizer, written byte-identically for the same arguments.

Tests and the embedded `loraplex up` need a base model without a model hub. Weights come from our own
seeded generator in a fixed order (not from `transformers` init, whose order and defaults change
between releases), and every file is serialised deterministically, so two processes given the same
arguments write the same bytes.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

SPECIAL_TOKENS: tuple[str, ...] = ("<pad>", "<s>", "</s>", "<unk>")
BYTE_OFFSET = len(SPECIAL_TOKENS)  # token id of byte b is b + BYTE_OFFSET
VOCAB_SIZE = BYTE_OFFSET + 256
PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
FAMILIES: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3")
PHI3_WINDOW = 16  # phi3's default window: shorter than test prompts, as Phi-3-mini's 2047 is than its context
GEMMA_WINDOW = 16  # gemma2's and gemma3's default window on their local layers, likewise (Gemma 2's is 4096)

# Loss is computed on what the assistant says, so the template marks it with {% generation %} for
# `return_assistant_tokens_mask`; every turn ends with </s> so generation stops where training did.
# Tools render as Qwen2.5 / Hermes do (the system turn lists them as JSON in <tools>, the assistant
# calls them as <tool_call> JSON, results come back in a tool turn as <tool_response>), so a Hermes
# tool-call parser reads what this model is trained to say. Without tools, nothing of this renders.
TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_POSTAMBLE = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}'
    "\n</tool_call>"
)
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if tools %}"
    "{{ '<|system|>\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\n\n' }}{%- endif %}"
    "{{ " + repr(TOOLS_PREAMBLE) + " }}"  # repr: a Jinja string literal, escapes and all
    "{%- for tool in tools %}{{ '\n' + (tool | tojson) }}{%- endfor %}"
    "{{ " + repr(TOOLS_POSTAMBLE) + " + eos_token + '\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if tools and loop.first and message['role'] == 'system' %}"  # already in the tools turn
    "{%- elif message['role'] == 'assistant' %}"
    "{{ '<|assistant|>\n' }}{% generation %}"
    "{%- if message['content'] %}{{ message['content'] }}{%- endif %}"
    "{%- if message['tool_calls'] %}{%- for tool_call in message['tool_calls'] %}"
    "{%- if message['content'] or not loop.first %}{{ '\n' }}{%- endif %}"
    "{%- set call = tool_call['function'] if tool_call['function'] is defined else tool_call %}"
    "{{ '<tool_call>\n{\"name\": ' + (call['name'] | tojson) + ', \"arguments\": ' }}"
    "{%- if call['arguments'] is string %}{{ call['arguments'] }}"  # as OpenAI sends them
    "{%- else %}{{ call['arguments'] | tojson }}{%- endif %}"
    "{{ '}\n</tool_call>' }}"
    "{%- endfor %}{%- endif %}"
    "{{ eos_token }}{% endgeneration %}{{ '\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{{ '<|tool|>\n<tool_response>\n' + message['content'] + '\n</tool_response>' + eos_token + '\n' }}"
    "{%- else %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token + '\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|assistant|>\n' }}{%- endif %}"
)


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape and family of the tiny model; defaults give a Llama of about 0.5M parameters."""

    hidden: int = 128
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    intermediate: int | None = None  # default: 8/3 * hidden rounded up to a multiple of 64
    seed: int = 0
    initializer_range: float = 0.1
    max_position_embeddings: int = 2048
    family: str = "llama"
    head_dim: int | None = None  # default hidden / heads; for qwen3 twice that, as in Qwen3-0.6B
    # mistral, qwen2, qwen3: a window that matters (qwen: on the upper half of the layers, via max_window_layers);
    # None writes the fields as their released configs do, with a window that never binds (phi3: PHI3_WINDOW).
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"--family must be one of {', '.join(FAMILIES)}, got {self.family!r}")
        if self.head_dim is not None and (self.head_dim < 2 or self.head_dim % 2):
            raise ValueError(f"--head-dim must be an even number >= 2, got {self.head_dim}")
        if self.family == "phi3" and self.head_dim is not None:
            raise ValueError("--head-dim is not a Phi-3 setting: its heads are hidden / heads wide")
        if self.sliding_window is not None and (self.family == "llama" or self.sliding_window < 1):
            raise ValueError("--sliding-window takes a positive number of tokens, for every family but llama")
        if self.hidden % self.heads:
            raise ValueError(f"--hidden ({self.hidden}) must be divisible by --heads ({self.heads})")
        if self.heads % self.kv_heads:
            raise ValueError(f"--heads ({self.heads}) must be divisible by --kv-heads ({self.kv_heads})")
        if min(self.hidden, self.layers, self.heads, self.kv_heads) < 1:
            raise ValueError("--hidden, --layers, --heads and --kv-heads must be >= 1")
        if self.family == "phi3" and int(self.hidden // self.heads * 0.75) % 2:
            raise ValueError(
                f"phi3 rotates 3/4 of each head: 3/4 of hidden / heads ({self.hidden // self.heads}) must be even"
            )

    @property
    def intermediate_size(self) -> int:
        if self.intermediate is not None:
            return self.intermediate
        return int(math.ceil(self.hidden * 8 / 3 / 64) * 64)

    @property
    def head_size(self) -> int:
        if self.head_dim is not None:
            return self.head_dim
        return self.hidden // self.heads * (2 if self.family == "qwen3" else 1)

    def config(self) -> dict:
        """The `config.json` the family's transformers class (e.g. `LlamaForCausalLM`) loads."""
        llama = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "bos_token_id": BOS_ID,
            "eos_token_id": EOS_ID,
            "pad_token_id": PAD_ID,
            "head_dim": self.head_size,
            "hidden_act": "silu",
            "hidden_size": self.hidden,
            "initializer_range": self.initializer_range,
            "intermediate_size": self.intermediate_size,
            "max_position_embeddings": self.max_position_embeddings,
            "mlp_bias": False,
            "num_attention_heads": self.heads,
            "num_hidden_layers": self.layers,
            "num_key_value_heads": self.kv_heads,
            "rms_norm_eps": 1e-5,
            "rope_scaling": None,
            "rope_theta": 10000.0,
            "tie_word_embeddings": False,
            "torch_dtype": "float32",
            "use_cache": True,
            "vocab_size": VOCAB_SIZE,
        }
        if self.family == "llama":
            return llama
        if self.family in ("gemma2", "gemma3"):
            return self._gemma_config(llama)
        del llama["attention_bias"], llama["mlp_bias"]
        window = self.sliding_window
        if self.family == "mistral":  # as Mistral-7B-v0.3, with a window as long as the context
            return {
                **llama,
                "architectures": ["MistralForCausalLM"],
                "model_type": "mistral",
                "rope_theta": 1000000.0,
                "sliding_window": window or self.max_position_embeddings,
            }
        qwen = {  # as Qwen2.5 and Qwen3: sliding-window fields present, switched off
            **llama,
            "architectures": ["Qwen2ForCausalLM"],
            "model_type": "qwen2",
            "max_window_layers": self.layers if window is None else self.layers // 2,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0,
            "sliding_window": window or self.max_position_embeddings,
            "use_sliding_window": window is not None,
        }
        if self.family == "qwen2":
            return qwen
        if self.family == "phi3":
            return self._phi3_config(llama)
        return {
            **qwen,
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "attention_bias": False,
            "sliding_window": window,
        }

    def _phi3_config(self, llama: dict) -> dict:
        """As Phi-4-mini (LongRoPE with its original context a quarter of the full one, 3/4 of each head rotated,
        tied embeddings), with Phi-3-mini's sliding window on every layer."""
        pairs = int(self.head_size * 0.75) // 2  # one factor per rotated pair of dims
        config = {
            **llama,
            "architectures": ["Phi3ForCausalLM"],
            "model_type": "phi3",
            "embd_pdrop": 0.0,
            "original_max_position_embeddings": max(1, self.max_position_embeddings // 4),
            "partial_rotary_factor": 0.75,
            "resid_pdrop": 0.0,
            "rope_scaling": {
                "long_factor": [round(1.0 + 2.0 * k, 4) for k in range(pairs)],
                "short_factor": [round(1.0 + 0.02 * k, 4) for k in range(pairs)],
                "type": "longrope",
            },
            "sliding_window": self.sliding_window or PHI3_WINDOW,
            "tie_word_embeddings": True,
        }
        del config["head_dim"]  # Phi3Config has none
        return config

    def _gemma_config(self, llama: dict) -> dict:
        """As released Gemma 2 2B (soft-capping, every other layer local) or Gemma 3 1B (``gemma3_text``: q/k
        norms, local layers with their own rope base, every sixth layer global, or the last of fewer layers),
        with a local window of GEMMA_WINDOW tokens and attention scaled by head_dim as theirs are."""
        config = {
            **llama,
            "architectures": ["Gemma2ForCausalLM"],
            "model_type": "gemma2",
            "attn_logit_softcapping": 50.0,
            "cache_implementation": "hybrid",
            "final_logit_softcapping": 30.0,
            "hidden_act": "gelu_pytorch_tanh",
            "hidden_activation": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": self.head_size,
            "rms_norm_eps": 1e-6,
            "sliding_window": self.sliding_window or GEMMA_WINDOW,
            "tie_word_embeddings": True,
        }
        del config["mlp_bias"]
        if self.family == "gemma2":
            return config
        del config["hidden_act"]
        return {
            **config,
            "architectures": ["Gemma3ForCausalLM"],
            "model_type": "gemma3_text",
            "attn_logit_softcapping": None,
            "final_logit_softcapping": None,
            "rope_local_base_freq": 10000.0,
            "rope_theta": 1000000.0,
            "sliding_window_pattern": min(6, self.layers),
        }


def _weights(spec: TinyModelSpec) -> dict:
    import torch

    gen = torch.Generator().manual_seed(spec.seed)
    h, i, d = spec.hidden, spec.intermediate_size, spec.head_size
    q, kv = spec.heads * d, spec.kv_heads * d

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float32) * spec.initializer_range

    tensors = {"model.embed_tokens.weight": normal(VOCAB_SIZE, h)}
    for layer in range(spec.layers):
        p = f"model.layers.{layer}."
        tensors[p + "input_layernorm.weight"] = torch.ones(h)
        tensors[p + "self_attn.q_proj.weight"] = normal(q, h)
        tensors[p + "self_attn.k_proj.weight"] = normal(kv, h)
        tensors[p + "self_attn.v_proj.weight"] = normal(kv, h)
        tensors[p + "self_attn.o_proj.weight"] = normal(h, q)
        tensors[p + "post_attention_layernorm.weight"] = torch.ones(h)
        tensors[p + "mlp.gate_proj.weight"] = normal(i, h)
        tensors[p + "mlp.up_proj.weight"] = normal(i, h)
        tensors[p + "mlp.down_proj.weight"] = normal(h, i)
        # Drawn after the Llama tensors of the layer, so a Llama's weights do not depend on the family code.
        if spec.family == "qwen2":
            for name, size in (("q", q), ("k", kv), ("v", kv)):
                tensors[p + f"self_attn.{name}_proj.bias"] = normal(size)
        if spec.family == "qwen3":
            tensors[p + "self_attn.q_norm.weight"] = torch.ones(d)
            tensors[p + "self_attn.k_norm.weight"] = torch.ones(d)
        if spec.family in ("gemma2", "gemma3"):  # Gemma norms scale by 1 + w: zeros, as transformers initialises them
            for name in ("input", "post_attention", "pre_feedforward", "post_feedforward"):
                tensors[p + f"{name}_layernorm.weight"] = torch.zeros(h)
        if spec.family == "gemma3":
            tensors[p + "self_attn.q_norm.weight"] = torch.zeros(d)
            tensors[p + "self_attn.k_norm.weight"] = torch.zeros(d)
        if spec.family == "phi3":  # Phi-3 checkpoints store q/k/v and gate/up as one matrix each
            attn = [tensors.pop(p + f"self_attn.{x}_proj.weight") for x in "qkv"]
            tensors[p + "self_attn.qkv_proj.weight"] = torch.cat(attn)
            mlp = [tensors.pop(p + f"mlp.{x}_proj.weight") for x in ("gate", "up")]
            tensors[p + "mlp.gate_up_proj.weight"] = torch.cat(mlp)
    tensors["model.norm.weight"] = torch.zeros(h) if spec.family in ("gemma2", "gemma3") else torch.ones(h)
    if spec.family not in ("phi3", "gemma2", "gemma3"):  # these tie lm_head to the embeddings
        tensors["lm_head.weight"] = normal(VOCAB_SIZE, h)
    return tensors


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map, computed (never read from `ByteLevel.alphabet()`)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def _tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for b, ch in bytes_to_unicode().items():
        vocab[ch] = b + BYTE_OFFSET
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)]
    )
    # Round-trip through json so key order is canonical whatever the tokenizers version emits.
    return json.dumps(json.loads(tok.to_str()), sort_keys=True, indent=1, ensure_ascii=False)


def _tokenizer_config(max_len: int) -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "model_max_length": max_len,
        "padding_side": "right",
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


def _write_text(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


def make_tiny_model(out_dir: str | Path, spec: TinyModelSpec | None = None) -> Path:
    """Write config, safetensors weights and tokenizer files of a tiny model into ``out_dir``."""
    from safetensors.torch import save_file

    spec = spec or TinyModelSpec()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    def dump(obj: dict) -> str:
        return json.dumps(obj, sort_keys=True, indent=2) + "\n"

    _write_text(out / "config.json", dump(spec.config()))
    _write_text(
        out / "generation_config.json",
        dump({"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}),
    )
    tmp = out / "model.safetensors.tmp"
    save_file(_weights(spec), str(tmp), metadata={"format": "pt"})
    tmp.chmod(0o644)  # save_file creates 0600; containers run the server as another user
    tmp.replace(out / "model.safetensors")
    _write_text(out / "tokenizer.json", _tokenizer_json() + "\n")
    _write_text(out / "tokenizer_config.json", dump(_tokenizer_config(spec.max_position_embeddings)))
    _write_text(
        out / "special_tokens_map.json",
        dump({"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"}),
    )
    return out
