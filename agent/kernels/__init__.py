"""Fused device kernels for the agent's per-step checks (optional: Triton, the ``gpu`` extra).

Nothing here is imported by the agent unless ``SDCGUARD_FINGERPRINT_KERNEL=triton``
asks for it, so a CPU-only installation never needs Triton.
"""
