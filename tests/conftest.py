import sys
from pathlib import Path

# The tests import the harness beside them and, for unit tests, common.py from the root.
sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).resolve().parent.parent)]
