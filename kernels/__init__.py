"""Fused Triton kernels over vocab-parallel logits (imported as megagrpo.kernels)."""
