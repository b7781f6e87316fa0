import os
import sys

# the engine tests' helpers (engine_for, LogitsRecorder, assert_close)
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "engine"))
sys.path.insert(0, os.path.dirname(__file__))
