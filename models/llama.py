"""The Llama family's presets: settings of the one decoder in models/gpt.py (grouped-query attention, SwiGLU,
RMSNorm with eps 1e-5, RoPE base 500,000 with Llama 3.1's frequency scaling, no biases).

`1b` is Llama 3.2 1B and `8b` Llama 3.1 8B, shape for shape (their published configs); `num_params()` equals the
published counts, 1,235,814,400 and 8,030,261,248 (tests/test_llama.py). `tiny` is the tests' model and `cpu` the
benchmark shape: the gpt `cpu` preset's sizes with SwiGLU and 2 key/value heads.
"""

from __future__ import annotations

import functools

from .gpt import GPTConfig

LLAMA3 = dict(
    mlp="swiglu",
    norm_eps=1e-5,
    rope_base=500_000.0,
    rope_scaling="llama3",
    rope_low_freq_factor=1.0,
    rope_high_freq_factor=4.0,
    rope_original_context=8192,
)
llama = functools.partial(GPTConfig, **LLAMA3)

PRESETS = {
    "tiny": lambda: llama(
        vocab_size=256,
        n_layers=2,
        d_model=64,
        n_heads=4,
        n_kv_heads=2,
        d_ff=256,
        dtype="float32",
        tie_embeddings=True,
        rope_factor=32.0,
    ),
    "cpu": lambda: llama(
        vocab_size=256, n_layers=4, d_model=256, n_heads=4, n_kv_heads=2, d_ff=1024, remat="save_dots", rope_factor=32.0
    ),
    "1b": lambda: llama(
        vocab_size=128_256,
        n_layers=16,
        d_model=2048,
        n_heads=32,
        n_kv_heads=8,
        d_ff=8192,
        tie_embeddings=True,
        rope_factor=32.0,
    ),
    "8b": lambda: llama(
        vocab_size=128_256, n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8, d_ff=14_336, rope_factor=8.0
    ),
}
