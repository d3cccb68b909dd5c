"""Settings every test runs under."""

import os

# `plait train` on the local-cpu preset measures a quick profile of the machine first (plait/train/calibration.py):
# tests plan on the preset itself, so that their plans do not depend on how loaded the machine was when it was
# measured; tests of the quick profile clear this variable.
os.environ["PLAIT_NO_PROFILE"] = "1"
