"""The version of freetoken-core; every FreeToken package must carry the same one."""

__version__ = "0.1.0"
