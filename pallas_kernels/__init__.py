"""Kernels of mtp_jax, one folder per op: ``reference.py`` (XLA, runs on CPU, the test oracle)
and, where speed needs it, a Pallas implementation behind ``api.py``."""
