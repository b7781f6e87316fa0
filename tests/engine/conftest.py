import os
import sys

# helpers.py and the GGUF writer of test_engine_gguf are imported by several test modules
sys.path.insert(0, os.path.dirname(__file__))
