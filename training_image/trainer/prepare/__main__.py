"""`python -m trainer.prepare` (the processing job's entrypoint): trainer.prepare.pipeline.main."""

import sys

from trainer.prepare.pipeline import main

if __name__ == "__main__":
    sys.exit(main())
