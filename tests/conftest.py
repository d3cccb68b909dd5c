"""Settings every test runs under."""

import os
import sys
from pathlib import Path

# the published runs the cost model is fitted on and checked against live with the benchmarks that price them
# (benchmarks/published.py, benchmarks/published_2024.py); the tests check the same rows
sys.path.append(str(Path(__file__).resolve().parents[1] / "benchmarks"))

# `plait train` on the local-cpu preset measures a quick profile of the machine first (plait/profile/quick.py):
# tests plan on the preset itself, so that their plans do not depend on how loaded the machine was when it was
# measured; tests of the quick profile clear this variable.
os.environ["PLAIT_NO_PROFILE"] = "1"
