"""Run with -m: write ``__name__``, ``sys.argv`` and the rank as JSON to ``<argv[1]>/<RANK>.json``."""

import json
import os
import sys

out_dir = sys.argv[1]
with open(os.path.join(out_dir, f"{os.environ.get('RANK', 'plain')}.json"), "w") as f:
    json.dump({"name": __name__, "argv": sys.argv}, f)
