"""``python -m scripts.bench``: see scripts/bench/run.py."""
import sys

from scripts.bench.run import main

sys.exit(main())
