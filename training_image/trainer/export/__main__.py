"""`python -m trainer.export` (the export job's entrypoint): trainer.export.hf_folder.main, its every
failure written to the job's failure file with its class (trainer.runtime.failure)."""

import sys

from trainer.export.hf_folder import main
from trainer.runtime.failure import run_reporting

if __name__ == "__main__":
    sys.exit(run_reporting(main))
