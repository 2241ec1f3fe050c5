"""``flash_attn.layers`` on flashattn: ``rotary`` (``apply_rotary_emb``, ``RotaryEmbedding``)."""
