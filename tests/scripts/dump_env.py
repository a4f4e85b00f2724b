"""Write this worker's environment and ``sys.argv`` as JSON to ``$DUMP_ENV_DIR/<RANK>.json``.

The directory comes from the environment, not the command line, so that runs under different launchers can be
given identical script arguments.
"""

import json
import os
import sys

with open(os.path.join(os.environ["DUMP_ENV_DIR"], f"{os.environ['RANK']}.json"), "w") as f:
    json.dump({"env": dict(os.environ), "argv": sys.argv}, f)
