"""freetoken_cuda (placeholder until its issue lands)."""
__version__ = "0.1.0"
