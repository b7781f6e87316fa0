"""Startup qualification of the hybrid MoE hand-off: :func:`.startup.qualify` (the entry) runs
the checks of :mod:`.checks` on the backend's IO paths and graph capture."""
