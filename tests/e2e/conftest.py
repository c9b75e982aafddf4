"""The lane's tests import scenario code (``generated.py``) that names the probe's keys:
the probe's folder on the path, as the scenarios' processes have it (``harness.engine_env``)."""

import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent / "engine_plugins"))
