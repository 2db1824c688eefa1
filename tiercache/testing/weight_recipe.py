"""The scales of the random test weights: what makes a random model context sensitive.

Shared by tiercache/testing/random_llama.py (Llama) and random_lfm2.py (LFM2);
random_llama.py's docstring says why each scale is what it is.
"""

from __future__ import annotations

import math

SCORE_STD = 3.0
ATTN_OUT_STD = 2.0
# Attention averages several values even when sharp (the top key gets ~0.3-0.6 of
# the weight at score std 3), which shrinks the output; this gain makes up for it
# (measured attention-output std on the tiny model: ~1.5-1.9 with it, ~1.0-1.5 without).
ATTN_MIX_GAIN = 1.5
LOGIT_STD = 3.0


def weight_scales(config: dict) -> dict[str, float]:
    """Per-matrix init std devs (entries ~ N(0, s^2)) derived from the config.

    Inputs to every projection are RMS-normalised (rms 1 per element), so a
    matrix with fan-in ``n`` and entry std ``s`` gives outputs of std ``sqrt(n)*s``.
    """
    d = int(config["hidden_size"])
    inter = int(config["intermediate_size"])
    # q and k elements have std sqrt(d)*s, and score = q.k / sqrt(head_dim) has std
    # d * s_q * s_k; split SCORE_STD evenly between q and k.
    qk = math.sqrt(SCORE_STD / d)
    # v elements get std 1; o (fan-in d) then gives an attention output of std
    # ATTN_OUT_STD for one-hot attention, ATTN_MIX_GAIN compensates for averaging.
    v = 1.0 / math.sqrt(d)
    o = ATTN_OUT_STD * ATTN_MIX_GAIN / math.sqrt(d)
    return {
        "q": qk,
        "k": qk,
        "v": v,
        "o": o,
        "gate": 1.0 / math.sqrt(d),
        "up": 1.0 / math.sqrt(d),
        "down": 1.0 / math.sqrt(inter),
        "lm_head": LOGIT_STD / math.sqrt(d),
        "embed": 1.0,
    }
