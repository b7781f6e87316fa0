"""freetoken_cpu_moe (placeholder until its issue lands)."""
__version__ = "0.1.0"
