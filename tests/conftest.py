import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The tests share the example's GPT; spawned workers inherit this sys.path.
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "tests"))
# Caches could hide a changed pass between runs.
os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "0")
os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "0")
