"""``python -m laconic_nemo.nemo_entry``: the in-container entry point, kept at this module path for the launch
scripts (``launch/submit.sh``) and the commands ``laconic-nemo plan`` prints. The code lives in
:mod:`laconic_nemo.app.nemo_entry`."""

import sys

from laconic_nemo.app.nemo_entry import *  # noqa: F401,F403
from laconic_nemo.app.nemo_entry import main

if __name__ == "__main__":
    sys.exit(main())
