import sys

from laconic_nemo.cli import main

sys.exit(main())
