"""freetoken-fakegpu: an example backend plugin with a simulated GPU.

The "GPU" shares the host's memory and runs each stream as a host thread that
executes enqueued operations in order, so the hand-off protocol and its ordering
guarantees can be exercised on a machine without a GPU. It is selected only by
name (``--backend fakegpu``); no automatic rule picks it.
"""

__version__ = "0.1.0"
