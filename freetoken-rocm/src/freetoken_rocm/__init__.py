"""freetoken_rocm (placeholder until its issue lands)."""
__version__ = "0.1.0"
