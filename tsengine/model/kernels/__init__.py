"""Triton kernels. Imported lazily (only the "triton" backend needs them), so a box without Triton still runs
the torch reference."""
